"""The guest root filesystem: mmdebstrap from the host's Debian sources, packed into ext4."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from boxd.errors import HostSetupError

from . import _apt
from ._util import need_tool, private_mounts, run

BASE_PACKAGES = (
    "python3",
    "python3-pip",
    "python3-venv",
    "ca-certificates",
    "iproute2",
    "procps",
    "e2fsprogs",
    "iputils-ping",
    "netbase",
    "sudo",  # E2B's `user` runs root commands through it (`GUEST_USER`)
)

#: The unprivileged account every image has, as E2B's templates have it: uid 1000, home
#: /home/user, bash, sudo without a password. boxd's own exec still runs as root unless
#: asked (``user=``); the E2B shim runs its commands as this user (docs/e2b.md).
GUEST_USER = "user"
GUEST_USER_UID = 1000

#: What the in-machine boxd client (``from boxd import Boxd`` in a guest) needs besides the
#: stdlib, installed from wheels into every image. The client's own files come with the
#: initramfs (``_initramfs.client_files``), so changing them costs no rootfs rebuild.
CLIENT_PIP = ("httpx>=0.27,<1", "pydantic>=2.6,<3")
#: Where the initramfs puts the client in a running guest (tmpfs), and the .pth that puts
#: it on the system python3's path.
GUEST_CLIENT_DIR = "/run/boxd/py"
CLIENT_PTH = "usr/lib/python3/dist-packages/boxd-client.pth"

HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
GUEST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
GUEST_PYTHON = ("3.11", "cp311")

# Drop documentation and translations: a third of a minbase image, never read in a guest.
_DPKG_EXCLUDES = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
)


def mirror_lines(suite: str) -> list[str]:
    """The host's Debian entries for ``suite`` as mmdebstrap mirror lines.

    Raises:
        HostSetupError: the host has no apt source for ``suite``.
    """
    sources = _apt.select_suite_sources(_apt.host_sources(), suite)
    if not sources:
        raise HostSetupError(
            f"image build step 'apt sources' failed: no apt source for Debian {suite!r} "
            f"in {_apt.SOURCES_LIST} or {_apt.SOURCES_DIR}",
            hint="add the Debian mirror you use to the host's apt sources",
        )
    return _apt.one_line_entries(sources)


def parse_pip_config(text: str) -> dict[str, list[str]]:
    """Parse ``pip config list`` output into {option: values} (index-url, extra-index-url)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^[^.=]*\.([a-z-]+)='(.*)'$", line.strip())
        if not m:
            continue
        key, value = m.group(1), m.group(2)
        if key in {"index-url", "extra-index-url"}:
            for v in value.split():
                if v not in out.setdefault(key, []):
                    out[key].append(v)
    return out


def guest_pip_conf(host_pip: dict[str, list[str]]) -> str:
    """The guest's /etc/pip.conf: host CA bundle, system installs allowed, http(s) indexes."""
    lines = ["[global]", f"cert = {GUEST_CA_BUNDLE}", "break-system-packages = true",
             "root-user-action = ignore", "disable-pip-version-check = true"]
    web = re.compile(r"^https?://", re.I)
    index = [u for u in host_pip.get("index-url", []) if web.match(u)]
    extra = [u for u in host_pip.get("extra-index-url", []) if web.match(u)]
    if index:
        lines.append(f"index-url = {index[0]}")
    if extra:
        lines.append("extra-index-url = " + " ".join(extra))
    return "\n".join(lines) + "\n"


def host_pip_config() -> dict[str, list[str]]:
    """The host pip's index settings (files and PIP_* environment)."""
    try:
        out = run([sys.executable, "-m", "pip", "config", "list"], "read host pip config")
    except HostSetupError:
        return {}
    return parse_pip_config(out)


def _platform_args() -> list[str]:
    # pip takes --platform tags literally (no manylinux_2_36 -> 2_17 compatibility), so
    # name every glibc the guest's (2.36, Debian 12) runs: most compiled wheels
    # (pydantic-core) are tagged manylinux2014 / manylinux_2_17.
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1)]
    tags += ["manylinux2014_x86_64", "linux_x86_64"]
    return [arg for tag in tags for arg in ("--platform", tag)]


def download_wheels(packages: Sequence[str], dest: Path) -> None:
    """Download wheels for the guest's CPython on the host, with the host's pip config.

    Raises:
        HostSetupError: pip could not resolve or download a package.
    """
    dest.mkdir(parents=True, exist_ok=True)
    ver, impl_abi = GUEST_PYTHON
    run([sys.executable, "-m", "pip", "download", "-q", "-d", dest,
         "--only-binary=:all:", "--python-version", ver, "--implementation", "cp",
         "--abi", impl_abi, "--abi", "abi3", "--abi", "none",
         *_platform_args(), *packages],
        "pip download " + " ".join(packages),
        hint="check the package names and the host's pip configuration; only wheels "
             "(no source builds) can be installed into the image")


