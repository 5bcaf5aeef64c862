"""The first of the README's commands on a machine that has never seen the project.

For each Debian release: a pristine root from mmdebstrap (minbase plus what a fresh
cloud image has), a clean ``git clone`` of this repository in it, the host's apt
sources, CA bundle and pip configuration copied in (what any machine on this network
has), /proc, /sys and /dev bound, and then ``scripts/setup-host.sh`` run inside with
chroot, to completion, as ``scripts/demo.sh`` runs it. Then ``boxd --version`` and
``from boxd import Boxd`` in there, and a second set-up run that only checks.

The root is cached as a tarball in ``.cache/fresh-host/`` (keyed by release, mirror and
package list), and so are the .deb files and pip's downloads, so a second run costs the
set-up itself, not the downloads. The clone is of the committed HEAD: uncommitted
changes are not tested.

    sudo .venv/bin/pytest -m fresh_host            # both releases
    sudo .venv/bin/pytest -m fresh_host -k bookworm
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd.images import _apt

pytestmark = pytest.mark.fresh_host

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "fresh-host"
# What a fresh cloud image has beyond minbase (issue 12).
PACKAGES = ("ca-certificates", "python3", "python3-venv", "git", "sudo")
CLONE = "/opt/boxd"  # where the clone lives inside the root
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_PIP = (Path("/etc/pip.conf"), Path("/etc/xdg/pip"))
SETUP_TIMEOUT = 1800


def _need_host() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: mmdebstrap, chroot and bind mounts (CI runs as root)")
    for tool in ("mmdebstrap", "chroot", "mount", "git"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (scripts/setup-host.sh installs mmdebstrap)")


def suite_sources(suite: str) -> list[_apt.AptSource]:
    """The host's Debian entries, for ``suite`` instead of the host's own release.

    A Debian 13 root on a Debian 12 host uses the same archive and security mirrors
    as the host's bookworm entries, with the suite names changed.
    """
    host = _apt.host_codename()
    entries = _apt.select_suite_sources(_apt.host_sources(), host)
    if not entries:
        pytest.skip(f"the host's apt sources have no entry for Debian {host!r}")
    return [
        _apt.AptSource(s.uri, tuple(x.replace(host, suite, 1) for x in s.suites), s.components)
        for s in entries
    ]


def root_tarball(suite: str, mirror_lines: list[str]) -> Path:
    """The cached pristine root of ``suite`` (built with mmdebstrap on a miss)."""
    key = hashlib.sha256(
        "\n".join([suite, "minbase", ",".join(PACKAGES), *mirror_lines]).encode()
    ).hexdigest()[:16]
    tarball = CACHE / f"{suite}-{key}.tar"
    if tarball.exists():
        return tarball
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = tarball.with_suffix(f".tmp-{os.getpid()}.tar")
    argv = ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(PACKAGES)}"]
    argv += [f"--aptopt={o}" for o in _apt.host_apt_proxy_options()]
    argv += [suite, str(partial), *mirror_lines]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = (proc.stderr or proc.stdout)[-2000:]
        if suite != _apt.host_codename():
            pytest.skip(f"mmdebstrap cannot build {suite} from the host's mirror: {tail}")
        pytest.fail(f"mmdebstrap {suite} failed ({proc.returncode}): {tail}")
    partial.rename(tarball)
    return tarball


def deb822(sources: list[_apt.AptSource]) -> str:
    """The sources as a deb822 file, signed by Debian's archive keyring."""
    stanzas = [
        f"Types: deb\nURIs: {s.uri}\nSuites: {' '.join(s.suites)}\n"
        f"Components: {' '.join(s.components)}\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        for s in sources
    ]
    return "\n".join(stanzas)


def copy_host_config(root: Path, sources: list[_apt.AptSource]) -> None:
    """What every machine on this network has: apt sources, CA bundle, pip config, DNS."""
    (root / "etc/apt/sources.list").unlink(missing_ok=True)  # mmdebstrap's one-liner
    (root / "etc/apt/sources.list.d/debian.sources").write_text(deb822(sources))
    proxy = _apt.host_apt_proxy_options()
    if proxy:
        (root / "etc/apt/apt.conf.d/80proxy").write_text("\n".join(proxy) + "\n")
    shutil.copy2(HOST_CA, root / HOST_CA.relative_to("/"))
    for path in HOST_PIP:
        target = root / path.relative_to("/")
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        elif path.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    resolv = root / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    shutil.copy2("/etc/resolv.conf", resolv)
    # No service may start inside the chroot (it would outlive the test and hold the
    # mounts): the same policy mmdebstrap applies while it builds a root.
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)


