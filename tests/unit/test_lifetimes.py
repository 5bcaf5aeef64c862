"""Machine lifetimes (issue 42, item 1): ``timeout=`` on new and fork, ``set_timeout``,
``Machine.end_at``, and the control plane's reaper that ends machines at their end.

The SDK talks in process to the real FastAPI app on the real control plane, node
runtime and SQLite state over the fake engine (tests/_support/fake_world.py). The
reaper's clock is the test's: ``run_once`` ends what is due at the time the test sets.
The real daemon with real machines (and a SIGKILL in the middle) is
tests/integration/test_lifetimes.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World

from boxd import Boxd, errors, models
from boxd.api.server import Daemon
from boxd.cli import main
from boxd.control import lifetimes
from boxd.models import MachineState
from boxd.state import Database, Repos

paths = support.paths  # fixtures
no_daemon = support.no_daemon
daemon = support.daemon


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


world = support.world  # fixture


@pytest.fixture
def clock(world: World) -> Clock:
    c = Clock()
    world.machines.lifetimes.reaper.clock = c
    return c


@pytest.fixture
def transport(world: World, tmp_path: Path) -> support.SyncASGITransport:
    app, _ = support.world_app(world, tmp_path)
    return support.SyncASGITransport(app)


@pytest.fixture
def boxd(world: World, tmp_path: Path, transport: support.SyncASGITransport,
         clock: Clock) -> Iterator[Boxd]:
    _, keys = support.world_app(world, tmp_path)
    key = keys.create(ACCOUNT, "sdk").secret
    with Boxd(api_key=key, transport=transport) as b:
        yield b


def reap(transport: support.SyncASGITransport, world: World) -> float:
    """One pass of the reaper, on the app's loop (where the fake engine lives)."""
    return transport.run(world.machines.lifetimes.reaper.run_once())


def names(world: World) -> list[str]:
    return [r.name for r in world.repos.machines.list(ACCOUNT)]


# ------------------------------------------------------------------- validation


@pytest.mark.parametrize("timeout", [0, -1, 1.5, 3.0, True, "3", models.MAX_TIMEOUT + 1])
def test_a_bad_timeout_is_refused_by_the_sdk_and_by_the_daemon(
    boxd: Boxd, world: World, timeout: Any,
) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        boxd.machines.new("m", timeout=timeout)
    assert caught.value.details["field"] == "timeout"
    if timeout == 3.0 and not isinstance(timeout, bool):
        return  # JSON's 3.0 is the integer 3 on the wire (JSON Schema): the next test
    # a client that skips the SDK's check gets a 400 from the daemon
    resp = boxd._client().post("/v1/machines", json={"name": "m", "timeout": timeout})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_request"
    assert names(world) == []  # nothing half-made


def test_a_json_number_without_a_fraction_is_an_integer_timeout(
    boxd: Boxd, clock: Clock,
) -> None:
    # Found by the API fuzz: the schema says "integer", and JSON Schema counts 8711.0 as
    # one, so the daemon must take it (it answered 400); the SDKs still refuse 3.0.
    resp = boxd._client().post("/v1/machines", json={"name": "m", "timeout": 30.0})
    assert resp.status_code == 201, resp.text
    resp = boxd._client().post("/v1/machines/m/timeout", json={"timeout": 8711.0})
    assert resp.status_code == 200, resp.text
    end = boxd.machines.get("m").end_at
    assert end is not None and abs(end.timestamp() - (clock() + 8711)) < 2


def test_a_bad_on_timeout_is_refused(boxd: Boxd, world: World) -> None:
    with pytest.raises(errors.InvalidRequest, match="on_timeout"):
        boxd.machines.new("m", timeout=5, on_timeout="suspend")
    resp = boxd._client().post("/v1/machines",
                               json={"name": "m", "timeout": 5, "on_timeout": "suspend"})
    assert resp.status_code == 400
    assert names(world) == []


def test_set_timeout_refuses_zero_and_too_long_and_keeps_the_end(boxd: Boxd) -> None:
    m = boxd.machines.new("m", timeout=60)
    for bad in (0, -5, models.MAX_TIMEOUT + 1, 2.5):
        with pytest.raises(errors.InvalidRequest):
            boxd.machines.set_timeout("m", bad)
        resp = boxd._client().post("/v1/machines/m/timeout", json={"timeout": bad})
        assert resp.status_code == 400, resp.text
    assert boxd.machines.get("m").end_at == m.end_at
    with pytest.raises(errors.MachineNotFound):
        boxd.machines.set_timeout("nope", 10)


