"""Durable exec (issue 42, item 5): every exec has an id, runs in a task of the node's
(a caller that goes away does not end it) and its output and exit are read by that id
(`machines.exec_result`, ``GET /v1/machines/{id}/execs/{exec_id}``, `boxd machine
exec-result`), kept a bounded time, count and size, in memory and on disk (read again
after a daemon restart).

The SDK talks in process to the real FastAPI app on the real control plane, node
runtime and SQLite state over the fake engine (tests/_support/fake_world.py), whose
``exec`` step can be held (`FakeEngine.gate`) to keep an exec running.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World, running

from boxd import AsyncBoxd, Boxd, errors, models
from boxd.api.server import Daemon
from boxd.cli import main
from boxd.engine.base import ExecExit
from boxd.node._exec_records import ExecRecord, ExecRecords
from boxd.storage.execs import ExecFiles

paths = support.paths  # fixtures
no_daemon = support.no_daemon
daemon = support.daemon


world = support.world  # fixture


transport = support.transport  # fixture: the app over world, keyed


@pytest.fixture
def boxd(transport: support.SyncASGITransport) -> Iterator[Boxd]:
    with Boxd(api_key=transport.key, transport=transport) as b:  # type: ignore[attr-defined]
        yield b


class Held:
    """The next exec held in the fake engine until `release`."""

    def __init__(self, world: World, transport: support.SyncASGITransport) -> None:
        self._t = transport

        async def gate() -> tuple[asyncio.Event, asyncio.Event]:
            return world.engine.gate("exec")

        self.reached, self.release_event = transport.run(gate())

    def wait_reached(self) -> None:
        async def wait() -> None:
            await asyncio.wait_for(self.reached.wait(), 10)

        self._t.run(wait())

    def release(self) -> None:
        self._t.loop.call_soon_threadsafe(self.release_event.set)


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception as exc:
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


# ------------------------------------------------------------------ ids and results


def test_an_exec_is_read_again_by_its_id(boxd: Boxd) -> None:
    boxd.machines.new("m")
    res = boxd.machines.exec("m", "echo hi", exec_id="job-1")
    assert res.exec_id == "job-1" and res.stdout == "hi\n"
    st = boxd.machines.exec_result("m", "job-1")
    assert not st.running and st.exec_id == "job-1"
    assert (st.stdout, st.exit_code, st.timed_out, st.error) == ("hi\n", 0, False, None)
    assert st.duration is not None and st.started_at <= time.time()
    # Without an id, one is generated and returned.
    other = boxd.machines.exec("m", "echo two")
    assert other.exec_id and other.exec_id != "job-1"
    assert boxd.machines.exec_result("m", other.exec_id).stdout == "two\n"


def test_an_unknown_or_malformed_exec_id_is_a_typed_error(boxd: Boxd) -> None:
    boxd.machines.new("m")
    with pytest.raises(errors.ExecNotFound) as err:
        boxd.machines.exec_result("m", "nope")
    assert err.value.status == 404 and "nope" in err.value.message and err.value.hint
    with pytest.raises(errors.MachineNotFound):
        boxd.machines.exec_result("other", "nope")
    with pytest.raises(errors.InvalidRequest):
        boxd.machines.exec("m", "echo hi", exec_id="two words")
    with pytest.raises(errors.InvalidRequest):
        boxd.machines.exec("m", "echo hi", exec_id="x" * 129)


def test_a_running_exec_is_reported_running_then_finished(
    world: World, transport: support.SyncASGITransport, boxd: Boxd
) -> None:
    boxd.machines.new("m")
    held = Held(world, transport)
    thread, box = _in_thread(lambda: boxd.machines.exec("m", "echo late", exec_id="slow"))
    held.wait_reached()
    st = boxd.machines.exec_result("m", "slow", wait=0)
    assert st.running and st.exit_code is None and st.duration is None
    start = time.monotonic()
    st = boxd.machines.exec_result("m", "slow", wait=0.3)  # waits, then says it still runs
    assert st.running and time.monotonic() - start >= 0.3
    threading.Timer(0.2, held.release).start()
    st = boxd.machines.exec_result("m", "slow", wait=10)  # returns when it ends
    assert not st.running and st.stdout == "late\n" and st.exit_code == 0
    thread.join(10)
    assert isinstance(box[0], models.ExecResult) and box[0].stdout == "late\n"


def test_an_exec_outlives_its_caller(world: World, transport: support.SyncASGITransport,
                                     boxd: Boxd) -> None:
    """The request's task is cancelled (what a dropped connection does to it): the
    command runs on and its result is read by its id."""
    m = boxd.machines.new("m")
    held = Held(world, transport)

    async def start() -> asyncio.Task[models.ExecResult]:
        return asyncio.create_task(world.machines.exec(
            ACCOUNT, m.id, models.ExecRequest(command="echo survived", exec_id="e1")))

    task = transport.run(start())
    held.wait_reached()

    async def cancel() -> None:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    transport.run(cancel())
    assert boxd.machines.exec_result("m", "e1").running
    held.release()
    st = boxd.machines.exec_result("m", "e1", wait=10)
    assert not st.running and st.stdout == "survived\n" and st.exit_code == 0


def test_a_repeated_exec_id_waits_for_the_first_and_another_command_conflicts(
    world: World, transport: support.SyncASGITransport, boxd: Boxd
) -> None:
    boxd.machines.new("m")
    held = Held(world, transport)
    first, box1 = _in_thread(lambda: boxd.machines.exec("m", "echo once", exec_id="j"))
    held.wait_reached()
    with pytest.raises(errors.ExecIdConflict) as err:
        boxd.machines.exec("m", "echo other", exec_id="j")
    assert err.value.status == 409 and "j" in err.value.message
    again, box2 = _in_thread(lambda: boxd.machines.exec("m", "echo once", exec_id="j"))
    time.sleep(0.2)
    assert again.is_alive()  # waiting for the first, not running it again
    held.release()
    first.join(10)
    again.join(10)
    assert box1[0].stdout == box2[0].stdout == "once\n"
    assert world.engine.calls.count("exec") == 1  # the command ran once
    # Finished and kept: a retry gets the same result, without running it.
    assert boxd.machines.exec("m", "echo once", exec_id="j").stdout == "once\n"
    assert world.engine.calls.count("exec") == 1


def test_an_exec_that_fails_is_kept_with_its_error(
    world: World, transport: support.SyncASGITransport, boxd: Boxd
) -> None:
    boxd.machines.new("m")
    world.engine.fail("exec", errors.MachineFailed("the VM died", machine="m"))
    with pytest.raises(errors.MachineFailed):
        boxd.machines.exec("m", "echo x", exec_id="broken")
    # It failed before its command said anything: not kept, so a retry runs it.
    with pytest.raises(errors.ExecNotFound):
        boxd.machines.exec_result("m", "broken")
    assert boxd.machines.exec("m", "echo x", exec_id="broken").stdout == "x\n"


def test_a_deleted_machine_takes_its_exec_results(boxd: Boxd, world: World) -> None:
    m = boxd.machines.new("m")
    boxd.machines.exec("m", "echo hi", exec_id="k")
    boxd.machines.delete("m")
    assert world.node.execs.records.get(m.id, "k") is None


def test_the_http_route(boxd: Boxd, transport: support.SyncASGITransport) -> None:
    boxd.machines.new("m")
    boxd.machines.exec("m", ["echo", "via", "http"], exec_id="h.1")
    import httpx

    with httpx.Client(transport=transport, base_url="http://boxd") as http:
        headers = {"Authorization": f"Bearer {transport.key}"}  # type: ignore[attr-defined]
        r = http.get("/v1/machines/m/execs/h.1?wait=1", headers=headers)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["exec_id"] == "h.1" and body["stdout"] == "via http\n"
        assert body["running"] is False and body["exit_code"] == 0
        r = http.get("/v1/machines/m/execs/missing", headers=headers)
        assert r.status_code == 404 and r.json()["error"]["code"] == "exec_not_found"
        r = http.get("/v1/machines/m/execs/h.1?wait=601", headers=headers)
        assert r.status_code == 400


def test_the_async_client(world: World, tmp_path: Path) -> None:
    import httpx

    app, keys = support.world_app(world, tmp_path)
    key = keys.create(ACCOUNT, "async").secret

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with AsyncBoxd(api_key=key, transport=transport) as b:
            await b.machines.new("a")
            res = await b.machines.exec("a", "echo async", exec_id="as-1")
            assert res.exec_id == "as-1"
            st = await b.machines.exec_result("a", "as-1", wait=1)
            assert (st.running, st.stdout, st.exit_code) == (False, "async\n", 0)
            with pytest.raises(errors.ExecNotFound):
                await b.machines.exec_result("a", "as-2")

    asyncio.run(run())


# ------------------------------------------------------------------------ bounds


def _finished(records: ExecRecords, machine: str, exec_id: str, out: bytes = b"") -> ExecRecord:
    rec = ExecRecord(exec_id, machine, models.ExecRequest(command="x"))
    rec.output("stdout", out)
    records.add(rec)
    rec.finish(ExecExit(exit_code=0, signal=None, timed_out=False, duration=0.0), None)
    return rec


def test_a_record_keeps_the_last_of_each_stream() -> None:
    rec = ExecRecord("a", "m", models.ExecRequest(command="x"), kept=10)
    rec.output("stdout", b"0123456789")
    assert not rec.status().stdout_truncated
    rec.output("stdout", b"abc")
    rec.output("stderr", b"err")
    st = rec.status()
    assert st.running and st.stdout == "3456789abc" and st.stdout_truncated
    assert st.stderr == "err" and not st.stderr_truncated


def test_records_are_bounded_in_count_time_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    records = ExecRecords(per_machine=3, keep_seconds=60, total=100)
    running = ExecRecord("run", "m", models.ExecRequest(command="x"))
    records.add(running)
    for i in range(5):
        _finished(records, "m", f"f{i}")
    # The oldest finished ones go; a running one stays whatever the count.
    assert records.get("m", "run") is running
    assert [i for i in range(5) if records.get("m", f"f{i}")] == [3, 4]
    # Past their time.
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 61)
    assert records.get("m", "f4") is None and records.get("m", "run") is running
    monkeypatch.undo()
    # Past the node's bytes: the oldest finished go first, across machines.
    for i, machine in enumerate(("a", "b", "c")):
        _finished(records, machine, f"big{i}", b"x" * 40)
    assert records.get("a", "big0") is None
    assert records.get("b", "big1") is not None and records.get("c", "big2") is not None


# --------------------------------------------------------------------------- CLI


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_cli_exec_with_an_id_and_exec_result(daemon: Daemon) -> None:
    """Over a real daemon on the API's fake services (tests/_support/api_fakes.py)."""
    with Boxd() as b:
        b.machines.new("c")
    r = _cli("machine", "exec", "--id", "cli-1", "c", "--", "echo", "from-cli")
    assert r.exit_code == 0, r.output
    assert r.stdout == "echo from-cli\n"  # the fake services answer with the command
    r = _cli("machine", "exec-result", "c", "cli-1")
    assert r.exit_code == 0 and r.stdout == "echo from-cli\n", r.output
    r = _cli("machine", "exec-result", "--json", "c", "cli-1")
    assert json.loads(r.stdout)["exec_id"] == "cli-1"
    r = _cli("machine", "exec-result", "c", "nope")
    assert r.exit_code == 1 and "no exec 'nope'" in r.stderr


