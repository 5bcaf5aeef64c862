"""A machine's recent execs (issue 43): `machines.execs`, ``GET /v1/machines/{id}/execs``,
newest first, without output, the last few of what the node keeps (durable exec).

As in test_durable_exec.py, the SDK talks in process to the real FastAPI app on the
real control plane, node runtime and SQLite state over the fake engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World

from boxd import AsyncBoxd, Boxd, errors, models
from boxd.node._exec_records import ExecRecord, ExecRecords, shown_command

paths = support.paths  # fixtures
no_daemon = support.no_daemon
world = support.world


transport = support.transport  # fixture: the app over world, keyed


@pytest.fixture
def boxd(transport: support.SyncASGITransport) -> Iterator[Boxd]:
    with Boxd(api_key=transport.key, transport=transport) as b:  # type: ignore[attr-defined]
        yield b


def test_execs_are_listed_newest_first_with_their_exit(boxd: Boxd) -> None:
    boxd.machines.new("m")
    boxd.machines.new("other")
    assert boxd.machines.execs("m") == []
    boxd.machines.exec("m", "echo one", exec_id="e1")
    boxd.machines.exec("m", ["cat", "/no such file"], exec_id="e2")  # exits 1
    boxd.machines.exec("other", "echo elsewhere")
    listed = boxd.machines.execs("m")
    assert [e.exec_id for e in listed] == ["e2", "e1"]
    e2, e1 = listed
    assert (e2.command, e2.exit_code, e2.running) == ("cat '/no such file'", 1, False)
    assert (e1.command, e1.exit_code, e1.error) == ("echo one", 0, None)
    assert e1.duration is not None and e1.started_at <= e2.started_at
    assert not hasattr(e1, "stdout")  # a listing carries no output
    assert [e.exec_id for e in boxd.machines.execs("m", limit=1)] == ["e2"]


def test_a_running_exec_is_listed_running(
    world: World, transport: support.SyncASGITransport, boxd: Boxd
) -> None:
    boxd.machines.new("m")

    async def gate() -> tuple[asyncio.Event, asyncio.Event]:
        return world.engine.gate("exec")

    reached, release = transport.run(gate())
    thread = threading.Thread(target=lambda: boxd.machines.exec("m", "echo late",
                                                                exec_id="slow"))
    thread.start()
    transport.run(asyncio.wait_for(reached.wait(), 10))
    [st] = boxd.machines.execs("m")
    assert st.running and st.exit_code is None and st.duration is None
    transport.loop.call_soon_threadsafe(release.set)
    thread.join(10)
    [st] = boxd.machines.execs("m")
    assert not st.running and st.exit_code == 0


def test_bad_limits_and_other_accounts(boxd: Boxd, transport: support.SyncASGITransport,
                                       ) -> None:
    boxd.machines.new("m")
    for limit in (0, models.MAX_EXEC_LIST + 1):
        with pytest.raises(errors.InvalidRequest):
            boxd.machines.execs("m", limit=limit)
    with pytest.raises(errors.MachineNotFound):
        boxd.machines.execs("missing")
    boxd.machines.exec("m", "echo hi", exec_id="h")
    with httpx.Client(transport=transport, base_url="http://boxd") as http:
        r = http.get("/v1/machines/m/execs?limit=5",
                     headers={"Authorization": f"Bearer {transport.key}"})  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        [item] = r.json()["execs"]
        assert item["exec_id"] == "h" and item["command"] == "echo hi"
        assert "stdout" not in item
        assert http.get("/v1/machines/m/execs").status_code == 401


def test_the_async_client(world: World, tmp_path: Path) -> None:
    app, keys = support.world_app(world, tmp_path)
    key = keys.create(ACCOUNT, "async").secret

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with AsyncBoxd(api_key=key, transport=transport) as b:
            await b.machines.new("a")
            await b.machines.exec("a", "echo async", exec_id="as-1")
            assert [e.exec_id for e in await b.machines.execs("a")] == ["as-1"]

    asyncio.run(run())


def test_a_command_is_shown_quoted_and_cut() -> None:
    assert shown_command("echo 'a b' | wc") == "echo 'a b' | wc"
    assert shown_command(["sh", "-c", "echo hi; exit 3"]) == "sh -c 'echo hi; exit 3'"
    long = shown_command("x" * 600, limit=10)
    assert long == "x" * 9 + "…" and len(long) == 10


def test_recent_records_are_newest_first_and_bounded() -> None:
    records = ExecRecords(per_machine=3)
    for i in range(5):
        records.add(ExecRecord(f"r{i}", "m", models.ExecRequest(command=f"echo {i}")))
    # Running records are never dropped; the listing takes the newest.
    assert [r.exec_id for r in records.recent("m", 2)] == ["r4", "r3"]
    assert [r.exec_id for r in records.recent("m", 10)] == ["r4", "r3", "r2", "r1", "r0"]
    assert records.recent("other", 5) == []


def test_the_sdks_default_is_the_apis() -> None:
    import inspect

    from boxd.sdk._async import AsyncMachines

    # A literal in the SDK: `from boxd import Boxd` loads no models (test_light_client).
    default = inspect.signature(AsyncMachines.execs).parameters["limit"].default
    assert default == models.DEFAULT_EXEC_LIST



def test_cli_machine_execs(transport: support.SyncASGITransport,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from click.testing import CliRunner

    from boxd import cli

    monkeypatch.setattr(cli, "Boxd", lambda **_: Boxd(
        api_key=transport.key, transport=support.KeptTransport(transport)))  # type: ignore[attr-defined]

    def run(*args: str) -> tuple[int, str]:
        r = CliRunner().invoke(cli.main, list(args), catch_exceptions=False)
        return r.exit_code, r.stdout

    assert run("machine", "new", "m", "--no-wait")[0] == 0
    assert run("machine", "execs", "m") == (0, "no execs kept\n")
    assert run("machine", "exec", "m", "--id", "e1", "--", "echo", "one")[0] == 0
    run("machine", "exec", "m", "--id", "e2", "--", "cat", "/no such file")  # exits 1
    code, out = run("machine", "execs", "m")
    assert code == 0 and out.index("e2") < out.index("e1"), out
    assert "echo one" in out and "cat '/no such file'" in out
    code, out = run("machine", "execs", "m", "-n", "1", "--json")
    assert code == 0 and [e["exec_id"] for e in json.loads(out)] == ["e2"]
    assert json.loads(out)[0]["exit_code"] == 1
    assert run("machine", "execs", "m", "-n", "65")[0] == 2
