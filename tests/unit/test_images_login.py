"""The guest image's login scripts fork no program bash answers itself
(`boxd.images._rootfs.fast_login`), and still do what Debian's do: the same PATH for
root and for another user, under bash and under dash (which has no EUID).

Debian's two scripts are reproduced here as bookworm ships them (the parts the edits
touch); tests/integration/test_e2b.py runs the SDK's login shells in real machines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from boxd.images._rootfs import fast_login

PROFILE = """\
if [ "$(id -u)" -eq 0 ]; then
  PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
else
  PATH="/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
fi
export PATH

if [ "${PS1-}" ]; then
  if [ "${BASH-}" ] && [ "$BASH" != "/bin/sh" ]; then
    :
  else
    if [ "$(id -u)" -eq 0 ]; then
      PS1='# '
    else
      PS1='$ '
    fi
  fi
fi
"""
ROOT_PROFILE = """\
# ~/.profile: executed by Bourne-compatible login shells.

if [ "$BASH" ]; then
  if [ -f ~/.bashrc ]; then
    . ~/.bashrc
  fi
fi

mesg n 2> /dev/null || true
"""


def _tree(tmp: Path) -> Path:
    root = tmp / "root"
    (root / "etc").mkdir(parents=True)
    for d in (tmp, *tmp.parents):  # readable by the other user the test runs them as
        if d == Path(tempfile.gettempdir()):
            break
        d.chmod(d.stat().st_mode | 0o755)
    (root / "root").mkdir()
    (root / "etc/profile").write_text(PROFILE)
    (root / "root/.profile").write_text(ROOT_PROFILE)
    return root


def _login(root: Path, shell: str, as_nobody: bool, ps1: str = "") -> str:
    """PATH and PS1 after sourcing the image's /etc/profile (PS1 set: interactive)."""
    script = f'PS1="{ps1}"; . {root}/etc/profile && echo "$PATH|$PS1"'
    kw = {"user": "nobody"} if as_nobody else {}
    out = subprocess.run([shell, "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"]}, **kw)  # type: ignore[call-overload]
    return str(out.stdout)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the scripts as another user: needs root")
@pytest.mark.parametrize("shell", ["bash", "dash"])
def test_the_edited_profile_does_what_debians_does(tmp_path: Path, shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed (scripts/setup-host.sh installs both)")
    before = _tree(tmp_path / "before")
    after = _tree(tmp_path / "after")
    fast_login(after)
    assert (after / "etc/profile").read_text() != PROFILE
    root_path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    user_path = "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
    for nobody, path in ((False, root_path), (True, user_path)):
        for ps1 in ("", "x"):
            got = _login(after, shell, nobody, ps1)
            assert got == _login(before, shell, nobody, ps1)
            assert got.startswith(f"{path}|")
    # dash sets the prompt by the uid too (bash leaves it to bash.bashrc)
    if shell == "dash":
        assert _login(after, shell, True, "x") == f"{user_path}|$ \n"
        assert _login(after, shell, False, "x") == f"{root_path}|# \n"


def test_a_bash_login_runs_no_program_to_learn_its_uid(tmp_path: Path) -> None:
    """Traced by bash itself (``-x``: a command substitution shows as ``++``)."""
    root = _tree(tmp_path)
    fast_login(root)
    out = subprocess.run(["bash", "-x", "-c", f". {root}/etc/profile"],
                         capture_output=True, text=True, check=True)
    assert "+ '[' 0 -eq 0 ']'" in out.stderr  # it ran, as root
    assert "id -u" not in out.stderr and "+++" not in out.stderr  # no substitution ran
    home = root / "root"
    out = subprocess.run(["bash", "-x", "-c", f". {home}/.profile"], capture_output=True,
                         text=True, check=True, stdin=subprocess.DEVNULL,
                         env={"PATH": os.environ["PATH"], "HOME": str(home)})
    assert "+ mesg" not in out.stderr  # no terminal: not run
    assert "[ -t 0 ] && mesg n" in (home / ".profile").read_text()


def test_scripts_that_read_otherwise_are_left_alone(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "etc/profile").write_text("# an image's own\nPATH=/x\n")
    (root / "root/.profile").unlink()
    fast_login(root)
    assert (root / "etc/profile").read_text() == "# an image's own\nPATH=/x\n"
    assert not (root / "root/.profile").exists()
