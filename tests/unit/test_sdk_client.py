"""Boxd and AsyncBoxd over the real app and fake services: in process through
``transport=`` (sync: `SyncASGITransport`, async: ``httpx.ASGITransport``), and through a
real daemon (uvicorn, unix socket, local.key) for the default connection and autostart.
The same client on the fake engine: test_sdk_inprocess.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from starlette.types import ASGIApp
from tests._support import sdk_daemon as support

from boxd import AsyncBoxd, Boxd, errors
from boxd.api.server import Daemon
from boxd.config import Paths
from boxd.sdk import _local

daemon = support.daemon  # fixtures
paths = support.paths
no_daemon = support.no_daemon


@pytest.fixture
def app(tmp_path: Path, no_daemon: Paths) -> tuple[ASGIApp, str]:
    return support.scripted_app(tmp_path)


@pytest.fixture
def client(app: tuple[ASGIApp, str]) -> Iterator[Boxd]:
    transport = support.SyncASGITransport(app[0])
    with Boxd(api_key=app[1], base_url="http://boxd", transport=transport) as b:
        yield b


def test_spec_rollout_loop_with_eight_threads(daemon: Daemon, tmp_path: Path) -> None:
    boxd = Boxd()  # no BOXD_URL, no BOXD_API_KEY: local socket + local.key
    boxd.machines.new("rl-base")
    script = tmp_path / "rollout.py"
    script.write_text("print('hi')\n")
    info = boxd.machines.files.upload("rl-base", "/home/boxd/rollout.py", script.read_text())
    assert info.size == len(b"print('hi')\n")

    def rollout(name: str, seed: int) -> str:
        fork = boxd.machines.fork("rl-base", name)
        boxd.machines.wait_until_ready(fork.id)
        result = boxd.machines.exec(fork.id, f"python3 /home/boxd/rollout.py --seed {seed}")
        boxd.machines.delete(fork.id)
        return result.stdout.strip()

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda s: rollout(f"rollout-{s}", seed=s), range(8)))
    assert results == [f"python3 /home/boxd/rollout.py --seed {s}" for s in range(8)]
    assert [m.name for m in boxd.machines.list()] == ["rl-base"]
    boxd.close()


def test_typed_errors_and_exec_timeout(client: Boxd) -> None:
    with client as b:
        with pytest.raises(errors.MachineNotFound) as e:
            b.machines.get("nope")
        assert e.value.machine == "nope"
        b.machines.new("a")
        with pytest.raises(errors.AlreadyExists):
            b.machines.new("a")
        with pytest.raises(errors.ExecTimeout) as t:
            b.machines.exec("a", "sleep 100", timeout=1)
        assert t.value.stdout == "partial"
        with pytest.raises(errors.GuestFileNotFound):
            b.machines.files.download("a", "/nope")


def test_bad_key_is_auth_error(daemon: Daemon) -> None:
    with pytest.raises(errors.AuthError):
        Boxd(api_key="boxd_wrong").machines.list()


def test_bad_key_is_auth_error_in_process(app: tuple[ASGIApp, str]) -> None:
    transport = support.SyncASGITransport(app[0])
    with pytest.raises(errors.AuthError):
        Boxd(api_key="boxd_wrong", transport=transport).machines.list()


def test_stream_files_checkpoints_snapshots_batch(client: Boxd, tmp_path: Path) -> None:
    with client as b:
        b.machines.new("a")
        events = list(b.machines.exec_stream("a", ["exit", "3"]))
        assert [e.type for e in events] == ["stdout", "stderr", "exit"]
        assert events[-1].exit_code == 3
        b.machines.files.upload("a", "/f", b"\x00\x01")
        assert b.machines.files.download("a", "/f") == b"\x00\x01"
        b.machines.checkpoints.save("a", "start")
        assert [c.name for c in b.machines.checkpoints.list("a")] == ["start"]
        assert b.machines.checkpoints.restore("a", "start").name == "a"
        b.machines.checkpoints.delete("a", "start")
        with pytest.raises(errors.CheckpointNotFound):
            b.machines.checkpoints.restore("a", "start")
        kids = b.machines.fork("a", names=["k1", "a"])
        assert not isinstance(kids[0], errors.BoxdError) and kids[0].name == "k1"
        assert isinstance(kids[1], errors.AlreadyExists)
        snap = b.snapshots.save("a", "env-v3")
        assert b.snapshots.get("env-v3").digest == snap.digest
        out = b.snapshots.export("env-v3", tmp_path / "env.boxd")
        assert out.exists()
        b.snapshots.delete("env-v3")
        assert b.snapshots.import_(out).name  # the fake invents a digest
        assert b.info().version
        assert b.keys.create("ci").secret
        assert len(b.keys.list()) >= 2


def test_async_client(app: tuple[ASGIApp, str]) -> None:
    async def go() -> None:
        transport = httpx.ASGITransport(app=app[0])
        async with AsyncBoxd(api_key=app[1], transport=transport) as b:
            await b.machines.new("a")
            kids = await asyncio.gather(*(b.machines.fork("a", f"k{i}") for i in range(8)))
            results = await asyncio.gather(*(b.machines.exec(k.id, "echo hi") for k in kids))
            assert {r.stdout for r in results} == {"echo hi\n"}
            events = [e async for e in b.machines.exec_stream("a", "exit 7")]
            assert events[-1].exit_code == 7
            with pytest.raises(errors.MachineNotFound):
                await b.machines.delete("nope")

    asyncio.run(go())


def test_unreachable_url_is_connection_error(paths: Paths) -> None:
    with pytest.raises(errors.ConnectionError, match="cannot reach boxd"):
        Boxd(base_url="http://127.0.0.1:9").machines.list()


def test_autostart_spawns_one_daemon_for_concurrent_clients(
    paths: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned: list[Daemon] = []

    class Proc:
        def poll(self) -> None:
            return None

        def terminate(self) -> None:
            pass

    def fake_spawn(p: Paths) -> Proc:
        d, _ = support.start_daemon(p, tmp_path)
        spawned.append(d)
        return Proc()

    monkeypatch.setattr(_local, "_spawn", fake_spawn)
    clients = [Boxd() for _ in range(4)]
    barrier = threading.Barrier(4)

    def use(b: Boxd) -> int:
        barrier.wait()
        return len(b.machines.list())

    try:
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(use, clients)) == [0, 0, 0, 0]
        assert len(spawned) == 1
    finally:
        for d in spawned:
            d.stop()


def test_failed_autostart_names_the_log(paths: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    class Dead:
        def poll(self) -> int:
            return 3

        def terminate(self) -> None:
            pass

    def fake_spawn(p: Paths) -> Dead:
        p.log.write_text("Traceback: qemu not found\n")
        return Dead()

    monkeypatch.setattr(_local, "_spawn", fake_spawn)
    with pytest.raises(errors.ConnectionError) as e:
        Boxd().machines.list()
    assert "exited at start-up with status 3" in str(e.value)
    assert "qemu not found" in str(e.value) and str(paths.log) in str(e.value)