# ------------------------------------------------------------------- new, fork, set


def test_new_shows_its_end_and_a_machine_without_one_has_none(boxd: Boxd, clock: Clock) -> None:
    m = boxd.machines.new("m", timeout=90)
    assert m.end_at is not None and m.end_at.tzinfo is not None
    assert m.end_at.timestamp() == pytest.approx(clock.now + 90, abs=0.01)
    assert m.on_timeout == "delete"
    h = boxd.machines.new("h", timeout=30, on_timeout="hibernate")
    assert h.on_timeout == "hibernate"
    plain = boxd.machines.new("plain")
    assert plain.end_at is None and plain.on_timeout is None
    raw = boxd._client().get("/v1/machines/m").json()
    assert datetime.fromisoformat(raw["end_at"]) == m.end_at  # ISO 8601 with a zone


def test_a_fork_has_its_own_timeout_never_its_source(boxd: Boxd, clock: Clock) -> None:
    boxd.machines.new("base", timeout=1000)
    boxd.machines.wait_until_ready("base")
    plain = boxd.machines.fork("base", "plain")
    assert plain.end_at is None
    own = boxd.machines.fork("base", "own", timeout=20, on_timeout="hibernate")
    assert own.end_at is not None and own.on_timeout == "hibernate"
    assert own.end_at.timestamp() == pytest.approx(clock.now + 20, abs=0.01)
    kids = boxd.machines.fork("base", count=2, timeout=7)
    assert all(isinstance(k, models.Machine) and k.end_at is not None
               and k.end_at.timestamp() == pytest.approx(clock.now + 7, abs=0.01)
               for k in kids)
    with pytest.raises(errors.InvalidRequest):
        boxd.machines.fork("base", "bad", timeout=0)
    assert "bad" not in [m.name for m in boxd.machines.list()]


def test_set_timeout_extends_shortens_and_clears(
    boxd: Boxd, world: World, transport: support.SyncASGITransport, clock: Clock,
) -> None:
    boxd.machines.new("m", timeout=10, on_timeout="hibernate")
    m = boxd.machines.set_timeout("m", 100)  # extend: counted from now
    assert m.end_at is not None and m.on_timeout == "hibernate"  # the action is kept
    assert m.end_at.timestamp() == pytest.approx(clock.now + 100, abs=0.01)
    clock.now += 50
    reap(transport, world)
    assert names(world) == ["m"]  # past its first end, before its new one
    m = boxd.machines.set_timeout("m", 5, on_timeout="delete")  # shorten
    assert m.end_at is not None and m.on_timeout == "delete"
    cleared = boxd.machines.set_timeout("m", None)
    assert cleared.end_at is None and cleared.on_timeout is None
    clock.now += 10_000
    reap(transport, world)
    assert names(world) == ["m"]  # no lifetime: it stays
    boxd.machines.set_timeout("m", 5)
    clock.now += 6
    reap(transport, world)
    assert names(world) == []


# ------------------------------------------------------------------- the reaper


def test_a_machine_is_deleted_at_its_end_not_before(
    boxd: Boxd, world: World, transport: support.SyncASGITransport, clock: Clock,
) -> None:
    m = boxd.machines.new("m", timeout=10)
    boxd.machines.new("keep")
    boxd.machines.wait_until_ready("m")
    vm = world.repos.machines.get(m.id)
    assert vm is not None
    clock.now += 9
    delay = reap(transport, world)
    assert names(world) == ["m", "keep"]
    assert 0 < delay <= 1.01  # it sleeps until the end, not a fixed tick
    clock.now += 1
    reap(transport, world)
    assert names(world) == ["keep"]
    assert world.repos.machines.get(m.id) is None  # the record and the VM are gone
    assert vm.vm_id not in world.engine.running
    with pytest.raises(errors.MachineNotFound):
        boxd.machines.get("m")
    assert reap(transport, world) == lifetimes.MAX_SLEEP  # nothing left to end


def test_hibernate_at_the_end_then_wake_without_a_lifetime(
    boxd: Boxd, world: World, transport: support.SyncASGITransport, clock: Clock,
) -> None:
    boxd.machines.new("m", timeout=5, on_timeout="hibernate")
    boxd.machines.wait_until_ready("m")
    clock.now += 5
    reap(transport, world)
    m = boxd.machines.get("m")
    assert m.state == MachineState.HIBERNATED
    assert m.end_at is None and m.on_timeout is None  # its lifetime is over
    assert boxd.machines.exec("m", "echo hi").exit_code == 0  # a request wakes it
    assert boxd.machines.get("m").state == MachineState.RUNNING
    clock.now += 1000
    reap(transport, world)
    assert boxd.machines.get("m").state == MachineState.RUNNING


