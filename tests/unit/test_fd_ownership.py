"""One owner per file descriptor (boxd.storage.fds), and the double close it fixed.

A gVisor machine's agent channel is two FIFOs handed to the event loop's pipe
transports. On uvloop (the daemon's loop) libuv closes such a transport's descriptor
number itself and then calls ``close()`` on the file object it was given as well: a file
object owning the number closed it a second time, by then possibly another thread's file
(round 4: a DELETE answered 500 when ``shutil.rmtree``'s own directory descriptor was
closed under it). Real FIFOs, real loops, real syscalls (counted with strace).
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from boxd.engine.gvisor._engine import open_fifo_streams
from boxd.storage.fds import OwnedFd, loop_closes_pipes, pipe_file

LOOPS = ["uvloop", "asyncio"]


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    ref = os.stat(path)
    return (st.st_dev, st.st_ino) == (ref.st_dev, ref.st_ino)


# ------------------------------------------------------------------ OwnedFd


def test_a_second_close_leaves_a_reused_number_alone(tmp_path: Path) -> None:
    owned = OwnedFd.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT, 0o600)
    number = owned.fd
    owned.close()
    other = os.open("/dev/null", os.O_RDONLY)  # someone else gets the lowest free number
    try:
        assert other == number
        owned.close()
        with owned:
            pass
        assert _same_file(other, "/dev/null")  # still open: not closed a second time
    finally:
        os.close(other)
    assert owned.closed and repr(owned) == "OwnedFd(closed)"
    with pytest.raises(ValueError, match="closed or handed on"):
        _ = owned.fd


def test_detach_hands_the_number_over_and_never_closes_it(tmp_path: Path) -> None:
    with OwnedFd.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT, 0o600) as owned:
        number = owned.detach()
    try:
        os.fstat(number)  # the with block's end did not close it
        with pytest.raises(ValueError):
            owned.detach()  # nothing left to hand over twice
    finally:
        os.close(number)


def test_opened_descriptors_are_close_on_exec(tmp_path: Path) -> None:
    with OwnedFd.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT, 0o600) as owned:
        assert not os.get_inheritable(owned.fd)


def test_a_file_object_takes_ownership_and_a_failed_one_does_not(tmp_path: Path) -> None:
    owned = OwnedFd.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT, 0o600)
    with pytest.raises(ValueError):
        owned.as_file("not a mode")
    assert not owned.closed  # still ours: closed once below, by us
    number = owned.fd
    with owned.as_file("wb") as f:
        assert f.fileno() == number and owned.closed
        f.write(b"x")
    with pytest.raises(OSError):
        os.fstat(number)  # the file object closed it
    assert (tmp_path / "a").read_bytes() == b"x"


def test_threads_closing_at_once_close_it_once(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    closes: list[int] = []
    real_close = os.close

    def counting_close(fd: int) -> None:
        closes.append(fd)
        real_close(fd)

    for _ in range(50):
        owned = OwnedFd.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT, 0o600)
        number = owned.fd
        start = threading.Barrier(8)

        def close_it(o: OwnedFd = owned, b: threading.Barrier = start) -> None:
            b.wait()
            o.close()

        monkeypatch.setattr(os, "close", counting_close)
        threads = [threading.Thread(target=close_it) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        monkeypatch.setattr(os, "close", real_close)
        assert closes.count(number) == 1
        closes.clear()


def test_a_forgotten_descriptor_is_closed_when_its_owner_goes(tmp_path: Path) -> None:
    owned = OwnedFd.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT, 0o600)
    number = owned.fd
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del owned
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    with pytest.raises(OSError):
        os.fstat(number)


# ------------------------------------------------ pipes handed to an event loop


def test_uvloop_is_known_to_close_pipe_numbers_itself() -> None:
    for kind, expected in (("uvloop", True), ("asyncio", False)):
        loop = _new_loop(kind)
        try:
            assert loop_closes_pipes(loop) is expected
        finally:
            loop.close()


@pytest.mark.parametrize("kind", LOOPS)
def test_a_pipe_handed_to_the_loop_is_closed_by_its_transport(kind: str) -> None:
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        rt, _ = await loop.connect_read_pipe(asyncio.Protocol, pipe_file(loop, OwnedFd(r), "rb"))
        wt, _ = await loop.connect_write_pipe(asyncio.Protocol,
                                              pipe_file(loop, OwnedFd(w), "wb"))
        rt.close()
        wt.close()
        for _ in range(3):
            await asyncio.sleep(0)
        return r, w

    loop = _new_loop(kind)
    try:
        r, w = loop.run_until_complete(main())
    finally:
        loop.close()
    gc.collect()
    for fd in (r, w):  # closed, not leaked (and not twice: see the strace test)
        with pytest.raises(OSError):
            os.fstat(fd)


_CHILD = r"""
import asyncio, os, sys
from pathlib import Path
from boxd.engine.gvisor._engine import open_fifo_streams

kind, d = sys.argv[1], Path(sys.argv[2])
if kind == "uvloop":
    import uvloop
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
out, inn = d / "out", d / "in"
os.mkfifo(out)
os.mkfifo(inn)
sandbox = [os.open(out, os.O_RDWR), os.open(inn, os.O_RDWR)]  # the sandbox's ends


async def main() -> None:
    for _ in range(3):
        reader, writer, rt = await open_fifo_streams(out, inn)
        os.write(sandbox[0], b"hello\n")
        assert await reader.readline() == b"hello\n"
        writer.write(b"ping\n")
        await writer.drain()
        assert os.read(sandbox[1], 5) == b"ping\n"
        rt.close()
        writer.close()
        for _ in range(5):
            await asyncio.sleep(0.01)
    try:
        os.open(d / "end-marker", os.O_RDONLY)
    except FileNotFoundError:
        pass

