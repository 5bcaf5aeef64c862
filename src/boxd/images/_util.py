"""Small helpers shared by the image build steps: running tools, atomic writes."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from boxd.errors import HostSetupError
from boxd.storage._files import fsync_dir, fsync_path

Progress = Callable[[str, float | None], None]

SETUP_HINT = "run scripts/setup-host.sh"
log = logging.getLogger("boxd.images")


def need_tool(name: str, step: str) -> str:
    """The absolute path of ``name``, or a HostSetupError naming the step."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        raise HostSetupError(
            f"image build step {step!r} failed: {name} not found", hint=SETUP_HINT, step=step
        )
    return path


def run(
    argv: Sequence[str | os.PathLike[str]],
    step: str,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    hint: str = SETUP_HINT,
    timeout: float = 3600,
) -> str:
    """Run a build command; on failure raise HostSetupError with the output's tail."""
    try:
        proc = subprocess.run(
            [os.fspath(a) for a in argv],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError as exc:
        raise HostSetupError(
            f"image build step {step!r} failed: {argv[0]} not found", hint=hint, step=step
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise HostSetupError(
            f"image build step {step!r} timed out after {timeout:.0f} s", hint=hint, step=step
        ) from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-25:])
        raise HostSetupError(
            f"image build step {step!r} failed (exit {proc.returncode}): "
            f"{' '.join(os.fspath(a) for a in argv)[:300]}\n{tail}",
            hint=hint,
            step=step,
        )
    return proc.stdout


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under ``root`` (not the rootfs contents)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                continue
            fsync_path(p)
        fsync_dir(Path(dirpath))


def private_mounts(argv: Sequence[str | os.PathLike[str]]) -> list[str | os.PathLike[str]]:
    """``argv`` run in a mount namespace of its own, when we are root.

    mmdebstrap (root mode) mounts proc, sys and binds of the host's /dev entries, the
    host's /dev/shm included, inside the tree it builds. Killed mid-build, it leaves them
    mounted there, and a later ``rm -rf`` of the tree empties the host's /dev/shm (every
    machine's RAM file, template and socket). In a private mount namespace its mounts
    die with it.
    """
    unshare = shutil.which("unshare") or shutil.which("unshare", path="/usr/bin:/bin")
    if os.geteuid() != 0 or unshare is None:
        return list(argv)
    return [unshare, "--mount", "--propagation", "private", *argv]


_ESCAPE = re.compile(r"\\([0-7]{3})")


def mounts_below(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[str]:
    """Mount points at or below ``path``, deepest first."""
    root = os.path.realpath(path)
    found: list[str] = []
    try:
        text = mountinfo.read_text()
    except OSError:
        return found
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        point = _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        if point == root or point.startswith(root + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def remove_build_tree(path: Path) -> None:
    """``rm -rf`` a build directory without ever descending into a mount below it.

    A build that older code (or a crash) left with mounts inside is unmounted first
    (lazily, deepest first); if one stays mounted, the tree is left and logged.
    """
    for point in mounts_below(path):
        subprocess.run(["umount", "-l", point], stdin=subprocess.DEVNULL,
                       capture_output=True, check=False)
    left = mounts_below(path)
    if left:
        log.warning("event=build_tree_kept path=%s reason=%r", path, f"{left[0]} is mounted")
        return
    shutil.rmtree(path, ignore_errors=True)
