"""File helpers shared by the storage modules: sparse-aware copy and hashing, fsync,
atomic writes, and the translation of ``OSError`` into boxd errors.

Sparse files are walked with ``SEEK_DATA``/``SEEK_HOLE``: only data regions are read,
holes are hashed as zeros (from one preallocated zero buffer) and never written, so a
1 GiB guest RAM file holding 100 MB of data costs 100 MB of reads and writes. Data
blocks that turn out to be all zeros are not written either, so they become holes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pwd
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from boxd import config
from boxd.errors import InternalError, InvalidRequest, ResourceExhausted
from boxd.storage.fds import OwnedFd

__all__ = [
    "CHUNK",
    "Progress",
    "copy_sparse",
    "data_regions",
    "fsync_dir",
    "fsync_path",
    "hash_file",
    "hash_zeros",
    "is_zero",
    "os_errors",
    "qemu_group",
    "write_atomic",
    "write_nonzero",
]

log = logging.getLogger("boxd.storage")

#: Read size for data regions. 1 MiB keeps the Python overhead per byte negligible.
CHUNK = 1 << 20
#: Granularity at which all-zero data is left as a hole when writing.
ZERO_BLOCK = 64 << 10
_ZEROS = bytes(4 << 20)
_ZEROS_VIEW = memoryview(_ZEROS)

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``."""


class _Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def os_errors(action: str, path: Path | str) -> Iterator[None]:
    """Translate ``OSError`` raised inside the block into a boxd error.

    Args:
        action: what was being done, for the message ("copy the RAM file").
        path: the file involved.

    Raises:
        ResourceExhausted: the disk (or quota) is full.
        InternalError: any other operating-system error.
    """
    try:
        yield
    except OSError as exc:
        # The path is the daemon's business: it goes to the log, not to the client.
        log.warning("event=os_error action=%r path=%s error=%r", action, path, exc)
        if exc.errno in _NO_SPACE:
            raise ResourceExhausted(
                f"disk full: could not {action}",
                hint="free disk space in boxd's data directory (the daemon's log names the "
                "file), then retry",
            ) from exc
        raise InternalError(
            f"could not {action}: {exc.strerror or type(exc).__name__}",
            hint="the daemon's log has the details",
        ) from exc


def qemu_group() -> int | None:
    """The group of the user QEMU drops to when the daemon runs as root, else None.

    The same rule as the QEMU engine's ``-run-with user=``: ``BOXD_QEMU_USER``
    (`boxd.config.qemu_user`) names the user (default ``boxd-qemu``; empty: QEMU keeps
    the daemon's user).
    """
    name = config.qemu_user()
    if os.geteuid() != 0 or not name:
        return None
    try:
        return pwd.getpwnam(name).pw_gid
    except KeyError:
        return None


def data_regions(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """Yield ``(offset, length)`` of each data region of an open file, in order.

    Falls back to one region covering the whole file when the filesystem does not
    support ``SEEK_DATA``.
    """
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield pos, size - pos
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end - start
        pos = end


def hash_zeros(h: _Hasher, n: int) -> None:
    """Feed ``n`` zero bytes to ``h`` without allocating them."""
    step = len(_ZEROS)
    while n > 0:
        k = min(n, step)
        h.update(_ZEROS_VIEW[:k])
        n -= k


def is_zero(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` (at most 4 MiB) is all zero bytes (one ``memcmp``)."""
    return _ZEROS.startswith(data)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def write_nonzero(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` at ``offset``, skipping all-zero blocks so they stay holes.

    The destination must be a fresh (all-hole) file: skipped blocks are not zeroed.
    """
    if is_zero(data):
        return
    run = -1
    n = len(data)
    for b in range(0, n, ZERO_BLOCK):
        if is_zero(data[b : b + ZERO_BLOCK]):
            if run >= 0:
                _pwrite_all(fd, data[run:b], offset + run)
                run = -1
        elif run < 0:
            run = b
    if run >= 0:
        _pwrite_all(fd, data[run:n], offset + run)


def _read_regions(
    fd: int,
    size: int,
    h: _Hasher,
    sink: Callable[[memoryview, int], None] | None,
    progress: Progress | None,
) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    pos = 0
    for off, length in data_regions(fd, size):
        hash_zeros(h, off - pos)
        end = off + length
        while off < end:
            n = os.preadv(fd, [view[: min(CHUNK, end - off)]], off)
            if n == 0:
                raise InternalError("file shrank while it was being read")
            chunk = view[:n]
            h.update(chunk)
            if sink is not None:
                sink(chunk, off)
            off += n
            if progress is not None:
                progress(off, size)
        pos = end
    hash_zeros(h, size - pos)
    if progress is not None:
        progress(size, size)


def hash_file(path: Path, progress: Progress | None = None) -> tuple[str, int]:
    """SHA-256 of a file's logical bytes (holes read as zeros), reading only its data.

    Args:
        path: the file.
        progress: called with ``(offset, size)`` as the hash advances.

    Returns:
        ``(hex digest, logical size)``.

    Raises:
        ResourceExhausted, InternalError: the file could not be read.
    """
    h = hashlib.sha256()
    with os_errors("read", path), OwnedFd.open(path, os.O_RDONLY) as fd:
        size = os.fstat(fd.fd).st_size
        _read_regions(fd.fd, size, h, None, progress)
    return h.hexdigest(), size


def copy_sparse(src: Path, dst: Path, progress: Progress | None = None) -> tuple[str, int]:
    """Copy ``src`` to a new file ``dst`` keeping holes, and hash it on the way.

    Args:
        src: the file to copy.
        dst: the new file (must not exist).
        progress: called with ``(offset, size)`` as the copy advances.

    Returns:
        ``(hex digest of the logical bytes, logical size)``.

    Raises:
        InvalidRequest: ``src`` is missing or not a regular file.
        ResourceExhausted: the disk is full.
        InternalError: any other I/O error.
    """
    h = hashlib.sha256()
    try:
        sfd = OwnedFd.open(src, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise InvalidRequest(f"no such file: {src}", field="src") from exc
    with sfd:
        with os_errors("copy", src):
            st = os.fstat(sfd.fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"not a regular file: {src}", field="src")
            size = st.st_size
            os.posix_fadvise(sfd.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with os_errors("write", dst), \
                OwnedFd.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600) as dfd:
            _read_regions(sfd.fd, size, h, lambda c, o: write_nonzero(dfd.fd, c, o), progress)
            os.ftruncate(dfd.fd, size)
    return h.hexdigest(), size


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (a read-only descriptor is enough on Linux)."""
    with OwnedFd.open(path, os.O_RDONLY) as fd:
        os.fsync(fd.fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory so renames and unlinks inside it are durable."""
    fsync_path(path)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    Raises:
        OSError: left to the caller to translate with `os_errors`.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)

