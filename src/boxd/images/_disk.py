"""A container image's root as a block device, for engines that boot one (QEMU).

An imported image is unpacked once per digest into a directory tree
(`boxd.images.oci.unpack_image`); gVisor serves that tree itself. A QEMU guest boots
a disk, so the same tree is packed once into a raw ext4 image with ``mkfs.ext4 -d``
(e2fsprogs: no loop device, no mount, no root needed; ~1 s for 170 MB), which every
machine of that image backs a qcow2 overlay on: writes go to the machine's overlay,
forks share the image's blocks copy-on-write, and the file never changes.

Layout::

    <dest>/<digest hex>.ext4     the image's root, read-only to every machine
    <dest>/<digest hex>.lock     fcntl lock: a second maker waits, then uses the result
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ._build import _locked
from ._rootfs import make_ext4

#: The mode of the disk files: QEMU's unprivileged user reads them through its group.
DISK_MODE = 0o640


def image_disk(tree: Path, dest: Path, group: int | None = None) -> Path:
    """The raw ext4 image of ``tree`` (a container image's unpacked root, named by its
    digest), made once under ``dest`` and shared read-only by every machine of it.

    ``group``: the group that may read it (QEMU's, when it drops privileges).

    Raises:
        HostSetupError: mkfs.ext4 is missing or failed.
    """
    final = dest / f"{tree.name}.ext4"
    if final.exists():
        return final
    dest.mkdir(parents=True, exist_ok=True, mode=0o711)
    with _locked(dest / f"{tree.name}.lock"):
        if final.exists():
            return final
        tmp = dest / f".{tree.name}.tmp-{os.getpid()}"
        try:
            make_ext4(tree, tmp)
            os.chmod(tmp, DISK_MODE)
            if group is not None:
                os.chown(tmp, -1, group)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
    return final


__all__ = ["DISK_MODE", "image_disk"]