# ------------------------------------------------- on disk, across a daemon restart


def _req(command: str, exec_id: str) -> models.ExecRequest:
    return models.ExecRequest(command=command, exec_id=exec_id)


def test_finished_exec_results_are_read_after_a_daemon_restart(world: World) -> None:
    async def run() -> None:
        m = await running(world, "m")
        first = await world.machines.exec(ACCOUNT, m.id, _req("echo kept", "k1"))
        world.engine.fail("exec", errors.MachineFailed("the VM died", machine="m"))
        with pytest.raises(errors.MachineFailed):
            await world.machines.exec(ACCOUNT, m.id, _req("echo x", "broken"))
        ran = world.engine.calls.count("exec")
        node = world.restart()  # a new node runtime: nothing of the old one's memory
        assert node.execs.records.get(m.id, "k1") is None
        await node.recover()
        st = await world.machines.exec_result(ACCOUNT, m.id, "k1")
        assert (st.running, st.stdout, st.exit_code, st.error) == (False, "kept\n", 0, None)
        assert st.duration == first.duration and st.started_at <= time.time()
        # The same id again: the kept result, the command not run again.
        again = await world.machines.exec(ACCOUNT, m.id, _req("echo kept", "k1"))
        assert again.stdout == "kept\n" and world.engine.calls.count("exec") == ran
        with pytest.raises(errors.ExecIdConflict):
            await world.machines.exec(ACCOUNT, m.id, _req("echo other", "k1"))
        # Failed before it said anything: not kept there, not kept here.
        with pytest.raises(errors.ExecNotFound):
            await world.machines.exec_result(ACCOUNT, m.id, "broken")

    asyncio.run(run())


