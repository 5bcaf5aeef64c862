"""Boxd and AsyncBoxd in process (``transport=``) against the real FastAPI app built on
the real control plane and node runtime over the fake engine: no server, no socket.

The sync client goes through `SyncASGITransport` (httpx's ASGI transport on a loop in
a background thread), the async one through ``httpx.ASGITransport``; ``MockTransport``
shows what the client sends and how transport failures come back. Process streams
(WebSockets) cannot pass an httpx transport: they are tested through a real daemon in
test_rl_stream.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from starlette.types import ASGIApp
from tests._support import sdk_daemon as support
from tests._support.api_fakes import host_info
from tests._support.fake_world import ACCOUNT, World, make_world

from boxd import AsyncBoxd, Boxd, errors
from boxd.api import create_app
from boxd.api.services.keys import KeyService
from boxd.config import Paths

paths = support.paths  # fixtures
no_daemon = support.no_daemon


@dataclass
class App:
    world: World
    app: ASGIApp
    key: str


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_daemon: Paths) -> Iterator[App]:
    w = make_world(tmp_path, monkeypatch)
    keys = KeyService(w.repos.db)
    key = keys.create(ACCOUNT, "sdk").secret
    app = create_app(machines=w.machines, snapshots=w.snapshots, keys=keys,
                     host_info=host_info, upload_dir=tmp_path / "uploads",
                     private_dirs=(w.paths.home, w.paths.shm))
    yield App(w, app, key)
    w.repos.db.close()


@pytest.fixture
def boxd(fake: App) -> Iterator[Boxd]:
    with Boxd(api_key=fake.key, transport=support.SyncASGITransport(fake.app)) as b:
        yield b


def test_spec_rollout_loop_with_eight_threads(boxd: Boxd, fake: App) -> None:
    boxd.machines.new("rl-base")
    boxd.machines.wait_until_ready("rl-base")
    info = boxd.machines.files.upload("rl-base", "/home/boxd/rollout.py", "print('hi')\n")
    assert info.size == len(b"print('hi')\n")

    def rollout(seed: int) -> str:
        fork = boxd.machines.fork("rl-base", f"rollout-{seed}")
        boxd.machines.wait_until_ready(fork.id)
        result = boxd.machines.exec(fork.id, f"echo seed {seed}")
        boxd.machines.delete(fork.id)
        return result.stdout.strip()

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(rollout, range(8))) == [f"seed {s}" for s in range(8)]
    assert [m.name for m in boxd.machines.list()] == ["rl-base"]
    # the fork's memory is the source's: a file written before the fork is in the child
    child = boxd.machines.fork("rl-base", "late")
    assert boxd.machines.files.download(child.id, "/home/boxd/rollout.py") == b"print('hi')\n"


def test_machine_state_files_checkpoints_and_typed_errors(boxd: Boxd) -> None:
    m = boxd.machines.new("a")
    assert boxd.machines.wait_until_ready("a").state == "running"
    assert boxd.machines.get(m.id).name == "a"
    with pytest.raises(errors.AlreadyExists):
        boxd.machines.new("a")
    with pytest.raises(errors.MachineNotFound) as nf:
        boxd.machines.get("nope")
    assert nf.value.machine == "nope"
    boxd.machines.exec("a", "write /root/x one")
    boxd.machines.checkpoints.save("a", "start")
    boxd.machines.exec("a", "write /root/x two")
    assert boxd.machines.exec("a", "cat /root/x").stdout == "two"
    assert boxd.machines.checkpoints.restore("a", "start").id == m.id
    assert boxd.machines.exec("a", "cat /root/x").stdout == "one"
    assert [c.name for c in boxd.machines.checkpoints.list("a")] == ["start"]
    boxd.machines.checkpoints.delete("a", "start")
    with pytest.raises(errors.CheckpointNotFound):
        boxd.machines.checkpoints.restore("a", "start")
    with pytest.raises(errors.GuestFileNotFound):
        boxd.machines.files.download("a", "/nope")
    assert boxd.machines.suspend("a").state == "suspended"
    assert boxd.machines.resume("a").state == "running"
    events = list(boxd.machines.exec_stream("a", "echo streamed"))
    assert [e.type for e in events] == ["stdout", "exit"] and events[0].data == "streamed\n"
    kids = boxd.machines.fork("a", names=["k1", "a"])
    assert not isinstance(kids[0], errors.BoxdError) and kids[0].name == "k1"
    assert isinstance(kids[1], errors.AlreadyExists)
    tree = boxd.machines.lineage("a")
    assert [c.machine.name for c in tree.machines[0].children] == ["k1"]
    with pytest.raises(errors.InvalidRequest, match="either name or count"):
        boxd.machines.fork("a", "x", count=2)  # type: ignore[call-overload]
    boxd.machines.delete("a")
    with pytest.raises(errors.MachineNotFound):
        boxd.machines.delete("a")


def test_a_fork_names_its_node_on_one_host_too(boxd: Boxd) -> None:
    boxd.machines.new("a")
    boxd.machines.wait_until_ready("a")
    (here,) = boxd.nodes.list()
    assert boxd.machines.fork("a", "k1", node=here.id).node == here.id
    (kid,) = boxd.machines.fork("a", count=1, node=here.id)
    assert not isinstance(kid, errors.BoxdError) and kid.node == here.id
    with pytest.raises(errors.NotFound, match="no node 'elsewhere'") as nf:
        boxd.machines.fork("a", node="elsewhere")
    assert nf.value.details["field"] == "node"
    with pytest.raises(errors.NotFound, match="no node 'elsewhere'"):
        boxd.machines.fork("a", count=2, node="elsewhere")
    assert {m.name for m in boxd.machines.list()} == {"a", "k1", kid.name}


def test_verify_spread_checks_its_nodes_before_any_fork(boxd: Boxd) -> None:
    from boxd import rl

    boxd.machines.new("a")
    boxd.machines.wait_until_ready("a")
    (here,) = boxd.nodes.list()
    with pytest.raises(errors.InvalidRequest, match="needs two nodes or more; 1 given"):
        rl.verify("a", "CartPole-v1", seeds=range(2), steps=5, boxd=boxd,
                  placement="spread")
    with pytest.raises(errors.InvalidRequest, match="needs two nodes or more"):
        rl.verify("a", "CartPole-v1", seed=1, steps=5, boxd=boxd, placement="spread",
                  nodes=[here.id, here.id])
    with pytest.raises(errors.NotFound, match="no alive node 'far'"):
        rl.verify("a", "CartPole-v1", seed=1, steps=5, boxd=boxd, placement="spread",
                  nodes=[here.id, "far"])
    with pytest.raises(errors.InvalidRequest, match="needs machine sources"):
        rl.verify(rl.local(), "CartPole-v1", seed=1, steps=5, boxd=boxd,
                  placement="spread")
    with pytest.raises(errors.InvalidRequest, match="placement must be one of"):
        rl.verify("a", "CartPole-v1", seed=1, steps=5, boxd=boxd,
                  placement="nearby")  # type: ignore[arg-type]
    assert [m.name for m in boxd.machines.list()] == ["a"]  # no fork was made


def test_a_spread_runs_homes_rotate_over_the_nodes(boxd: Boxd) -> None:
    from boxd.rl import _verify
    from boxd.rl._machines import MachineHome

    boxd.machines.new("a")
    job = _verify._Job(sources=["a"], env="CartPole-v1", steps=5, policy=None, runs=2,
                       boxd=boxd, pickle_by_value=(), make_kwargs={},
                       nodes=("n1", "n2", "n3"))
    placed = []
    for k in range(3):
        for i in range(2):
            home = job.home(i, k)
            assert isinstance(home, MachineHome)
            placed.append(home.node)
    assert placed == ["n1", "n2", "n2", "n3", "n3", "n1"]  # a pair's runs: two nodes
    assert len(job._homes) == 3  # one per node, shared by every run there
    job.close()
    plain = _verify._Job(sources=["a"], env="x", steps=1, policy=None, runs=2, boxd=boxd,
                         pickle_by_value=(), make_kwargs={})
    home = plain.home(1, 0)  # one home for the source: its machines carry the job's labels
    assert isinstance(home, MachineHome) and home.node is None and home.source == "a"
    assert plain.home(0, 3) is home and home.labels["boxd.rl/owner"] == "verify"
    shared = _verify._Job(sources=["a"], env="x", steps=1, policy=None, runs=2, boxd=boxd,
                          pickle_by_value=(), make_kwargs={}, template=True)
    first = shared.home(0, 0)
    assert isinstance(first, MachineHome) and first.node is None
    assert shared.home(1, 5) is first  # every run forks the one built template


def test_verify_engines_finds_one_baseline_per_engine_by_name(boxd: Boxd) -> None:
    from boxd.cli._rl import _engine_sources

    engine = boxd.machines.new("base").engine
    assert _engine_sources(boxd, "base", [engine]) == ["base"]
    with pytest.raises(errors.MachineNotFound, match="no qemu baseline for base: "
                       "--engines looks for base-qemu") as missing:
        _engine_sources(boxd, "base", [engine, "qemu"])
    assert "boxd machine new base-qemu --engine qemu" in missing.value.hint
    boxd.machines.new("base-qemu")  # on the fake engine, not QEMU
    with pytest.raises(errors.InvalidRequest, match=f"base-qemu runs on {engine}, not qemu"):
        _engine_sources(boxd, "base", [engine, "qemu"])


def test_snapshots_round_trip(boxd: Boxd, tmp_path: Path) -> None:
    boxd.machines.new("a")
    boxd.machines.wait_until_ready("a")
    boxd.machines.exec("a", "write /root/v 3")
    snap = boxd.snapshots.save("a", "env-v3")
    assert boxd.snapshots.get("env-v3").digest == snap.digest
    seen: list[int] = []
    out = boxd.snapshots.export("env-v3", tmp_path / "env.boxd",
                                progress=lambda done, total: seen.append(done))
    assert out.stat().st_size == seen[-1] > 0
    boxd.snapshots.delete("env-v3")
    with pytest.raises(errors.SnapshotNotFound):
        boxd.snapshots.get("env-v3")
    assert boxd.snapshots.import_(out).digest == snap.digest
    m = boxd.machines.new("b", from_snapshot="env-v3")
    boxd.machines.wait_until_ready(m.id)
    assert boxd.machines.exec("b", "cat /root/v").stdout == "3"


def test_async_client_over_asgi_transport(fake: App, tmp_path: Path) -> None:
    async def go() -> None:
        transport = httpx.ASGITransport(app=fake.app)
        async with AsyncBoxd(api_key=fake.key, transport=transport) as b:
            await b.machines.new("a")
            await b.machines.wait_until_ready("a")
            kids = await asyncio.gather(*(b.machines.fork("a", f"k{i}") for i in range(8)))
            results = await asyncio.gather(*(b.machines.exec(k.id, f"echo {k.name}")
                                             for k in kids))
            assert [r.stdout for r in results] == [f"k{i}\n" for i in range(8)]
            events = [e async for e in b.machines.exec_stream("a", "echo hi")]
            assert events[-1].exit_code == 0
            snap = await b.snapshots.save("a", "s")
            out = await b.snapshots.export("s", tmp_path / "s.boxd")
            await b.snapshots.delete("s")
            assert (await b.snapshots.import_(out)).digest == snap.digest
            assert len((await b.machines.lineage()).machines[0].children) == 8
            with pytest.raises(errors.MachineNotFound):
                await b.machines.delete("nope")
            with pytest.raises(errors.AuthError):
                await AsyncBoxd(api_key="boxd_wrong", transport=transport).machines.list()

    asyncio.run(go())


def test_mock_transport_sees_what_the_client_sends(no_daemon: Paths) -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if request.url.path == "/v1/machines/gone":
            return httpx.Response(404, json={"error": {
                "code": "machine_not_found", "message": "no machine 'gone'",
                "details": {"machine": "gone"}}})
        return httpx.Response(201, json={"id": "m_1", "name": "a", "state": "starting"})

    with Boxd(api_key="boxd_k", transport=httpx.MockTransport(handler)) as b:
        with pytest.raises(errors.MachineNotFound, match="no machine 'gone'"):
            b.machines.get("gone")
        with pytest.raises(errors.BoxdError):
            b.machines.new("a", memory_mib=512)  # the fake answer is not a whole Machine
    get, new = sent
    assert (get.method, str(get.url)) == ("GET", "http://boxd/v1/machines/gone")
    assert get.headers["authorization"] == "Bearer boxd_k"
    assert get.headers["user-agent"].startswith("boxd-python/")
    assert (new.method, json.loads(new.content)) == (
        "POST", {"name": "a", "memory_mib": 512, "isolated": False})


@pytest.mark.parametrize(("exc", "message"), [
    (httpx.ConnectError("refused"), "cannot reach boxd at unix socket"),
    (httpx.ReadTimeout("slow"), r"timed out \(ReadTimeout\)"),
])
def test_transport_failures_are_connection_errors(
    no_daemon: Paths, exc: httpx.HTTPError, message: str
) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise exc

    async def go() -> None:
        async with AsyncBoxd(api_key="k", transport=httpx.MockTransport(handler)) as b:
            with pytest.raises(errors.ConnectionError, match=message):
                await b.machines.list()

    with pytest.raises(errors.ConnectionError, match=message):
        Boxd(api_key="k", transport=httpx.MockTransport(handler)).machines.list()
    asyncio.run(go())
    assert calls == 2  # one each: no daemon started, no retry through it