@contextlib.contextmanager
def bound(root: Path, suite: str) -> Iterator[None]:
    """/proc, /sys, /dev and the download caches bound into ``root``; unbound on exit,
    whatever happened."""
    binds = [(Path("/proc"), root / "proc"), (Path("/sys"), root / "sys"),
             (Path("/dev"), root / "dev")]
    for name, inside in ((f"apt-{suite}", "var/cache/apt/archives"), ("pip", "root/.cache/pip")):
        outside = CACHE / name
        outside.mkdir(parents=True, exist_ok=True)
        (root / inside).mkdir(parents=True, exist_ok=True)
        binds.append((outside, root / inside))
    done: list[Path] = []
    try:
        for src, dst in binds:
            subprocess.run(["mount", "--bind", str(src), str(dst)], check=True)
            done.append(dst)
        yield
    finally:
        for dst in reversed(done):
            if subprocess.run(["umount", str(dst)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "--lazy", str(dst)], check=False)


def in_root(root: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run argv inside the chroot with a login-like environment plus the host's PIP_*."""
    env = {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
    env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
    env.update({k: v for k, v in os.environ.items()
                if k.lower() in ("http_proxy", "https_proxy", "no_proxy")})
    return subprocess.run(["chroot", str(root), *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


def clone_into(root: Path) -> None:
    target = root / CLONE.lstrip("/")
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(target)],
                   check=True, capture_output=True)


@pytest.mark.parametrize("suite", ["bookworm", "trixie"])
def test_setup_host_on_a_pristine_debian_root(suite: str) -> None:
    _need_host()
    sources = suite_sources(suite)
    lines = _apt.one_line_entries(sources)
    t0 = time.monotonic()
    tarball = root_tarball(suite, lines)
    work = Path(tempfile.mkdtemp(prefix=f"boxd-fresh-{suite}-", dir="/var/tmp"))
    root = work / "root"
    try:
        root.mkdir()
        subprocess.run(["tar", "-C", str(root), "-xf", str(tarball)], check=True)
        assert not (root / "usr/bin/qemu-system-x86_64").exists()  # truly pristine
        copy_host_config(root, sources)
        clone_into(root)
        prepared = time.monotonic()
        with bound(root, suite):
            setup = in_root(root, "bash", f"{CLONE}/scripts/setup-host.sh",
                            timeout=SETUP_TIMEOUT)
            took = time.monotonic() - prepared
            report = f"--- setup-host.sh stdout ---\n{setup.stdout}\n--- stderr ---\n" \
                     f"{setup.stderr[-6000:]}"
            assert setup.returncode == 0, report
            assert "FAILED" not in setup.stderr, report

            version = in_root(root, f"{CLONE}/.venv/bin/boxd", "--version")
            assert version.returncode == 0, version.stderr
            assert version.stdout.startswith("boxd, version "), version.stdout
            sdk = in_root(root, f"{CLONE}/.venv/bin/python", "-c",
                          "from boxd import Boxd; print(Boxd.__name__)")
            assert (sdk.returncode, sdk.stdout.strip()) == (0, "Boxd"), sdk.stderr
            qemu = in_root(root, "qemu-system-x86_64", "--version")
            assert qemu.returncode == 0, qemu.stderr
            if suite == "bookworm":  # Debian 12's own QEMU is 7.2: backports were added
                assert (root / "etc/apt/sources.list.d/boxd-backports.sources").exists()
            assert "version 7." not in qemu.stdout, qemu.stdout
            # A machine's network: passt, the nftables filter and passt's own user.
            for tool in ("passt", "nft"):
                found = in_root(root, "sh", "-c", f"command -v {tool}")
                assert found.returncode == 0, f"{tool} is not installed: {found.stderr}"
            net_user = in_root(root, "id", "-u", "boxd-net")
            assert net_user.returncode == 0, net_user.stderr

            again = in_root(root, "bash", f"{CLONE}/scripts/setup-host.sh", timeout=300)
            assert again.returncode == 0, again.stderr
            assert "installing" not in again.stderr, again.stderr  # only checks
        print(f"\n{suite}: root ready in {prepared - t0:.0f} s, setup-host.sh {took:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
