"""One owner per file descriptor.

A descriptor number is reused by the kernel the moment it is closed, so closing a number
twice is not a harmless no-op: between the two calls another thread may have opened a
file and been given that number, and the second close takes it from under it (round 4:
a machine's DELETE answered 500 when ``shutil.rmtree`` found its own directory
descriptor closed). Every raw descriptor the daemon opens is therefore held by an
`OwnedFd`, which closes it exactly once, or hands it on with `detach` to exactly one
new owner (a file object, a subprocess call that dups it, an event loop's transport),
after which it never touches the number again.

The one hand-over that differs by event loop is a pipe given to
``loop.connect_read_pipe``/``connect_write_pipe``: see `pipe_file`.
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
from typing import IO, Literal

__all__ = ["OwnedFd", "loop_closes_pipes", "pipe_file", "private_opener"]


class OwnedFd:
    """A file descriptor that is closed exactly once.

    Use it as a context manager (or call `close`); `detach` gives the number to a new
    owner and leaves this object empty. `close` is idempotent and thread-safe: of two
    threads closing at once, one closes and the other does nothing.
    """

    __slots__ = ("_fd", "_lock")

    def __init__(self, fd: int) -> None:
        if fd < 0:
            raise ValueError(f"not a file descriptor: {fd}")
        self._fd = fd
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> OwnedFd:
        """``os.open`` with ``O_CLOEXEC`` added (a subprocess inherits only what it is
        given explicitly).

        Raises:
            OSError: as ``os.open``.
        """
        return cls(os.open(path, flags | os.O_CLOEXEC, mode))

    @classmethod
    def pidfd(cls, pid: int) -> OwnedFd:
        """A pidfd of ``pid`` (readable once the process has exited).

        Raises:
            ProcessLookupError: no such process.
        """
        return cls(os.pidfd_open(pid))

    @property
    def closed(self) -> bool:
        """True once the descriptor is closed or handed on."""
        return self._fd < 0

    @property
    def fd(self) -> int:
        """The number, to use while this object owns it (never to close it by hand).

        Raises:
            ValueError: it was closed or handed on already.
        """
        fd = self._fd
        if fd < 0:
            raise ValueError("the file descriptor was closed or handed on")
        return fd

    def fileno(self) -> int:
        return self.fd

    def detach(self) -> int:
        """Hand the number to a new owner; this object will never close it.

        Raises:
            ValueError: it was closed or handed on already.
        """
        with self._lock:
            fd = self.fd
            self._fd = -1
        return fd

    def close(self) -> None:
        """Close the descriptor if this object still owns it; later calls do nothing."""
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def as_file(self, mode: str, *, buffering: int = -1, closefd: bool = True) -> IO[bytes]:
        """A binary file object that owns the descriptor from now on (it closes it).

        With ``closefd=False`` the file object does not close it either: only for a
        new owner that closes the number itself (`pipe_file`). If the file object cannot
        be made, this object still owns the descriptor.
        """
        with self._lock:
            f: IO[bytes] = open(self.fd, mode, buffering=buffering,  # noqa: SIM115
                                closefd=closefd)
            self._fd = -1
        return f

    def __enter__(self) -> OwnedFd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Like a file object: a descriptor nobody closed is closed (once) when its owner
        # goes, with a ResourceWarning for the code that forgot it.
        if getattr(self, "_fd", -1) >= 0:
            warnings.warn(f"unclosed file descriptor {self._fd}", ResourceWarning,
                          stacklevel=1)
            self.close()

    def __repr__(self) -> str:
        return f"OwnedFd({self._fd})" if self._fd >= 0 else "OwnedFd(closed)"


def loop_closes_pipes(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop``'s pipe transports close the descriptor number themselves.

    uvloop's do (libuv adopts the number in ``uv_pipe_open`` and closes it with the
    handle), and then call ``close()`` on the file object they were given as well: a
    file object that owns the number closes it a second time, by then possibly another
    thread's file (uvloop ignores the EBADF it expects there, but not the case where
    the number was reused). asyncio's own transports close only the file object.
    """
    return not isinstance(loop, asyncio.BaseEventLoop)


def pipe_file(loop: asyncio.AbstractEventLoop, fd: OwnedFd,
              mode: Literal["rb", "wb"]) -> IO[bytes]:
    """Hand ``fd`` (a pipe or FIFO end) to ``loop`` for one ``connect_read_pipe`` or
    ``connect_write_pipe`` call, made at once with the returned file object.

    From here on the loop's transport owns the number and closes it once, with either
    loop: on uvloop the number itself (the file object does not close it), on asyncio
    through the file object. Closing the transport is the only way to close it.
    """
    return fd.as_file(mode, buffering=0, closefd=not loop_closes_pipes(loop))



def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for the builtin ``open`` that creates files with mode 0600: the
    file object owns the descriptor from its birth, so nothing else can close it."""
    return os.open(path, flags | os.O_CLOEXEC, 0o600)