def mmdebstrap(suite: str, target: Path, apt: Sequence[str], pip: Sequence[str],
               wheels: Path | None) -> None:
    """Run mmdebstrap into the directory ``target``.

    Raises:
        HostSetupError: mmdebstrap is missing or failed.
    """
    need_tool("mmdebstrap", "mmdebstrap")
    includes = ",".join(dict.fromkeys((*BASE_PACKAGES, *apt)))
    argv: list[str | os.PathLike[str]] = [
        "mmdebstrap", "--variant=minbase", f"--include={includes}",
        "--skip=cleanup/reproducible",
    ]
    argv += [f"--dpkgopt={o}" for o in _DPKG_EXCLUDES]
    argv += [f"--aptopt={o}" for o in _apt.host_apt_proxy_options()]
    if pip and wheels is not None:
        argv += [
            f"--customize-hook=copy-in {wheels} /tmp",
            "--customize-hook=chroot \"$1\" python3 -m pip install -q --no-index "
            "--break-system-packages --root-user-action=ignore "
            f"--find-links /tmp/{wheels.name} " + " ".join(_shell_quote(p) for p in pip),
            f"--customize-hook=rm -rf \"$1/tmp/{wheels.name}\"",
        ]
    argv += [
        f"--customize-hook=chroot \"$1\" useradd --create-home --uid {GUEST_USER_UID} "
        f"--user-group --shell /bin/bash {GUEST_USER}",
        f"--customize-hook=echo '{GUEST_USER} ALL=(ALL:ALL) NOPASSWD: ALL' "
        f"> \"$1/etc/sudoers.d/{GUEST_USER}\" && chmod 0440 \"$1/etc/sudoers.d/{GUEST_USER}\"",
    ]
    argv += [suite, target, *mirror_lines(suite)]
    run(private_mounts(argv), "mmdebstrap",
        hint="check the package names and the host's apt sources; scripts/setup-host.sh "
             "installs mmdebstrap")


def _shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def customize(root: Path, host_pip: dict[str, list[str]]) -> None:
    """Host CA bundle, pip.conf, no EXTERNALLY-MANAGED, /home/boxd, empty machine-id,
    the boxd client's .pth."""
    if HOST_CA_BUNDLE.exists():
        dst = root / GUEST_CA_BUNDLE.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_symlink():
            dst.unlink()
        shutil.copyfile(HOST_CA_BUNDLE, dst)
    (root / "etc/pip.conf").write_text(guest_pip_conf(host_pip))
    for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    (root / "home/boxd").mkdir(parents=True, exist_ok=True)
    (root / "etc/machine-id").write_text("")
    for sub in ("var/lib/apt/lists", "var/cache/apt", "var/log/apt"):
        d = root / sub
        if d.is_dir():
            for p in d.iterdir():
                if p.is_dir() and not p.is_symlink():
                    if p.name != "partial":
                        shutil.rmtree(p)
                elif p.name != "lock":
                    p.unlink()
    (root / "etc/hostname").write_text("boxd\n")
    fast_login(root)
    pth = root / CLIENT_PTH
    pth.parent.mkdir(parents=True, exist_ok=True)
    pth.write_text(GUEST_CLIENT_DIR + "\n")


#: Debian's login scripts, each with a command a login shell forks and execs that bash
#: answers itself: its edit. E2B runs every command as ``/bin/bash -l -c``; in gVisor
#: the two programs were ~27 ms of a 45 ms login shell (docs/benchmarks.md#e2b).
_LOGIN_EDITS = (
    # bash knows its uid (EUID); sh (dash) has none and still asks id(1)
    ("etc/profile", '[ "$(id -u)" -eq 0 ]', '[ "${EUID:-$(id -u)}" -eq 0 ]'),
    # mesg(1) acts on a terminal only: without one it failed, quietly
    ("root/.profile", "\nmesg n 2> /dev/null || true",
     "\n[ -t 0 ] && mesg n 2> /dev/null || true"),
)


def fast_login(root: Path) -> None:
    """Edit Debian's login scripts under ``root`` so a bash login shell runs no other
    program where bash knows the answer itself (`_LOGIN_EDITS`); what each script does
    is unchanged. A script that does not read as expected is left alone."""
    for rel, old, new in _LOGIN_EDITS:
        path = root / rel
        try:
            text = path.read_text()
        except (FileNotFoundError, UnicodeDecodeError):
            continue
        if old in text:
            path.write_text(text.replace(old, new))


def tree_size(root: Path) -> tuple[int, int]:
    """(bytes, entries) of a directory tree, counting each hard-linked file once."""
    total, count, seen = 0, 0, set()
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            count += 1
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total, count


def ext4_size(used: int, entries: int) -> tuple[int, int]:
    """(MiB, inodes) of an ext4 that holds ``used`` bytes in ``entries`` entries with
    headroom: content x 1.15 + 256 MiB, twice the entries' inodes (at least 65536)."""
    return int(used * 1.15 / 2**20) + 256, max(65536, entries * 2)


def make_ext4(root: Path, image: Path) -> int:
    """Pack ``root`` into a raw ext4 image sized content + headroom; return its size.

    Raises:
        HostSetupError: mkfs.ext4 is missing or failed.
    """
    need_tool("mkfs.ext4", "mkfs.ext4")
    size_mib, inodes = ext4_size(*tree_size(root))
    with open(image, "wb") as f:
        f.truncate(size_mib * 2**20)
    run(["mkfs.ext4", "-q", "-F", "-L", "boxd-root", "-N", str(inodes),
         "-E", "root_owner=0:0", "-d", root, image, f"{size_mib}M"],
        "mkfs.ext4", hint="e2fsprogs >= 1.43 is needed for mkfs.ext4 -d; "
                          "run scripts/setup-host.sh")
    return size_mib * 2**20