def test_an_exec_running_when_the_daemon_died_answers_agent_lost(world: World) -> None:
    async def run() -> None:
        m = await running(world, "m")
        reached, release = world.engine.gate("exec")
        old = asyncio.create_task(world.machines.exec(ACCOUNT, m.id, _req("echo x", "cut")))
        await reached.wait()
        for _ in range(2):  # and a second restart says the same
            node = world.restart()
            await node.recover()
            st = await world.machines.exec_result(ACCOUNT, m.id, "cut", wait=5)
            assert not st.running and st.exit_code is None and st.error is not None
            assert st.error.code == "agent_lost" and "daemon restarted" in st.error.message
            with pytest.raises(errors.AgentLost) as err:  # its retry is not run blindly
                await world.machines.exec(ACCOUNT, m.id, _req("echo x", "cut"))
            assert isinstance(err.value, errors.InfrastructureError)
            assert err.value.details["exec_id"] == "cut"
        release.set()  # the old runtime's exec (a real kill leaves none)
        await old

    asyncio.run(run())


def test_an_exec_whose_task_the_daemons_stop_cancels_answers_agent_lost(
    world: World,
) -> None:
    """A stop cancels the exec tasks left (as asyncio.run does at its end): the exec is
    kept with `AgentLost`, even before the command said anything, as after a kill."""
    async def run() -> None:
        m = await running(world, "m")
        reached, _release = world.engine.gate("exec")
        call = asyncio.create_task(world.machines.exec(ACCOUNT, m.id, _req("sleep 9", "stop")))
        await reached.wait()
        (task,) = world.node.execs._tasks
        task.cancel()
        with pytest.raises(asyncio.CancelledError):  # (its caller is being stopped too)
            await call
        for _ in range(2):  # this daemon, then the next
            st = await world.machines.exec_result(ACCOUNT, m.id, "stop")
            assert st.error is not None and st.error.code == "agent_lost", st
            assert "daemon stopped" in st.error.message
            await world.restart().recover()

    asyncio.run(run())