def test_an_end_that_passes_during_the_create_waits_for_the_create_to_return(
    boxd: Boxd, world: World, transport: support.SyncASGITransport, clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A boot longer than the lifetime: the create still returns its machine (not a
    404), and the machine is ended right after."""
    real_create, real_fork = world.node.create, world.node.fork
    seen: list[int] = []

    async def create(machine_id: str, source: Any) -> None:
        await real_create(machine_id, source)
        clock.now += 10  # the boot took longer than the lifetime
        await world.machines.lifetimes.reaper.run_once()
        seen.append(len(names(world)))

    async def fork(src: str, ids: list[str]) -> Any:
        out = await real_fork(src, ids)
        clock.now += 10
        await world.machines.lifetimes.reaper.run_once()
        seen.append(len(names(world)))
        return out

    monkeypatch.setattr(world.node, "create", create)
    m = boxd.machines.new("m", timeout=5)
    assert m.name == "m" and seen == [1]  # not ended during its create
    reap(transport, world)
    assert names(world) == []  # ended once it returned
    boxd.machines.new("base")
    boxd.machines.wait_until_ready("base")
    monkeypatch.setattr(world.node, "fork", fork)
    kids = boxd.machines.fork("base", count=2, timeout=5)
    assert all(isinstance(k, models.Machine) for k in kids) and seen == [1, 1, 3]
    reap(transport, world)
    assert names(world) == ["base"]


def test_a_failing_end_is_logged_retried_with_backoff_and_stops_nothing_else(
    boxd: Boxd, world: World, transport: support.SyncASGITransport, clock: Clock,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    bad = boxd.machines.new("bad", timeout=5)
    boxd.machines.new("good", timeout=5)
    real_delete = world.node.delete
    broken = True

    async def delete(machine_id: str) -> None:
        if machine_id == bad.id and broken:
            raise errors.InternalError("the engine is stuck")
        await real_delete(machine_id)

    monkeypatch.setattr(world.node, "delete", delete)
    clock.now += 5
    with caplog.at_level("WARNING", logger="boxd.control"):
        reap(transport, world)
    assert names(world) == ["bad"]  # the other one ended
    assert world.machines.lifetimes.reaper.failing == {bad.id: 1}
    assert any("lifetime_end_failed" in r.message and bad.id in r.message
               for r in caplog.records)
    delay = reap(transport, world)  # before its backoff: not tried again
    assert world.machines.lifetimes.reaper.failing == {bad.id: 1} and 0 < delay <= 1.0
    clock.now += 1
    reap(transport, world)
    assert world.machines.lifetimes.reaper.failing == {bad.id: 2}  # tried again, failed again
    clock.now += 2
    broken = False
    reap(transport, world)
    assert names(world) == [] and world.machines.lifetimes.reaper.failing == {}


def test_a_machine_deleted_by_hand_is_gone_from_the_reaper(
    boxd: Boxd, world: World, transport: support.SyncASGITransport, clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = boxd.machines.new("m", timeout=5)
    calls: list[str] = []
    real = world.machines.lifetimes.end_of_life

    async def end(rec: Any) -> None:
        calls.append(rec.id)
        await real(rec)

    monkeypatch.setattr(world.machines.lifetimes.reaper, "_end", end)
    boxd.machines.delete("m")
    clock.now += 10
    assert reap(transport, world) == lifetimes.MAX_SLEEP
    assert calls == [] and world.repos.machines.get(m.id) is None


def test_many_due_machines_end_a_batch_at_a_time(
    boxd: Boxd, world: World, transport: support.SyncASGITransport, clock: Clock,
) -> None:
    world.machines.lifetimes.reaper._batch = 3
    for i in range(7):
        boxd.machines.new(f"m{i}", timeout=1 + i)
    clock.now += 100
    assert reap(transport, world) == 0.0  # a full batch: look again at once
    assert len(names(world)) == 4
    reap(transport, world)
    assert names(world) == ["m6"]  # earliest ends first
    assert reap(transport, world) > 0
    assert names(world) == []


def test_deadlines_survive_a_restart_and_past_ones_end_at_once(
    boxd: Boxd, world: World, transport: support.SyncASGITransport, clock: Clock,
) -> None:
    soon = boxd.machines.new("soon", timeout=5)
    later = boxd.machines.new("later", timeout=500)
    world.restart()  # a new node runtime on the same records
    reopened = Repos(Database(world.paths.db))  # and a new connection to the file
    try:
        recs = {r.name: r for r in reopened.machines.list(ACCOUNT)}
        assert soon.end_at is not None and later.end_at is not None
        assert recs["soon"].end_at == pytest.approx(soon.end_at.timestamp())
        assert recs["later"].end_at == pytest.approx(later.end_at.timestamp())
        assert [r.name for r in reopened.machines.due(clock.now + 10, 10)] == ["soon"]
    finally:
        reopened.db.close()
    clock.now += 10  # the daemon was down past the first end
    transport.run(world.machines.recover())  # starts the reaper: ends it at once
    deadline = time.monotonic() + 5
    while "soon" in names(world):
        assert time.monotonic() < deadline, "a past end was not ended at start"
        time.sleep(0.02)
    assert names(world) == ["later"]
    transport.run(world.machines.close())


def test_the_loop_ends_a_machine_on_time_with_the_real_clock(
    boxd: Boxd, world: World, transport: support.SyncASGITransport,
) -> None:
    world.machines.lifetimes.reaper.clock = time.time
    transport.run(_start(world))
    try:
        boxd.machines.new("idle")  # no lifetime: the loop sleeps
        started = time.monotonic()
        boxd.machines.new("m", timeout=1)  # the new end wakes the loop
        while "m" in names(world):
            assert time.monotonic() - started < 4, "not ended on time"
            time.sleep(0.02)
        assert time.monotonic() - started >= 0.9
    finally:
        transport.run(world.machines.lifetimes.reaper.stop())


async def _start(world: World) -> None:
    world.machines.lifetimes.reaper.start()


def test_the_loop_survives_a_broken_table(
    world: World, transport: support.SyncASGITransport, monkeypatch: pytest.MonkeyPatch,
) -> None:
    failures = []

    def due(now: float, limit: int) -> list[Any]:
        failures.append(now)
        raise errors.InternalError("state query failed: disk I/O error")

    monkeypatch.setattr(world.repos.machines, "due", due)
    monkeypatch.setattr(lifetimes, "MAX_SLEEP", 0.05)
    transport.run(_start(world))
    deadline = time.monotonic() + 5
    while len(failures) < 3:
        assert time.monotonic() < deadline, "the loop died on the first failure"
        time.sleep(0.02)
    task = world.machines.lifetimes.reaper._task
    assert task is not None and not task.done()
    transport.run(world.machines.lifetimes.reaper.stop())


# ------------------------------------------------------------------- CLI


def _cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def test_cli_new_fork_and_set_timeout(daemon: Daemon) -> None:
    code, out, _ = _cli("machine", "new", "a", "--timeout", "10m", "--on-timeout",
                        "hibernate", "--json")
    assert code == 0, out
    m = json.loads(out)
    assert m["on_timeout"] == "hibernate"
    left = datetime.fromisoformat(m["end_at"]).timestamp() - time.time()
    assert 590 < left <= 600
    assert "hibernate" in _cli("machine", "info", "a")[1]
    assert _cli("machine", "new", "b", "--timeout", "0")[0] == 2  # refused by click
    assert _cli("machine", "new", "b", "--timeout", "31d")[0] == 2
    code, out, _ = _cli("machine", "set-timeout", "a", "90", "--json")
    assert code == 0
    m = json.loads(out)
    assert m["on_timeout"] == "hibernate"
    assert 85 < datetime.fromisoformat(m["end_at"]).timestamp() - time.time() <= 90
    code, out, _ = _cli("machine", "set-timeout", "a", "--clear", "--json")
    assert code == 0 and json.loads(out)["end_at"] is None
    assert _cli("machine", "set-timeout", "a")[0] == 2  # neither a duration nor --clear
    code, out, _ = _cli("machine", "fork", "a", "kid", "--timeout", "30", "--json")
    assert code == 0, out
    assert json.loads(out)["name"] == "kid"


def test_end_at_renders_in_utc() -> None:
    m = models.Machine(id="m_1", name="m", state=MachineState.RUNNING, vcpus=1,
                       memory_mib=1024, disk_gib=8, isolated=False, created_at=0,
                       end_at=datetime(2026, 12, 5, 14, 0, tzinfo=UTC), on_timeout="delete")
    assert json.loads(m.model_dump_json())["end_at"].startswith("2026-12-05T14:00:00")
