"""The guest root as a directory tree, for engines that run on a host directory (gVisor).

The image builder makes one ext4 image (``rootfs.img``) per recipe. gVisor serves a
host directory to its sandboxes instead of a block device, so the same build is
unpacked once, next to the image, with ``debugfs rdump`` (e2fsprogs: no loop device,
no mount, ~1 s for the default image). rdump chowns each file after its chmod, which
clears setuid and setgid bits (sudo, su, passwd would lose them), so `special_modes`
reads those modes from the image and they are set again (the runsc tested ignores
setuid bits anyway, google/gvisor#212; the tree mirrors the image for one that does).
The agent files go into a second, small tree keyed by their content, mounted
read-only at `AGENT_MOUNT` in each sandbox: a newer agent gets a new tree and never
changes files under a running or checkpointed sandbox.

Layout, inside the recipe's cache directory::

    rootfs.tree/          the unpacked rootfs.img (read-only to sandboxes)
    agent-<key>/          agent.py + protocol.py of one version of the agent,
      boxd-init           init.c compiled (static), the sandbox's PID 1 in front of
                          agent.py: it relays the step channel's frames natively, as
                          in a QEMU guest; and
      py/boxd/...         the in-machine client (``from boxd import Boxd``), which
                          each sandbox sees at /run/boxd/py (where the image's .pth
                          looks, as in a QEMU guest)
    agent-<key>-py/       the same without boxd-init: made when init.c does not compile
                          here (no C compiler or static C library), or when
                          ``BOXD_GVISOR_RELAY=python`` asks for it. agent.py is then
                          PID 1 and relays every frame itself (slower, same protocol).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from boxd.errors import HostSetupError

from ._build import GUEST_DIR, _locked
from ._initramfs import INIT_BINARY, INIT_SOURCE, compile_init, guest_files
from ._util import need_tool, run

log = logging.getLogger("boxd.images")

TREE_DIR = "rootfs.tree"
#: ``python`` makes gVisor sandboxes run agent.py as PID 1 (the relay in Python), for
#: comparison (bench/bench_channel.py) or as a way around a boxd-init problem.
RELAY_ENV = "BOXD_GVISOR_RELAY"
AGENT_MOUNT = "/opt/boxd"
#: The client's folder in an agent tree; sandboxes see it at ``GUEST_CLIENT_DIR``.
CLIENT_DIR = "py"
_COMPLETE = ".boxd-complete"
#: Marks a tree whose setuid/setgid bits were set again (`special_modes`): a tree
#: unpacked before boxd did it gets them in place, once.
_MODES = ".boxd-modes"
#: A directory entry of ``debugfs ls -p``: /inode/mode/uid/gid/name/size/.
_ENTRY = re.compile(r"/(\d+)/([0-7]+)/\d+/\d+/([^/]*)/[^/]*/")
_LISTING = re.compile(r"debugfs: ls -p <(\d+)>")


def rootfs_tree(rootfs_img: Path) -> Path:
    """The directory tree of ``rootfs_img`` (an image's ``rootfs.img``), unpacked once.

    Raises:
        HostSetupError: the image is missing or debugfs failed.
    """
    tree = rootfs_img.with_name(TREE_DIR)
    if (tree / _COMPLETE).exists() and (tree / _MODES).exists():
        return tree
    if not rootfs_img.exists():
        raise HostSetupError(f"the guest root filesystem {rootfs_img} is missing",
                             hint="build the image again (boxd image build)")
    debugfs = need_tool("debugfs", "unpack rootfs for gVisor")
    with _locked(rootfs_img.with_name(TREE_DIR + ".lock")):
        if (tree / _COMPLETE).exists():
            if not (tree / _MODES).exists():  # unpacked by an older boxd
                _restore_modes(debugfs, rootfs_img, tree)
            return tree
        tmp = rootfs_img.with_name(f"{TREE_DIR}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            out = run([debugfs, "-R", f"rdump / {tmp}", rootfs_img], "unpack rootfs for gVisor",
                      hint="e2fsprogs' debugfs must read the image; rebuild it if it is damaged")
            if not (tmp / "usr" / "bin").is_dir():
                raise HostSetupError(
                    f"debugfs unpacked no /usr/bin from {rootfs_img}: {out[-300:]}",
                    hint="rebuild the image (boxd image build --force)")
            shutil.rmtree(tmp / "lost+found", ignore_errors=True)
            _restore_modes(debugfs, rootfs_img, tmp)
            (tmp / _COMPLETE).write_text("")
            shutil.rmtree(tree, ignore_errors=True)
            os.replace(tmp, tree)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return tree


def special_modes(debugfs: str, rootfs_img: Path) -> dict[str, int]:
    """The files of ``rootfs_img`` with a setuid, setgid or sticky bit: their paths
    (relative) and permission bits, read with ``debugfs ls -p`` a directory level at a
    time (one debugfs run per level, directories named by inode: any name works).

    Raises:
        HostSetupError: debugfs failed.
    """
    found: dict[str, int] = {}
    level = {2: ""}  # the root directory's inode
    while level:
        with tempfile.NamedTemporaryFile("w", suffix=".debugfs") as cmds:
            cmds.write("".join(f"ls -p <{ino}>\n" for ino in level))
            cmds.flush()
            out = run([debugfs, "-f", cmds.name, rootfs_img], "read rootfs modes",
                      hint="e2fsprogs' debugfs must read the image; rebuild it if it is "
                      "damaged")
        below: dict[int, str] = {}
        parent: str | None = None
        for line in out.splitlines():
            if (listing := _LISTING.fullmatch(line)) is not None:
                parent = level.get(int(listing.group(1)))
                continue
            entry = _ENTRY.fullmatch(line)
            if parent is None or entry is None or entry.group(3) in ("", ".", ".."):
                continue
            ino, mode, path = int(entry.group(1)), int(entry.group(2), 8), \
                os.path.join(parent, entry.group(3))
            if stat.S_ISDIR(mode):
                below[ino] = path
            if (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) and mode & 0o7000:
                found[path] = stat.S_IMODE(mode)
        level = below
    return found


def _restore_modes(debugfs: str, rootfs_img: Path, tree: Path) -> None:
    """Set the setuid/setgid/sticky bits rdump dropped (`special_modes`) on ``tree``."""
    for path, mode in special_modes(debugfs, rootfs_img).items():
        target = tree / path
        if not target.is_symlink() and target.exists():
            os.chmod(target, mode)
    (tree / _MODES).write_text("")


def native_relay(tree: Path) -> bool:
    """Whether sandboxes on agent tree ``tree`` run boxd-init (C) in front of agent.py."""
    return (tree / INIT_BINARY).is_file()


def agent_tree(image_dir: Path, guest_dir: Path | None = None,
               native: bool | None = None) -> Path:
    """A read-only directory with this version's agent files (``agent.py``, ``protocol.py``,
    ``boxd-init`` compiled from ``init.c``) and the in-machine client under `CLIENT_DIR`
    (``py/boxd/...``).

    ``native``: True asks for boxd-init, False leaves it out; None (the default) asks for
    it unless `RELAY_ENV` says ``python``. Where init.c does not compile (no C compiler)
    the tree has the Python relay and the log a warning, unless `RELAY_ENV` says
    ``native``. `native_relay` tells which a tree has.

    Raises:
        HostSetupError: the agent sources are missing; or `RELAY_ENV` says ``native``
            and init.c does not compile.
    """
    all_files = guest_files(guest_dir or GUEST_DIR)
    files = {n: b for n, b in all_files.items()
             if (n.endswith(".py") and "/" not in n) or n.startswith(f"{CLIENT_DIR}/")}
    if "agent.py" not in files:
        raise HostSetupError(f"no guest agent in {guest_dir or GUEST_DIR}",
                             hint="reinstall boxd")
    source = all_files.get(INIT_SOURCE)
    if native is None:
        native = source is not None and os.environ.get(RELAY_ENV, "").lower() != "python"
    key = _tree_key(files, source)
    final = image_dir / f"agent-{key}"
    if native and not (final / _COMPLETE).exists():
        native = _add_init(files, source, guest_dir or GUEST_DIR)
    if not native:
        final = image_dir / f"agent-{key}-py"
    if not (final / _COMPLETE).exists():
        _write_tree(image_dir, final, files)
    return final


def _tree_key(files: dict[str, bytes], source: bytes | None) -> str:
    """The agent tree's name: a digest of its files and of init.c."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    if source is not None:
        digest.update(INIT_SOURCE.encode() + b"\0" + source + b"\0")
    return digest.hexdigest()[:16]


def _add_init(files: dict[str, bytes], source: bytes | None, guest_dir: Path) -> bool:
    """Compile boxd-init into ``files``; False (and a warning) when it does not compile,
    unless `RELAY_ENV` says ``native``: then the HostSetupError is raised."""
    try:
        if source is None:
            raise HostSetupError(f"no {INIT_SOURCE} in {guest_dir}", hint="reinstall boxd")
        files[INIT_BINARY] = compile_init(source)
    except HostSetupError as exc:
        if os.environ.get(RELAY_ENV, "").lower() == "native":
            raise
        log.warning("event=gvisor_relay relay=python reason=%r: gVisor sandboxes "
                    "run agent.py as PID 1, which relays the step channel in Python",
                    exc.message)
        return False
    return True


def _write_tree(image_dir: Path, final: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` to ``final`` atomically (a temporary folder renamed)."""
    tmp = image_dir / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
        (tmp / name).chmod(0o755 if name == INIT_BINARY else 0o644)
    (tmp / _COMPLETE).write_text("")
    try:
        os.replace(tmp, final)
    except OSError:  # another process made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)

__all__ = ["AGENT_MOUNT", "CLIENT_DIR", "RELAY_ENV", "agent_tree", "native_relay",
           "rootfs_tree"]
