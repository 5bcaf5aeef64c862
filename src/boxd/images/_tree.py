"""The guest root as a directory tree, for engines that run on a host directory (gVisor).

The image builder makes one ext4 image (``rootfs.img``) per recipe. gVisor serves a
host directory to its sandboxes instead of a block device, so the same build is
unpacked once, next to the image, with ``debugfs rdump`` (e2fsprogs: no loop device,
no mount, ~1 s for the default image). The agent files go into a second, small tree
keyed by their content, mounted read-only at `AGENT_MOUNT` in each sandbox: a newer
agent gets a new tree and never changes files under a running or checkpointed sandbox.

Layout, inside the recipe's cache directory::

    rootfs.tree/          the unpacked rootfs.img (read-only to sandboxes)
    agent-<key>/          agent.py + protocol.py of one version of the agent, and
      py/boxd/...         the in-machine client (``from boxd import Boxd``), which
                          each sandbox sees at /run/boxd/py (where the image's .pth
                          looks, as in a QEMU guest)
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from boxd.errors import HostSetupError

from ._build import GUEST_DIR, _locked
from ._initramfs import guest_files
from ._util import need_tool, run

TREE_DIR = "rootfs.tree"
AGENT_MOUNT = "/opt/boxd"
#: The client's folder in an agent tree; sandboxes see it at ``GUEST_CLIENT_DIR``.
CLIENT_DIR = "py"
_COMPLETE = ".boxd-complete"


def rootfs_tree(rootfs_img: Path) -> Path:
    """The directory tree of ``rootfs_img`` (an image's ``rootfs.img``), unpacked once.

    Raises:
        HostSetupError: the image is missing or debugfs failed.
    """
    tree = rootfs_img.with_name(TREE_DIR)
    if (tree / _COMPLETE).exists():
        return tree
    if not rootfs_img.exists():
        raise HostSetupError(f"the guest root filesystem {rootfs_img} is missing",
                             hint="build the image again (boxd image build)")
    debugfs = need_tool("debugfs", "unpack rootfs for gVisor")
    with _locked(rootfs_img.with_name(TREE_DIR + ".lock")):
        if (tree / _COMPLETE).exists():
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
            (tmp / _COMPLETE).write_text("")
            shutil.rmtree(tree, ignore_errors=True)
            os.replace(tmp, tree)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return tree


def agent_tree(image_dir: Path, guest_dir: Path | None = None) -> Path:
    """A read-only directory with this version's agent files (``agent.py``, ``protocol.py``)
    and the in-machine client under `CLIENT_DIR` (``py/boxd/...``).

    Raises:
        HostSetupError: the agent sources are missing.
    """
    # The agent's own modules (not init.c: boxd-init is QEMU's) and the client's files.
    files = {n: b for n, b in guest_files(guest_dir or GUEST_DIR).items()
             if (n.endswith(".py") and "/" not in n) or n.startswith(f"{CLIENT_DIR}/")}
    if "agent.py" not in files:
        raise HostSetupError(f"no guest agent in {guest_dir or GUEST_DIR}",
                             hint="reinstall boxd")
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    final = image_dir / f"agent-{digest.hexdigest()[:16]}"
    if (final / _COMPLETE).exists():
        return final
    tmp = image_dir / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
        (tmp / name).chmod(0o644)
    (tmp / _COMPLETE).write_text("")
    try:
        os.replace(tmp, final)
    except OSError:  # another process made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return final


__all__ = ["AGENT_MOUNT", "CLIENT_DIR", "agent_tree", "rootfs_tree"]