def test_an_exec_the_daemons_stop_cuts_off_is_kept_as_agent_lost(world: World) -> None:
    """A stopping node detaches the agents: an exec failing then (before its command said
    anything) is not a failure a retry should run again."""
    async def run() -> None:
        m = await running(world, "m")
        world.node.execs.stopping = True  # what NodeRuntime.close sets first
        world.engine.fail("exec", errors.AgentLost("the agent's channel closed", machine="m"))
        with pytest.raises(errors.AgentLost):  # its caller hears what broke
            await world.machines.exec(ACCOUNT, m.id, _req("sleep 9", "cut"))
        st = await world.machines.exec_result(ACCOUNT, m.id, "cut")
        assert st.error is not None and "daemon stopped" in st.error.message, st

    asyncio.run(run())


def test_exec_record_files_are_private_whole_and_go_with_their_machine(world: World) -> None:
    root = world.paths.execs

    async def run() -> str:
        m = await running(world, "m")
        await world.machines.exec(ACCOUNT, m.id, _req("echo a", "a"))
        return m.id

    mid = asyncio.run(run())
    assert root.stat().st_mode & 0o777 == 0o700
    assert (root / mid).stat().st_mode & 0o777 == 0o700
    assert [p.name for p in (root / mid).iterdir()] == ["a.json"]  # no temporary file left
    assert (root / mid / "a.json").stat().st_mode & 0o777 == 0o600
    # What a kill mid-write or a host crash leaves, and records of a machine gone.
    (root / mid / ".b.json.1234.tmp").write_text('{"half')
    (root / mid / "c.json").write_text('{"half')
    (root / "m-gone").mkdir()
    (root / "m-gone" / "d.json").write_bytes((root / mid / "a.json").read_bytes())

    async def restart() -> None:
        await world.restart().recover()
        assert (await world.machines.exec_result(ACCOUNT, mid, "a")).stdout == "a\n"
        with pytest.raises(errors.ExecNotFound):
            await world.machines.exec_result(ACCOUNT, mid, "c")
        assert sorted(p.name for p in root.iterdir()) == [mid]
        assert [p.name for p in (root / mid).iterdir()] == ["a.json"]
        await world.machines.delete(ACCOUNT, mid)
        assert not (root / mid).exists()

    asyncio.run(restart())


