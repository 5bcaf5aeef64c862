"""machines.spawn's stream through a real daemon (uvicorn on its unix socket, the
WebSocket route, the SDK handles) over the in-memory echo process of the API fakes.
The same path over real machines and the guest agent: tests/integration/test_rl_machines.py.
"""

from __future__ import annotations

import asyncio

import pytest
from tests._support import sdk_daemon as support

from boxd import AsyncBoxd, Boxd, errors
from boxd.api.server import Daemon

daemon = support.daemon  # fixtures
paths = support.paths


def test_frames_round_trip_in_order_and_exit(daemon: Daemon) -> None:
    with Boxd() as b:
        b.machines.new("a")
        proc = b.machines.spawn("a", ["python3", "server.py"], env={"X": "1"})
        assert proc.info.state == "running" and proc.info.argv == ["python3", "server.py"]
        payloads = [b"", b"x" * 100, bytes(range(256)) * 300]
        for p in payloads:
            proc.send(p)
        assert [proc.recv(timeout=10) for _ in payloads] == payloads
        assert [p.id for p in b.machines.processes("a")] == [proc.id]
        proc.send(b"exit")
        with pytest.raises(errors.Conflict, match="has exited") as info:
            proc.recv(timeout=10)
        assert info.value.details["exit_code"] == 0 and proc.exit_code == 0
        proc.close()


def test_recv_timeout_kill_and_reattach(daemon: Daemon) -> None:
    with Boxd() as b:
        b.machines.new("a")
        proc = b.machines.spawn("a", ["cat"])
        with pytest.raises(TimeoutError):
            proc.recv(timeout=0.05)
        proc.close()  # detaches; the process keeps running
        again = b.machines.attach("a", proc.id)
        again.send(b"still there")
        assert again.recv(timeout=10) == b"still there"
        assert again.kill(15).state == "exited"
        with pytest.raises(errors.Conflict):
            again.recv(timeout=10)


def test_stream_errors_are_typed(daemon: Daemon) -> None:
    with Boxd() as b:
        b.machines.new("a")
        with pytest.raises(errors.NotFound):
            b.machines.attach("a", "p-nope")
        with pytest.raises(errors.MachineNotFound):
            b.machines.spawn("nope", ["cat"])
        with pytest.raises(errors.InvalidRequest, match="argv"):
            b.machines.spawn("a", [])
    with Boxd(api_key="boxd_wrong") as bad, pytest.raises(errors.AuthError):
        bad.machines.spawn("a", ["cat"])


def test_many_round_trips_through_the_daemon_stay_in_order(daemon: Daemon) -> None:
    """The host side of the hot path alone (echo fake, no guest). Its speed is measured
    in bench/bench_rl.py, not asserted here; here every frame comes back, in order."""
    with Boxd() as b:
        b.machines.new("a")
        proc = b.machines.spawn("a", ["cat"])
        for i in range(300):
            msg = i.to_bytes(4, "big") * 25
            proc.send(msg)
            assert proc.recv() == msg


def test_async_handle(daemon: Daemon) -> None:
    async def go() -> None:
        async with AsyncBoxd() as b:
            await b.machines.new("a")
            procs = await asyncio.gather(*(b.machines.spawn("a", ["cat"]) for _ in range(4)))
            for i, p in enumerate(procs):
                await p.send(f"hello {i}".encode())
            got = await asyncio.gather(*(p.recv(timeout=10) for p in procs))
            assert got == [f"hello {i}".encode() for i in range(4)]
            assert len(await b.machines.processes("a")) == 4
            await procs[0].send(b"exit")
            with pytest.raises(errors.Conflict):
                await procs[0].recv(timeout=10)
            for p in procs:
                await p.close()

    asyncio.run(go())
