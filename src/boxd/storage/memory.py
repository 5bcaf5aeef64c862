"""Guest memory files on tmpfs: sparse copies for templates and checkpoints."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from boxd.errors import ResourceExhausted


def sparse_copy(src: Path, dest: Path) -> int:
    """Copy ``src`` to ``dest`` keeping holes (SEEK_DATA/SEEK_HOLE + copy_file_range).

    Guest RAM files are mostly holes; copying only data regions keeps a 1 GiB guest
    with 120 MB in use at a ~50 ms copy. Returns the number of data bytes copied.

    Raises:
        ResourceExhausted: the target filesystem is full (the partial file is removed).
    """
    tmp = dest.with_name(dest.name + ".tmp")
    copied = 0
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            size = os.fstat(fin.fileno()).st_size
            fout.truncate(size)
            ifd, ofd = fin.fileno(), fout.fileno()
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(ifd, pos, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # no data after pos
                        break
                    raise
                end = os.lseek(ifd, start, os.SEEK_HOLE)
                off = start
                while off < end:
                    n = os.copy_file_range(ifd, ofd, end - off, off, off)
                    if n == 0:
                        break
                    off += n
                copied += end - start
                pos = end
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise ResourceExhausted(
                f"no space left on {dest.parent} while copying guest memory",
                hint="free memory on /dev/shm (delete idle machines or checkpoints)",
            ) from exc
        raise
    return copied


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
