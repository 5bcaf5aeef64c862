"""The agent's ``attach`` op: a running exec followed again on a new connection.

This is what a fork child or a restored machine needs (its processes run on, with
their output going to a connection that is gone). Real agent, real processes, both
front ends (agent.py alone and boxd-init in front), as in tests/unit/test_agent.py.
On real machines: tests/integration/test_rl_machines.py (fork children, rewinds).
"""

from __future__ import annotations

import asyncio
import sys

import pytest
from tests._support import agent_guest as ta

from boxd.engine.agent import ExecExit, ExecOutput
from boxd.errors import InvalidRequest

pytestmark = pytest.mark.timeout(120)

guest = ta.guest  # fixture

WORKER = "import sys\nfor line in sys.stdin:\n    print(int(line) * 2, flush=True)\n"


async def _line(events: object) -> bytes:
    got = b""
    while not got.endswith(b"\n"):
        item = await asyncio.wait_for(anext(events), 10)  # type: ignore[call-overload]
        assert isinstance(item, ExecOutput) and item.stream == "stdout", item
        got += item.data
    return got


def test_attach_follows_a_running_exec_on_a_new_connection(guest: ta.Guest) -> None:
    async def main() -> None:
        first = await guest.client()
        proc = await first.start([sys.executable, "-u", "-c", WORKER])
        events = aiter(proc)
        await proc.write(b"2\n")
        assert await _line(events) == b"4\n"
        old_id = proc.exec_id
        await first.close()  # the connection goes away; the process runs on

        second = await guest.client()
        try:
            again = await second.attach(old_id)
            assert again.exec_id != old_id
            events = aiter(again)
            await again.write(b"21\n")
            assert await _line(events) == b"42\n"
            with pytest.raises(InvalidRequest):  # re-keyed: the old id is gone
                await second.attach(old_id)
            await again.close_stdin()
            rest = [item async for item in events]
            assert isinstance(rest[-1], ExecExit) and rest[-1].exit_code == 0
            with pytest.raises(InvalidRequest) as info:
                await second.attach(again.exec_id)  # finished: nothing to attach
            assert info.value.details["errno"] == "ESRCH"
        finally:
            await second.close()

    ta.run(main())
