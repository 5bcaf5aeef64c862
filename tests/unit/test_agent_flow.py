"""Flow control of the agent protocol (1.3), against both guest front ends: a read or an
exec's output runs at most a window ahead of its consumer, a closed read stops in the
guest, and devices and fifos are refused instead of read forever or blocking."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest
from tests._support.agent_guest import Guest, guest, with_client  # noqa: F401 - the fixture

from boxd.engine.agent import AgentClient, ExecOutput
from boxd.errors import InvalidRequest
from boxd.guest import protocol as P

MIB = 1 << 20


def _positions(path: Path) -> list[int]:
    """File offsets of every open descriptor of ``path`` on this host."""
    out = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == str(path):
                        info = (fd_dir.parent / "fdinfo" / fd.name).read_text()
                        out.append(int(info.split()[1]))
    return out


def _queued(c: AgentClient) -> int:
    """Bytes of output the client holds, received and not yet consumed."""
    total = 0
    for q in c._channel._pending.values():
        for msg in list(q._queue):  # type: ignore[attr-defined]
            if msg is not None:
                total += len(msg.get("data") or "")
    return total


def test_a_read_stays_a_window_ahead_and_stops_when_closed(guest: Guest) -> None:  # noqa: F811
    big = guest.tmp / "big"
    with open(big, "wb") as f:
        f.truncate(256 * MIB)

    async def body(c: AgentClient) -> None:
        assert c.supports(3)
        chunks = c.read_stream(str(big))
        first = await anext(chunks)
        assert len(first) == P.FILE_CHUNK
        await asyncio.sleep(1.0)
        (pos,) = _positions(big)
        assert pos <= P.DEFAULT_WINDOW + 2 * P.FILE_CHUNK, pos
        await chunks.aclose()
        deadline = time.monotonic() + 10
        while _positions(big):
            assert time.monotonic() < deadline, "the agent still reads the file"
            await asyncio.sleep(0.05)

    with_client(guest, body)


def test_a_whole_read_is_intact_through_the_window(guest: Guest) -> None:  # noqa: F811
    data = os.urandom(3 * P.DEFAULT_WINDOW + 12345)
    path = guest.tmp / "data"
    path.write_bytes(data)

    async def body(c: AgentClient) -> None:
        got = bytearray()
        async for chunk in c.read_stream(str(path)):
            got += chunk
            await asyncio.sleep(0.001)
        assert bytes(got) == data

    with_client(guest, body)


def test_exec_output_waits_for_its_consumer(guest: Guest) -> None:  # noqa: F811
    async def body(c: AgentClient) -> None:
        stream = c.exec(["head", "-c", str(96 * MIB), "/dev/zero"])
        first = await anext(stream)
        while not isinstance(first, ExecOutput):
            first = await anext(stream)
        await asyncio.sleep(1.5)
        # base64 makes 4 characters of 3 bytes
        assert _queued(c) <= (P.DEFAULT_WINDOW + 2 * P.EXEC_CHUNK) * 4 // 3, _queued(c)
        total = len(first.data)
        async for item in stream:
            if isinstance(item, ExecOutput):
                total += len(item.data)
            else:
                assert item.exit_code == 0
        assert total == 96 * MIB

    with_client(guest, body)


def test_buffered_exec_output_is_cut_at_max_output(guest: Guest) -> None:  # noqa: F811
    async def body(c: AgentClient) -> None:
        out = await c.run("head -c 5000000 /dev/zero; echo err >&2", max_output=1000)
        assert len(out.stdout) == 1000 and out.stdout_truncated
        assert out.stderr == b"err\n" and not out.stderr_truncated and out.exit_code == 0

    with_client(guest, body)


def test_devices_and_fifos_are_refused(guest: Guest) -> None:  # noqa: F811
    fifo = guest.tmp / "fifo"
    os.mkfifo(fifo)

    async def body(c: AgentClient) -> None:
        for path, kind in (("/dev/zero", "character device"), (str(fifo), "fifo")):
            with pytest.raises(InvalidRequest) as info:
                await asyncio.wait_for(c.read_file(path), 10)
            assert kind in info.value.message and info.value.details["path"] == path
        assert await c.ping() >= 0  # nothing blocked

    with_client(guest, body)
