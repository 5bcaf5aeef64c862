"""Guest memory files on tmpfs: sparse copies for templates and checkpoints."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from boxd.errors import ResourceExhausted
from boxd.storage._files import data_regions, os_errors
from boxd.storage.fds import private_opener

_CHUNK = 8 << 20


def _copy_range(ifd: int, ofd: int, off: int, length: int) -> None:
    end = off + length
    try:
        while off < end:
            n = os.copy_file_range(ifd, ofd, end - off, off, off)
            if n == 0:
                break
            off += n
        return
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    # copy_file_range refuses some pairs of filesystems (tmpfs -> ext4 on older kernels)
    while off < end:
        data = os.pread(ifd, min(_CHUNK, end - off), off)
        if not data:
            break
        os.pwrite(ofd, data, off)
        off += len(data)


def sparse_copy(src: Path, dest: Path) -> int:
    """Copy ``src`` to ``dest`` keeping holes (SEEK_DATA/SEEK_HOLE + copy_file_range).

    Guest RAM files are mostly holes; copying only data regions keeps a 1 GiB guest
    with 120 MB in use at a ~50 ms copy. Unlike the snapshot store's copy, this one
    does not hash: it is on the fork path, where the source is paused. Returns the
    number of data bytes copied.

    Raises:
        ResourceExhausted: the target filesystem is full (the partial file is removed).
        InternalError: another I/O error.
    """
    tmp = dest.with_name(dest.name + ".tmp")
    copied = 0
    try:
        with os_errors("copy guest memory", dest):
            # Guest memory: readable by the daemon's user only (QEMU opens it before
            # it drops privileges).
            with open(src, "rb") as fin, open(tmp, "wb", opener=private_opener) as fout:
                size = os.fstat(fin.fileno()).st_size
                fout.truncate(size)
                for off, length in data_regions(fin.fileno(), size):
                    _copy_range(fin.fileno(), fout.fileno(), off, length)
                    copied += length
            os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return copied


def ensure_space(path: Path, needed: int) -> None:
    """Check that the filesystem holding ``path`` has ``needed`` bytes free.

    Guest RAM is a file on tmpfs (``BOXD_SHM``, default ``/dev/shm``). Pages are
    allocated as the guest touches them, so a full tmpfs is not an error at start:
    the guest dies later of SIGBUS. Call this before placing a machine's RAM there
    (create, fork, restore, wake) with its memory size.

    Raises:
        ResourceExhausted: less than ``needed`` bytes are free (``.needed``, ``.free``).
    """
    with os_errors("check free space", path):
        st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < needed:
        mib = 1 << 20
        raise ResourceExhausted(
            f"not enough memory for the machine's RAM: {needed // mib} MiB needed, "
            f"{free // mib} MiB free on the RAM filesystem",
            hint="delete or hibernate machines, give the machine less memory, or point "
            "BOXD_SHM at a larger tmpfs",
            needed=needed, free=free,
        )


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


SEALED = "complete"


def seal(directory: Path) -> None:
    """Make every file in ``directory`` durable, then mark the directory complete.

    A reader that finds the marker (`is_sealed`) knows every file was fully written
    before it: a hibernation image interrupted by a crash has no marker.
    """
    from boxd.storage._files import fsync_dir, fsync_path, write_atomic

    for f in directory.iterdir():
        if f.is_file():
            fsync_path(f)
    write_atomic(directory / SEALED, b"ok\n", mode=0o600)
    fsync_dir(directory)


def is_sealed(directory: Path) -> bool:
    return (directory / SEALED).is_file()
