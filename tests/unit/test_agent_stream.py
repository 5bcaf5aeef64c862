"""Streamed execs (``machines.spawn``'s processes) in the guest agent, protocol 1.4.

boxd-init serves them itself (no Python in the guest on a frame's path), ``stdin`` with
``"reply": false`` is answered only on an error, and the output of a process nobody
follows waits for the host that re-attaches. Real agent, real processes, both front
ends where both behave alike, as in tests/unit/test_agent.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from tests._support import agent_guest as ta

from boxd.engine.agent import AgentClient, ExecExit, ExecOutput
from boxd.errors import InternalError, InvalidRequest
from boxd.guest import protocol as P

pytestmark = pytest.mark.timeout(120)

guest = ta.guest  # fixtures
init_guest = ta.init_guest

WORKER = "import sys\nfor line in sys.stdin:\n    print(int(line) * 2, flush=True)\n"


async def _line(events: object, timeout: float = 10) -> bytes:
    got = b""
    while not got.endswith(b"\n"):
        item = await asyncio.wait_for(anext(events), timeout)  # type: ignore[call-overload]
        assert isinstance(item, ExecOutput) and item.stream == "stdout", item
        got += item.data
    return got


def _raw(c: AgentClient, msg: dict[str, object]) -> asyncio.Queue[dict[str, object] | None]:
    """Expect replies to a hand-made request id (what the client would not send)."""
    q: asyncio.Queue[dict[str, object] | None] = asyncio.Queue()
    c._channel._pending[int(msg["id"])] = q  # type: ignore[call-overload]
    return q


async def _send(c: AgentClient, msg: dict[str, object]) -> None:
    await c._channel.send_raw(json.dumps(msg).encode() + b"\n")


def test_init_serves_streamed_execs_itself(init_guest: ta.Guest) -> None:
    async def body(c: AgentClient) -> None:
        proc = await c.start(["sh", "-c", 'echo $PPID; exec cat'])
        events = aiter(proc)
        assert int(await _line(events)) == init_guest.proc.pid  # not agent.py's child
        await proc.write(b"through boxd-init\n")
        assert await _line(events) == b"through boxd-init\n"
        await proc.close_stdin()
        rest = [item async for item in events]
        assert isinstance(rest[-1], ExecExit) and rest[-1].exit_code == 0

    ta.with_client(init_guest, body)


def test_unacked_stdin_is_answered_only_on_error(guest: ta.Guest) -> None:
    async def body(c: AgentClient) -> None:
        assert c.supports(4)
        proc = await c.start([sys.executable, "-u", "-c", WORKER])
        events = aiter(proc)
        quiet = _raw(c, {"id": 7_000_001})
        await _send(c, {"id": 7_000_001, "op": P.OP_STDIN, "exec_id": proc.exec_id,
                        "data": "MjEK", "eof": False, "reply": False})  # "21\n"
        assert await _line(events) == b"42\n"
        await asyncio.sleep(0.3)
        assert quiet.empty()  # no result for it
        failing = _raw(c, {"id": 7_000_002})
        await _send(c, {"id": 7_000_002, "op": P.OP_STDIN, "exec_id": 123_456_789,
                        "data": "", "eof": False, "reply": False})
        err = await asyncio.wait_for(failing.get(), 10)
        assert err is not None and err["ev"] == P.EV_ERROR and err["code"] == P.ERR_NO_EXEC
        await proc.close_stdin()
        assert isinstance([item async for item in events][-1], ExecExit)
        with pytest.raises(InvalidRequest) as info:  # seen to end here: not even sent
            await proc.write(b"late\n")
        assert info.value.details["errno"] == P.ERR_NO_EXEC

    ta.with_client(guest, body)


def test_output_of_a_detached_process_waits_for_the_attach(guest: ta.Guest) -> None:
    """What a process writes while nobody follows it (between a fork and the child's
    attach, say) arrives at the host that re-attaches: it waits in the pipe."""
    script = ("import sys, time\nprint('before', flush=True)\ntime.sleep(2)\n"
              "print('while detached', flush=True)\nsys.stdin.read()\n")

    async def main() -> None:
        first = await guest.client()
        proc = await first.start([sys.executable, "-u", "-c", script])
        assert await _line(aiter(proc)) == b"before\n"
        await first.close()
        second = await guest.client()  # a new connection before the process writes
        try:
            await asyncio.sleep(3)
            again = await second.attach(proc.exec_id)
            events = aiter(again)
            assert await _line(events) == b"while detached\n"
            await again.close_stdin()
            assert isinstance([item async for item in events][-1], ExecExit)
        finally:
            await second.close()

    ta.run(main())


def test_init_bounds_stdin_a_command_does_not_read(init_guest: ta.Guest) -> None:
    async def body(c: AgentClient) -> None:
        proc = await c.start(["sleep", "60"])
        with pytest.raises(InvalidRequest):  # ended by the error below: not sent
            for _ in range(12):  # 12 MiB for a command that reads nothing: 8 MiB wait
                await proc.write(b"x" * P.FILE_CHUNK)
                await asyncio.sleep(0.05)
        with pytest.raises(InvalidRequest, match="stdin not taken") as info:
            async for _item in proc:
                pass
        assert info.value.details["errno"] == "ENOBUFS"
        assert await c.kill(proc.exec_id) is True  # it still runs; the host decides
        assert await c.ping() > 0

    ta.with_client(init_guest, body)


def _agent_py(init_pid: int) -> int:
    (pid,) = [p for p in ta._children(init_pid)
              if Path(f"/proc/{p}/cmdline").read_bytes().find(b"agent.py") >= 0]
    return pid


def test_init_tracks_only_requests_agent_py_answers(init_guest: ta.Guest) -> None:
    """A relayed line agent.py never answers (a stray chunk of a write that failed) is
    not kept as in flight: when agent.py restarts, nothing is "lost" for it."""

    async def body(c: AgentClient) -> None:
        with pytest.raises(InvalidRequest):  # a failed write: its later chunks get nothing
            await c.write_file("/", b"x")
        stray = _raw(c, {"id": 7_000_003})
        await _send(c, {"id": 7_000_003, "op": P.OP_WRITE, "offset": 1, "data": "eA==",
                        "eof": True})
        assert (await c.stat("/"))["type"] == "dir"  # relayed after it: it was read
        os.kill(_agent_py(init_guest.proc.pid), signal.SIGKILL)
        for _ in range(200):  # until agent.py is back
            try:
                await c.stat("/")
                break
            except InternalError:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert stray.empty(), stray.get_nowait()

    ta.with_client(init_guest, body)
