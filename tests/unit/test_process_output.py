"""A spawned process's stderr, followed without taking its client's frames (issue 43:
the web console's live tail): the node keeps its last `LOG_TAIL` bytes by offset
(`OutputLog`), and `process_output` reads after an offset, waiting a while for more.

The node path runs on the real control plane and node runtime over the fake engine
(tests/_support/fake_world.py), with a process that writes stderr.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests._support.fake_world import ACCOUNT, World, make_world, running

from boxd.engine.base import ExecChunk, ExecExit, ExecOutput
from boxd.errors import MachineNotFound, NotFound
from boxd.node._processes import STDERR_TAIL, OutputLog

pytestmark = pytest.mark.timeout(60)


def test_the_log_keeps_its_last_bytes_by_offset() -> None:
    log = OutputLog(limit=10)
    assert log.read(None) == (0, b"")
    log.add(b"hello ")
    log.add(b"")
    assert (log.start, log.end) == (0, 6)
    assert log.read(None) == (0, b"hello ")
    assert log.read(2) == (2, b"llo ")
    assert log.read(6) == (6, b"")
    assert log.read(99) == (6, b"")  # past the end: nothing, from the end
    log.add(b"world, again")  # 18 bytes written, the last 10 kept
    assert (log.start, log.end) == (8, 18) and len(log.buf) == 10
    assert log.read(6) == (8, b"rld, again")  # fell behind: from the first kept
    assert log.read(15) == (15, b"ain")
    assert log.tail(3) == b"ain"
    copy = log.copy()
    copy.add(b"!")
    assert log.read(None) == (8, b"rld, again") and copy.read(17) == (17, b"n!")


def test_a_reader_waiting_for_more_is_woken() -> None:
    async def run() -> None:
        log = OutputLog()
        waiter = asyncio.create_task(log.more())
        await asyncio.sleep(0)
        assert not waiter.done()
        log.add(b"x")
        await asyncio.wait_for(waiter, 1)
        waiter = asyncio.create_task(log.more())
        await asyncio.sleep(0)
        log.wake()  # the process ended
        await asyncio.wait_for(waiter, 1)

    asyncio.run(run())


class Logger:
    """A guest process that writes each line given to `say` to stderr, and exits 3 when
    told (`end`)."""

    def __init__(self) -> None:
        self.exec_id = 7
        self.lines: asyncio.Queue[bytes | None] = asyncio.Queue()

    def say(self, line: bytes) -> None:
        self.lines.put_nowait(line)

    def end(self) -> None:
        self.lines.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[ExecChunk]:
        return self._events()

    async def _events(self) -> AsyncIterator[ExecChunk]:
        while (line := await self.lines.get()) is not None:
            yield ExecOutput("stderr", line)
        yield ExecExit(exit_code=3, signal=None, timed_out=False, duration=0.0)

    async def write(self, data: bytes) -> None:
        return None

    async def close_stdin(self) -> None:
        return None

    async def kill(self, signal: int = 9) -> bool:
        self.end()
        return True

    async def aclose(self) -> None:
        return None


def test_process_output_through_the_control_plane(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        w: World = make_world(tmp_path, monkeypatch)
        try:
            await follow(w)
        finally:
            await w.node.close()

    asyncio.run(run())


async def follow(w: World) -> None:
    m = await running(w)
    proc = Logger()
    relay = w.node.procs.add(m.id, ["logger"], proc, lambda: None)  # type: ignore[arg-type]
    # A first read with nothing written yet waits for the first bytes.
    first = asyncio.create_task(
        w.machines.process_output(ACCOUNT, m.name, relay.id, None, wait=30))
    await asyncio.sleep(0.05)
    assert not first.done()
    proc.say(b"started\n")
    out = await asyncio.wait_for(first, 5)
    assert (out.start, out.end, out.data, out.state) == (0, 8, b"started\n", "running")

    # Nothing new: it waits `wait`, then answers empty from where the reader was.
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    quiet = await w.machines.process_output(ACCOUNT, m.id, relay.id, out.end, wait=0.2)
    assert quiet.data == b"" and quiet.start == quiet.end == 8
    assert loop.time() - t0 >= 0.2

    # A line written while a reader waits wakes it at once.
    waiting = asyncio.create_task(
        w.machines.process_output(ACCOUNT, m.id, relay.id, out.end, wait=30))
    await asyncio.sleep(0.05)
    proc.say(b"a line\n")
    more = await asyncio.wait_for(waiting, 5)
    assert (more.start, more.data) == (8, b"a line\n")

    # Past what is kept: the last LOG_TAIL bytes only, from the first one kept.
    big = b"y" * (relay.stderr.limit + 100)
    proc.say(big)
    while relay.stderr.end < more.end + len(big):
        await asyncio.sleep(0.01)
    behind = await w.machines.process_output(ACCOUNT, m.id, relay.id, more.end)
    assert behind.start > more.end and len(behind.data) == relay.stderr.limit
    assert len((await w.machines.processes(ACCOUNT, m.id))[0].stderr_tail) == STDERR_TAIL

    # Its end wakes a waiting reader, which sees it exited.
    waiting = asyncio.create_task(
        w.machines.process_output(ACCOUNT, m.id, relay.id, behind.end, wait=30))
    await asyncio.sleep(0.05)
    proc.end()
    ended = await asyncio.wait_for(waiting, 5)
    assert (ended.state, ended.exit_code, ended.data) == ("exited", 3, b"")

    with pytest.raises(NotFound):
        await w.machines.process_output(ACCOUNT, m.id, "p-nope")
    with pytest.raises(MachineNotFound):
        await w.machines.process_output("someone-else", m.id, relay.id)