def _ended(records: ExecRecords, machine: str, exec_id: str, out: bytes = b"") -> ExecRecord:
    rec = ExecRecord(exec_id, machine, models.ExecRequest(command="x"))
    records.add(rec)
    rec.output("stdout", out)
    rec.finish(ExecExit(exit_code=0, signal=None, timed_out=False, duration=0.0), None)
    asyncio.run(records.finished(rec))
    return rec


def test_records_on_disk_have_the_bounds_of_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = ExecFiles(tmp_path / "execs")

    def on_disk() -> set[str]:
        return {f"{p.parent.name}/{p.stem}" for p in files.root.glob("*/*.json")}

    records = ExecRecords(per_machine=2, keep_seconds=60, total=100, files=files)
    running_one = ExecRecord("run", "m", models.ExecRequest(command="x"))
    records.add(running_one)
    assert on_disk() == {"m/run"}
    for i in range(3):
        _ended(records, "m", f"f{i}")
    assert on_disk() == {"m/run", "m/f2"}  # per machine (the running one stays)
    for i, machine in enumerate(("a", "b", "c")):
        _ended(records, machine, f"big{i}", b"x" * 40)
    # The node's bytes: the oldest finished go first (f2 with them).
    assert on_disk() == {"m/run", "b/big1", "c/big2"}
    # A new daemon's records: the same, bounded the same; one past its time is dropped.
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 30)
    later = ExecRecords(per_machine=2, keep_seconds=60, total=100, files=files)
    asyncio.run(later.load(lambda mid: None if mid == "c" else mid))
    assert on_disk() == {"m/run", "b/big1"}  # machine c is gone
    assert later.get("b", "big1") is not None and later.get("b", "big1").stdout.text() == "x" * 40  # type: ignore[union-attr]
    st = later.find("m", "m", "run").status()
    assert st.error is not None and st.error.code == "agent_lost"
    monkeypatch.setattr(time, "time", lambda: now + 61)
    asyncio.run(ExecRecords(keep_seconds=60, files=files).load(lambda mid: mid))
    assert on_disk() == {"m/run"}  # finished at the first load: its time runs from then


def test_a_record_that_cannot_be_written_is_not_run(tmp_path: Path) -> None:
    (tmp_path / "execs").write_text("a file where the folder should be")
    records = ExecRecords(files=ExecFiles(tmp_path / "execs"))
    with pytest.raises(errors.InternalError):
        records.add(ExecRecord("x", "m", models.ExecRequest(command="x")))
    assert records.get("m", "x") is None


def test_a_large_record_is_written_off_the_loop_and_not_left_behind_when_dropped(
    tmp_path: Path,
) -> None:
    files = ExecFiles(tmp_path / "execs")
    big = b"y" * (200 << 10)  # past the size written on the event loop

    def ended(records: ExecRecords, exec_id: str) -> ExecRecord:
        rec = ExecRecord(exec_id, "m", models.ExecRequest(command="x"))
        records.add(rec)
        rec.output("stdout", big)
        rec.finish(ExecExit(exit_code=0, signal=None, timed_out=False, duration=0.0), None)
        return rec

    async def run() -> None:
        records = ExecRecords(files=files)
        await records.finished(ended(records, "big"))
        later = ExecRecords(files=files)
        await later.load(lambda mid: mid)
        assert later.find("m", "m", "big").status().stdout == big.decode()
        # Its machine deleted while its file is written: no file comes back.
        task = asyncio.create_task(records.finished(ended(records, "gone")))
        await asyncio.sleep(0)  # it is in its thread
        records.forget("m")
        await task
        assert not (files.root / "m").exists()
        # Dropped, and a new exec of the same id started, while it is written: the new
        # one's record is what the file says.
        old = ended(records, "again")
        task = asyncio.create_task(records.finished(old))
        await asyncio.sleep(0)
        records.drop(old)
        records.add(new := ExecRecord("again", "m", models.ExecRequest(command="x")))
        await task
        assert json.loads((files.root / "m" / "again.json").read_text())["finished_at"] is None
        assert records.get("m", "again") is new

    asyncio.run(run())