asyncio.run(main())
"""


@pytest.mark.parametrize("kind", LOOPS)
def test_the_agent_fifos_are_closed_exactly_once(kind: str, tmp_path: Path) -> None:
    # The path a gVisor machine's agent channel takes, counted in syscalls: each FIFO
    # descriptor opened is closed once (uvloop closed each twice: its second close hit
    # whatever file another thread had opened under that number meanwhile).
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (apt-get install strace): it counts the "
                    "close() calls; test_agent_fifos_survive_concurrent_opens covers "
                    "the same path statistically")
    trace = tmp_path / "trace"
    proc = subprocess.run(
        ["strace", "-f", "-qq", "-e", f"trace={_FD_CALLS}", "-e", "signal=none",
         "-o", str(trace), sys.executable, "-c", _CHILD, kind, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    closes = _fifo_closes(trace.read_text(), str(tmp_path))
    assert len(closes) == 6, closes  # three channels of two FIFOs each
    twice = [(fd, n) for fd, n in closes if n != 1]
    assert not twice, f"FIFO descriptors closed other than once on {kind}: {twice}"


# Every call that makes a descriptor: a number a FIFO had is someone else's after it.
_FD_CALLS = "openat,close,pipe2,socket,socketpair,dup,dup2,dup3,eventfd2,epoll_create1"


def _fifo_closes(trace: str, directory: str) -> list[tuple[int, int]]:
    """[(descriptor, times closed while it was the FIFO's)] for each FIFO opened before
    the child's end marker, from strace's output."""
    fifo = re.compile(r'openat\(AT_FDCWD, "' + re.escape(directory) +
                      r'/(?:out|in)", O_(?:RDONLY|WRONLY)\|O_NONBLOCK\|O_CLOEXEC\) = (\d+)')
    made = re.compile(r"^\d+\s+\w+\(.*\)\s+= (\d+)$")
    opened: list[list[int]] = []  # [fd, closes]
    live: dict[int, list[int]] = {}
    for line in trace.splitlines():
        if "end-marker" in line:
            break
        if m := fifo.search(line):
            live[int(m.group(1))] = entry = [int(m.group(1)), 0]
            opened.append(entry)
        elif m := re.search(r"\sclose\((\d+)\)", line):
            if (hit := live.get(int(m.group(1)))) is not None:
                hit[1] += 1
        elif (m := made.match(line)) is not None:
            live.pop(int(m.group(1)), None)  # the number is another file's now
    return [(fd, n) for fd, n in opened]


def test_agent_fifos_survive_concurrent_opens(tmp_path: Path) -> None:
    # The same path under load, as in the daemon: while the loop opens and closes agent
    # channels on uvloop, other threads open files (as rmtree does) and check each is
    # still theirs before closing it. A double close steals one of their numbers.
    import uvloop

    out, inn = tmp_path / "out", tmp_path / "in"
    os.mkfifo(out)
    os.mkfifo(inn)
    sandbox = [os.open(out, os.O_RDWR), os.open(inn, os.O_RDWR)]
    stop = threading.Event()
    stolen: list[int] = []

    def other_thread() -> None:
        while not stop.is_set():
            fd = os.open("/dev/null", os.O_RDONLY)
            if not _same_file(fd, "/dev/null"):
                stolen.append(fd)
                continue  # not ours any more: never close a number we do not own
            os.close(fd)

    async def churn() -> None:
        for _ in range(600):
            _, writer, rt = await open_fifo_streams(out, inn)
            rt.close()
            writer.close()
            await asyncio.sleep(0)

    threads = [threading.Thread(target=other_thread) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        uvloop.run(churn())
    finally:
        stop.set()
        for t in threads:
            t.join()
        for fd in sandbox:
            os.close(fd)
    assert stolen == []


# ------------------------------------------ a descriptor in use by a worker thread


def test_a_cancelled_transfer_never_writes_into_another_file(tmp_path: Path) -> None:
    # `receive` writes each chunk in a worker thread. Cancelled after the worker took
    # the write but before the write ran, it closed its descriptor at once; the file
    # opened next got that number, and the worker's write landed in it (a snapshot blob,
    # a state file). Now the cancellation waits for the write before the descriptor
    # closes. A profile hook holds the worker between taking the write and doing it.
    from concurrent.futures import ThreadPoolExecutor
    from types import FrameType
    from typing import Any

    from boxd.node._transfer import FileOffer, receive

    victim = tmp_path / "victim"
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()

    def hold_before_the_write(frame: FrameType, event: str, arg: Any) -> None:
        # The work item is running (no longer cancellable); its function is next.
        if (event == "return" and arg is True and armed.is_set()
                and frame.f_code.co_name == "set_running_or_notify_cancel"):
            entered.set()
            release.wait(10)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(max_workers=1)
        threading.setprofile(hold_before_the_write)  # for the worker started here
        try:
            executor.submit(int).result()
        finally:
            threading.setprofile(None)  # type: ignore[arg-type]
        loop.set_default_executor(executor)
        armed.set()

        async def fetch(_: FileOffer, offset: int, length: int) -> bytes:
            return b"x" * length

        offer = FileOffer("blob", "k", 4096, ((0, 4096),))
        task = asyncio.ensure_future(receive(fetch, offer, tmp_path / "dest"))
        for _ in range(5000):  # until the worker has the write, not yet started
            if entered.is_set():
                break
            await asyncio.sleep(0.001)
        assert entered.is_set()
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        other = os.open(victim, os.O_RDWR | os.O_CREAT, 0o600)  # the lowest free number
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await loop.shutdown_default_executor()
        os.close(other)

    asyncio.run(main())
    assert victim.read_bytes() == b""
    assert not (tmp_path / "dest").exists() and not (tmp_path / "dest.part").exists()
