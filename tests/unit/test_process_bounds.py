"""What the node holds of spawned processes' output is bounded, whatever the guest writes.

A process's stdout is cut into frames by `boxd.node._processes.Relay`: a frame header
larger than a process may hold is refused when it arrives, the frame being received
counts towards the per-process bound, all processes of a node share a total, and a
process past a bound is killed with the reason in its model (``processes``). The agent
channel keeps a spawned process's output at most a flow-control window ahead of the
relay, a machine's relayed guest API connections are capped, and a spawn or exec with
bad input is a 400 (as exec's), one that cannot start an error, never a 201 and a
process that "exited" with nothing said.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests._support import agent_guest as ta
from tests._support.api_fakes import FakeMachines, FakeSnapshots, host_info
from tests._support.fake_world import ACCOUNT, World, make_world, running

from boxd import process_models as pm
from boxd.api import create_app
from boxd.api.services.keys import KeyService
from boxd.engine import agent as agent_mod
from boxd.engine.agent import AgentClient, ExecExit, ExecOutput, GuestStream
from boxd.engine.base import ExecChunk
from boxd.errors import GuestFileNotFound, InvalidRequest
from boxd.guest import protocol as P
from boxd.node import _processes as procs
from boxd.node._processes import Budget, ProcessStream, ProcessTable, Relay
from boxd.state import Database

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
CHUNK = 64 << 10  # what the agent delivers at a time (EXEC_CHUNK)

guest = ta.guest  # fixtures
init_guest = ta.init_guest


class Framed:
    """A guest process writing ``output`` on stdout in agent-sized chunks, then (unless
    ``hang``) ending without an exit status; `kill` ends it with one (137)."""

    def __init__(self, output: bytes, *, hang: bool = True) -> None:
        self.exec_id = 1
        self.output = output
        self.hang = hang
        self.produced = 0
        self.killed = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[ExecChunk]:
        return self._events()

    async def _events(self) -> AsyncIterator[ExecChunk]:
        for i in range(0, len(self.output), CHUNK):
            if self.killed.is_set():
                break
            data = self.output[i : i + CHUNK]
            self.produced += len(data)
            yield ExecOutput("stdout", data)
            await asyncio.sleep(0)
        if self.hang:
            await self.killed.wait()
        if self.killed.is_set():
            yield ExecExit(exit_code=137, signal=9, timed_out=False, duration=0.0)

    async def write(self, data: bytes) -> None:
        return None

    async def close_stdin(self) -> None:
        return None

    async def kill(self, signal: int = 9) -> bool:
        self.killed.set()
        return True

    async def aclose(self) -> None:
        self.killed.set()


class Giant:
    """A process announcing one 255 MiB frame, then streaming its bytes (as much as is
    read, up to ``limit``)."""

    def __init__(self, limit: int = 255 * MIB) -> None:
        self.exec_id = 2
        self.limit = limit
        self.produced = 0
        self.killed = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[ExecChunk]:
        return self._events()

    async def _events(self) -> AsyncIterator[ExecChunk]:
        yield ExecOutput("stdout", (255 * MIB).to_bytes(4, "big"))
        data = bytes(CHUNK)
        while self.produced < self.limit and not self.killed.is_set():
            self.produced += len(data)
            yield ExecOutput("stdout", data)
            await asyncio.sleep(0)
        await self.killed.wait()
        yield ExecExit(exit_code=137, signal=9, timed_out=False, duration=0.0)

    write = Framed.write
    close_stdin = Framed.close_stdin
    kill = Framed.kill
    aclose = Framed.aclose


def frame(n: int, fill: bytes = b"x") -> bytes:
    return n.to_bytes(4, "big") + fill * n


def _relay(process: object, budget: Budget | None = None) -> Relay:
    r = Relay(id="p-1", machine_id="m_1", argv=["env-server"], started_at=0.0, exec_id=1,
              budget=budget if budget is not None else Budget())
    r.bind(process, lambda: None)  # type: ignore[arg-type]
    return r


async def _ended(r: Relay, timeout: float = 10) -> None:
    assert r.task is not None
    await asyncio.wait_for(asyncio.shield(r.task), timeout)


# ----------------------------------------------------------------- per process


def test_a_giant_frame_header_is_refused_when_it_arrives() -> None:
    async def main() -> None:
        # Before: the 64 MiB bound counted complete frames only, so the relay buffered
        # towards the 255 MiB frame (the guest stops at 80 MiB here to keep the test
        # cheap) and the process was never killed.
        p = Giant(limit=80 * MIB)
        r = _relay(p)
        await _ended(r)
        assert p.killed.is_set() and r.state == "exited"
        assert p.produced <= CHUNK  # refused at the header, not buffered towards
        assert r.buffered == 0 and r.budget.used == 0
        assert r.exit is not None and r.exit.exit_code == 137 and r.exit.signal == 9
        model = r.model()
        assert model.reason is not None and "frame header" in model.reason
        assert str(procs.MAX_FRAME) in model.reason and model.exit_code == 137

    asyncio.run(main())


def test_no_frame_may_be_larger_than_what_a_process_may_hold() -> None:
    assert procs.MAX_FRAME <= procs.MAX_BUFFERED
    assert procs.MAX_BUFFERED <= procs.MAX_BUFFERED_TOTAL
    assert ProcessTable().budget.limit == procs.MAX_BUFFERED_TOTAL


def test_the_frame_being_received_counts_towards_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(procs, "MAX_BUFFERED", 4 * MIB)
    monkeypatch.setattr(procs, "MAX_FRAME", 4 * MIB)

    async def main() -> None:
        # One 3 MiB frame nobody reads, then 2 MiB of a second one: 5 MiB held.
        p = Framed(frame(3 * MIB) + frame(3 * MIB)[: 2 * MIB])
        r = _relay(p)
        await _ended(r)
        assert p.killed.is_set() and r.state == "exited"
        assert r.buffered == 0 and r.budget.used == 0 and r.frames.qsize() == 1  # the end
        reason = r.model().reason
        assert reason is not None and "per process" in reason and str(4 * MIB) in reason
        stream = ProcessStream(r, _no_send, _no_reattach)
        assert await stream.recv() is None  # the unread frames were dropped

    asyncio.run(main())


async def _no_send(relay: Relay, data: bytes) -> None:
    raise AssertionError("not sent")


async def _no_reattach(relay: Relay) -> None:
    raise AssertionError("not re-attached")


def test_frames_read_are_released(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "MAX_BUFFERED", 4 * MIB)
    monkeypatch.setattr(procs, "MAX_FRAME", 4 * MIB)

    async def main() -> None:
        # 16 MiB in all through a 4 MiB bound: fine while a reader keeps up.
        p = Framed(b"".join(frame(MIB, bytes([i])) for i in range(16)), hang=False)
        budget = Budget(8 * MIB)
        r = _relay(p, budget)
        stream = ProcessStream(r, _no_send, _no_reattach)
        got = []
        for _ in range(16):
            f = await asyncio.wait_for(stream.recv(), 10)
            assert f is not None and len(f) == MIB
            got.append(f[0])
            assert r.buffered <= 4 * MIB and budget.used <= 8 * MIB
        assert got == list(range(16))
        await _ended(r)
        assert r.model().reason == "the agent connection closed"  # not killed
        assert r.buffered == 0 and budget.used == 0

    asyncio.run(main())


# ----------------------------------------------------------------- all processes


def test_processes_together_are_bounded_by_the_total(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "MAX_BUFFERED", 4 * MIB)
    monkeypatch.setattr(procs, "MAX_FRAME", 4 * MIB)

    async def main() -> None:
        # Four processes, each under its own bound (3 MiB frames nobody reads), 12 MiB
        # together against a 10 MiB total: the one whose output passes it is killed.
        table = ProcessTable(Budget(10 * MIB))
        ps = [Framed(frame(3 * MIB)) for _ in range(4)]
        relays = [table.add("m_1", ["env"], p, lambda: None) for p in ps]
        await asyncio.sleep(0)
        for _ in range(400):
            if any(p.killed.is_set() for p in ps) and all(
                    p.produced == len(p.output) or p.killed.is_set() for p in ps):
                break
            await asyncio.sleep(0.01)
        killed = [r for r, p in zip(relays, ps, strict=True) if p.killed.is_set()]
        assert len(killed) == 1
        await _ended(killed[0])
        assert table.budget.used == 9 * MIB  # the three others' frames
        reason = killed[0].model().reason
        assert reason is not None and "for all processes" in reason and str(10 * MIB) in reason
        assert [r.state for r in relays].count("running") == 3
        await table.close()
        assert table.budget.used == 0

    asyncio.run(main())


# ------------------------------------------------------ the node (fake engine)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = make_world(tmp_path, monkeypatch)
    yield w
    w.repos.db.close()


def test_a_killed_process_says_why_in_processes(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        p = await world.machines.spawn(ACCOUNT, m.id, pm.SpawnRequest(argv=["cat"]))
        relay = world.node.procs.get(m.id, p.id)
        assert relay.process is not None
        # The fake guest's cat writes back what it is sent: a 255 MiB frame header.
        await relay.process.write((255 * MIB).to_bytes(4, "big") + b"data")
        await _ended(relay)
        (listed,) = await world.machines.processes(ACCOUNT, m.id)
        assert listed.state == "exited" and listed.exit_code == 137 and listed.signal == 9
        assert listed.reason is not None and "frame header" in listed.reason
        body = pm.ProcessList(processes=[listed]).model_dump(mode="json")
        assert "frame header" in body["processes"][0]["reason"]
        assert world.node.procs.budget.used == 0

    asyncio.run(main())


def test_reason_is_optional_in_the_process_model() -> None:
    # An older daemon's answer (no reason) still parses.
    p = pm.Process.model_validate({"id": "p-1", "machine": "m", "argv": ["x"],
                                   "state": "running", "started_at": 0.0})
    assert p.reason is None


# ------------------------------------------------------------------ API inputs


class Env:
    def __init__(self, tmp: Path) -> None:
        self.db = Database(tmp / "state.db")
        keys = KeyService(self.db)
        self.app = create_app(
            machines=FakeMachines(), snapshots=FakeSnapshots(FakeMachines(), tmp), keys=keys,
            host_info=host_info, upload_dir=tmp / "uploads")
        secret = keys.create(keys.ensure_local_account(), "test").secret
        self.client = TestClient(self.app, raise_server_exceptions=False)
        self.client.headers["Authorization"] = f"Bearer {secret}"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    e.client.post("/v1/machines", json={"name": "a"})
    yield e
    e.client.close()
    e.db.close()


BIG = "x" * (10 * MIB)
BAD_INPUTS = [
    ({"env": {"A=B": "1"}}, "env", None),
    ({"env": {"A\x00B": "1"}}, "env", None),
    ({"env": {"A": "a\x00b"}}, "env", None),
    ({"argv": ["echo", "a\x00b"]}, "argv", None),
    ({"cwd": "/tmp\x00x"}, "cwd", None),
    ({"cwd": "relative/dir"}, "cwd", None),
    ({"argv": ["x"] * 1_000_000}, "argv", "65536"),
    ({"argv": ["echo", BIG]}, "argv", "131071"),
    ({"argv": ["echo"] + ["y" * 100_000] * 12}, "argv", "1048576"),
    ({"env": {f"V{i}": "v" * 100_000 for i in range(12)}}, "env", "1048576"),
]


@pytest.mark.parametrize(("extra", "field", "limit"), BAD_INPUTS)
def test_bad_spawn_input_is_a_400_naming_the_field(
    api: Env, extra: dict[str, object], field: str, limit: str | None,
) -> None:
    body = {"argv": ["cat"], **extra}
    r = api.client.post("/v1/machines/a/processes", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["details"]["field"] == field
    if limit is not None:
        assert limit in err["message"]


# Exec refused the others already (NUL bytes, '=' in a name): the new rules.
@pytest.mark.parametrize(("extra", "field", "limit"), BAD_INPUTS[5:])
def test_bad_exec_input_is_a_400_naming_the_field(
    api: Env, extra: dict[str, object], field: str, limit: str | None,
) -> None:
    body: dict[str, object] = {"command": ["echo", "hi"], **extra}
    if "argv" in body:
        body["command"] = body.pop("argv")
        field = "command" if field == "argv" else field
    r = api.client.post("/v1/machines/a/exec", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["details"]["field"] == field
    if limit is not None:
        assert limit in err["message"]


def test_an_over_long_shell_command_is_a_400(api: Env) -> None:
    r = api.client.post("/v1/machines/a/exec", json={"command": BIG})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["details"]["field"] == "command" and "131071" in err["message"]


def test_good_spawn_and_exec_inputs_still_pass(api: Env) -> None:
    r = api.client.post("/v1/machines/a/processes",
                        json={"argv": ["cat"], "env": {"A": "1"}, "cwd": "/tmp"})
    assert r.status_code == 201, r.text
    r = api.client.post("/v1/machines/a/exec",
                        json={"command": ["echo"] + ["y" * 100_000] * 8, "cwd": "/"})
    assert r.status_code == 200, r.text


# ------------------------------------------------- the agent channel (real agent)


def test_a_spawn_that_cannot_start_is_an_error(guest: ta.Guest) -> None:
    async def body(c: AgentClient) -> None:
        with pytest.raises(GuestFileNotFound) as info:
            await c.start(["/no/such/binary"])
        assert "/no/such/binary" in info.value.message
        assert info.value.details["exit_code"] == 127
        with pytest.raises(GuestFileNotFound) as info:
            await c.start(["cat"], cwd="/no/such/dir")
        assert "/no/such/dir" in info.value.message
        with pytest.raises(InvalidRequest) as info2:
            await c.start([str(guest.tmp)])  # a directory: cannot be executed
        assert info2.value.details["exit_code"] == 126
        proc = await c.start(["cat"])  # the connection is fine
        await proc.write(b"still\n")
        item = await asyncio.wait_for(anext(aiter(proc)), 10)
        assert item == ExecOutput("stdout", b"still\n")
        await proc.aclose()

    ta.with_client(guest, body)


def test_a_spawned_process_is_held_by_the_window_not_the_host(init_guest: ta.Guest) -> None:
    async def body(c: AgentClient) -> None:
        # 64 MiB of output nobody takes: the agent stops a window ahead.
        proc = await c.start([sys.executable, "-c",
                              "import sys; sys.stdout.buffer.write(bytes(64 << 20))"])
        await asyncio.sleep(3)
        q = c._channel._pending[proc.exec_id]
        pending: list[dict[str, object] | None] = list(q._queue)  # type: ignore[attr-defined]
        held = sum(len(str(m.get("data") or "")) for m in pending if m is not None)
        assert held * 3 // 4 <= P.DEFAULT_WINDOW + CHUNK, held
        total = 0
        async for item in proc:
            if isinstance(item, ExecOutput):
                total += len(item.data)
        assert total == 64 << 20

    ta.with_client(init_guest, body)


def test_relayed_guest_connections_are_capped(
    guest: ta.Guest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_mod, "MAX_GUEST_STREAMS", 3)

    async def echo(stream: GuestStream) -> None:
        while data := await stream.read():
            await stream.write(data.upper())

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(guest.sysroot / "run/boxd/boxd.sock"))
        return s

    async def roundtrip(s: socket.socket, data: bytes) -> bytes:
        def go() -> bytes:
            s.sendall(data)
            return s.recv(100)

        return await asyncio.to_thread(go)

    async def main() -> None:
        c = await guest.client()
        streams: dict[int, GuestStream] = {}
        started = asyncio.Event()
        relay = asyncio.create_task(c.serve_relay("boxdm_cap", echo, streams=streams,
                                                  on_started=started.set))
        await asyncio.wait_for(started.wait(), 10)
        socks = [connect() for _ in range(3)]
        for s in socks:
            assert await roundtrip(s, b"ok") == b"OK"
        extra = connect()
        assert await asyncio.to_thread(extra.recv, 100) == b""  # closed at once
        assert len(streams) == 3
        socks[0].close()
        for _ in range(100):
            if len(streams) < 3:
                break
            await asyncio.sleep(0.05)
        again = connect()  # room again
        assert await roundtrip(again, b"back") == b"BACK"
        for s in [*socks[1:], extra, again]:
            s.close()
        await c.close()
        await relay

    asyncio.run(main())


# ----------------------------------------------------------------- memory per frame


def test_a_large_frame_is_held_once_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 63 MiB frame nobody has read costs the node 63 MiB, as counted: it is received
    into a buffer of its own size and handed on whole (the round-4 probe saw six such
    frames raise the daemon's RSS by 330-373 MiB against the 256 MiB bound: each was
    held three times while it was cut out, as buffer, slice and bytes)."""
    import tracemalloc

    n = 63 * MIB
    output = frame(n)

    async def main() -> int:
        p = Framed(output)
        tracemalloc.start()
        try:
            r = _relay(p)
            while r.frames.qsize() == 0:
                await asyncio.sleep(0.01)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert r.buffered == n and r.budget.used == n  # as counted
        stream = ProcessStream(r, _no_send, _no_reattach)
        got = await stream.recv()
        assert got is not None and len(got) == n and got == output[4:]
        p.killed.set()
        await _ended(r)
        return peak

    peak = asyncio.run(main())
    assert peak < n + 4 * MIB, f"peak {peak / MIB:.1f} MiB for a {n / MIB:.0f} MiB frame"


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 7, 64, 1000])
def test_frames_of_every_size_survive_any_cut(chunk: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Small frames sliced from the buffer and large ones received whole give the same
    frames, whatever the sizes of the pieces the agent delivers."""
    monkeypatch.setattr(procs, "BIG_FRAME", 16)
    sizes = [0, 1, 5, 15, 16, 7, 19, 0, 2, 300, 3, 16]
    frames = [bytes([i % 251]) * s for i, s in enumerate(sizes)]
    stream = b"".join(len(f).to_bytes(4, "big") + f for f in frames)
    cutter = procs._Cutter()
    got: list[bytes | bytearray] = []
    for i in range(0, len(stream), chunk):
        got += cutter.feed(stream[i : i + chunk])
    assert [bytes(g) for g in got] == frames
    assert cutter.big is None and not cutter.buf
