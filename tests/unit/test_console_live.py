"""The console's live parts over the API tests' fake services (issue 43): the account's
name in the header, a machine's page with its recent execs and processes, its event
stream (state, execs, processes), a process's output stream (what is kept, then each
new bytes; resumed by ``Last-Event-ID``; ended by its exit), and streams that end when
their page closes. The browser tests (tests/integration/test_console.py) drive the same
routes through Chromium against real machines.

The streams are driven at the ASGI level, as uvicorn drives them: the request, then a
disconnect when the page closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from tests._support.api_fakes import FakeMachines, FakeSnapshots

from boxd import models
from boxd import process_models as pm
from boxd.console import live
from boxd.console.app import create_console_app
from boxd.console.sessions import COOKIE, Logins
from boxd.errors import AuthError, NotFound
from boxd.node._processes import OutputLog

pytestmark = pytest.mark.timeout(60)
NAMES = {"alice": "alice-co", "bob": "bob-labs"}


def account_name(account: str) -> str:
    if account not in NAMES:
        raise NotFound(f"no account {account!r}")
    return NAMES[account]


def authenticate(secret: str | None) -> str:
    if secret not in ("alice", "bob", "carol"):
        raise AuthError("unknown API key")
    return secret


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.machines = FakeMachines()
        self.snapshots = FakeSnapshots(self.machines, tmp)
        self.logins = Logins()
        self.app = create_console_app(self.machines, self.snapshots, authenticate,
                                      self.logins, processes=self.machines,
                                      account_name=account_name)
        self.console = self.app.state.console

    def session(self, account: str = "alice") -> str:
        return self.logins.exchange(self.logins.mint(account))[1]

    def client(self, account: str = "alice") -> TestClient:
        c = TestClient(self.app, base_url="http://127.0.0.1:7071")
        c.cookies.set(COOKIE, self.session(account))
        return c


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    monkeypatch.setattr(live, "POLL_SECONDS", 0.02)
    yield Fleet(tmp_path)


class Stream:
    """A page's ``GET`` of a live stream: the body as it comes; `close` disconnects (the
    page closed) and waits for the app to end the response."""

    def __init__(self, fleet: Fleet, path: str, account: str = "alice",
                 headers: dict[str, str] | None = None) -> None:
        cookie = f"{COOKIE}={fleet.session(account)}"
        raw = [(b"host", b"127.0.0.1:7071"), (b"cookie", cookie.encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                      "http_version": "1.1", "method": "GET", "scheme": "http",
                      "path": path, "raw_path": path.encode(), "query_string": b"",
                      "root_path": "", "headers": raw, "client": ("127.0.0.1", 5000),
                      "server": ("127.0.0.1", 7071)}
        self.app = fleet.app
        self.status = 0
        self.body = ""
        self.gone = asyncio.Event()
        self.more = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def _receive(self) -> dict[str, Any]:
        if not hasattr(self, "_sent"):
            self._sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"").decode()
            self.more.set()

    async def __aenter__(self) -> Stream:
        self.task = asyncio.create_task(self.app(self.scope, self._receive, self._send))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def until(self, text: str, timeout: float = 5) -> None:
        async def wait() -> None:
            while text not in self.body:
                self.more.clear()
                await self.more.wait()

        try:
            await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"{text!r} never came; the stream said:\n{self.body}") from None

    async def ended(self, timeout: float = 5) -> None:
        assert self.task is not None
        await asyncio.wait_for(asyncio.shield(self.task), timeout)

    async def close(self) -> None:
        self.gone.set()
        await self.ended()


def test_the_header_names_the_account_on_every_page(fleet: Fleet) -> None:
    m = fleet.machines._add("alice", "web")
    c = fleet.client()
    for path in ("/", "/snapshots", "/reports", f"/machines/{m.id}", "/machines/nope"):
        r = c.get(path)
        assert r.status_code in (200, 404), path
        assert 'account <strong>alice-co</strong>' in r.text, path
    # An account whose name cannot be had shows its id.
    assert "account <strong>carol</strong>" in fleet.client("carol").get("/").text


def test_a_machine_page_lists_its_execs_and_processes(fleet: Fleet) -> None:
    m = fleet.machines._add("alice", "web")

    async def work() -> None:
        await fleet.machines.exec("alice", m.id, models.ExecRequest(command="echo hi"))
        await fleet.machines.spawn("alice", m.id, pm.SpawnRequest(argv=["server", "--port"]))

    asyncio.run(work())
    page = fleet.client().get(f"/machines/{m.id}").text
    assert "<code>echo hi</code>" in page and 'class="exit">0</td>' in page
    assert "server --port: running" in page
    bare = fleet.machines._add("alice", "bare")
    page = fleet.client().get(f"/machines/{bare.id}").text
    assert 'id="execs-empty" >' in page and 'id="output-none" >' in page


def test_the_machine_stream_follows_its_state_execs_and_processes(fleet: Fleet) -> None:
    m = fleet.machines._add("alice", "web")

    async def run() -> None:
        async with Stream(fleet, f"/api/machines/{m.id}/events") as s:
            await s.until('"state": "running"')
            assert s.status == 200 and "event: execs\ndata: []" in s.body
            fleet.machines._set_state("alice", m.id, models.MachineState.SUSPENDED)
            await s.until('"state": "suspended"')
            await fleet.machines.exec("alice", m.id, models.ExecRequest(command="false"))
            await s.until('"command": "false"')
            await fleet.machines.spawn("alice", m.id, pm.SpawnRequest(argv=["srv"]))
            await s.until('"command": "srv"')
            await fleet.machines.delete("alice", m.id)
            await s.until("event: gone")
            await s.ended()  # it ends by itself
        assert fleet.console.streams == 0

    asyncio.run(run())


@contextlib.asynccontextmanager
async def echo(fleet: Fleet, machine_id: str) -> AsyncIterator[tuple[str, Any]]:
    """A fake process whose every message goes to its stderr, and its stream."""
    p = await fleet.machines.spawn("alice", machine_id, pm.SpawnRequest(argv=["echo"]))
    async with fleet.machines.process_attach("alice", machine_id, p.id) as stream:
        yield p.id, stream


def test_the_output_stream_sends_what_is_kept_then_what_comes(fleet: Fleet) -> None:
    m = fleet.machines._add("alice", "web")

    async def run() -> None:
        async with echo(fleet, m.id) as (pid, proc):
            await proc.send(b"before\n")
            url = f"/api/machines/{m.id}/processes/{pid}/output"
            async with Stream(fleet, url) as s:
                await s.until('id: 7\nevent: output\ndata: "before\\n"')
                await proc.send(b"after\n")
                await s.until('id: 13\nevent: output\ndata: "after\\n"')
            # A browser that reconnects resumes after the last id it saw.
            async with Stream(fleet, url, headers={"Last-Event-ID": "7"}) as s:
                await s.until('data: "after\\n"')
                assert "before" not in s.body
                await proc.send(b"exit")
                await s.until('event: end\ndata: {"exit_code": 0}')
                await s.ended()  # it ends by itself once the process exited
        assert fleet.console.streams == 0

    asyncio.run(run())


def test_a_stream_ends_when_its_page_closes(fleet: Fleet) -> None:
    m = fleet.machines._add("alice", "web")

    async def run() -> None:
        async with echo(fleet, m.id) as (pid, proc):
            await proc.send(b"x\n")
            url = f"/api/machines/{m.id}/processes/{pid}/output"
            streams = [Stream(fleet, url), Stream(fleet, f"/api/machines/{m.id}/events"),
                       Stream(fleet, "/api/events")]
            for s in streams:
                await s.__aenter__()
                await s.until("event: ")
            assert fleet.console.streams == 3
            for s in streams:
                await s.close()  # the page closed: the app ends each response
            assert fleet.console.streams == 0

    asyncio.run(run())


def test_the_streams_answer_only_their_account(fleet: Fleet) -> None:
    m = fleet.machines._add("alice", "web")

    async def run() -> None:
        async with echo(fleet, m.id) as (pid, _):
            for path in (f"/api/machines/{m.id}/events",
                         f"/api/machines/{m.id}/processes/{pid}/output",
                         f"/api/machines/{m.id}/processes/p-nope/output"):
                async with Stream(fleet, path, account="bob") as s:
                    await s.ended()
                assert s.status == 404, path
                assert "data:" not in s.body
        other = fleet.machines._add("alice", "other")
        async with Stream(fleet, f"/api/machines/{other.id}/processes/{pid}/output") as s:
            await s.ended()
        assert s.status == 404

    asyncio.run(run())


def test_the_tail_decodes_characters_cut_in_two_and_says_what_was_dropped(
        fleet: Fleet) -> None:
    m = fleet.machines._add("alice", "web")

    async def run() -> list[str]:
        p = await fleet.machines.spawn("alice", m.id, pm.SpawnRequest(argv=["x"]))
        log = fleet.machines.stderr_logs[p.id] = OutputLog(limit=8)
        log.add(b"h\xc3")  # "hé" cut inside the é
        seen: list[str] = []
        gen = live.tail(fleet.machines, "alice", m.id, p.id, None, lambda: False, wait=0.01)
        async with contextlib.aclosing(gen):
            async for chunk in gen:
                seen.append(chunk)
                if len(seen) == 2:
                    log.add(b"\xa9llo")
                if len(seen) == 3:
                    log.add(b"0123456789abcdef")  # 16 bytes past an 8-byte log
                if len(seen) == 5:
                    break
        return seen

    seen = asyncio.run(run())
    assert seen[0] == live.RETRY
    assert seen[1] == 'id: 2\nevent: output\ndata: "h"\n\n'
    assert seen[2] == 'id: 6\nevent: output\ndata: "\\u00e9llo"\n\n'
    assert seen[3] == "event: gap\ndata: 8\n\n"  # 6..14 were dropped
    assert seen[4] == 'id: 22\nevent: output\ndata: "89abcdef"\n\n'


def test_an_exec_row_says_how_it_ended() -> None:
    from boxd.console import views

    def row(**kw: Any) -> dict[str, Any]:
        fields: dict[str, Any] = {"exec_id": "x-1", "command": "make", "running": False,
                                  "started_at": 0.0, **kw}
        return views.exec_row(models.ExecSummary(**fields))

    ok = row(exit_code=0, duration=1.234)
    assert (ok["exit"], ok["ok"], ok["duration"]) == ("0", True, "1.23 s")
    assert row(exit_code=3)["exit"] == "3" and not row(exit_code=3)["ok"]
    assert row(running=True)["exit"] == "running" and row(running=True)["duration"] == ""
    assert row(exit_code=137, signal=9)["exit"] == "137 (signal 9)"
    assert row(exit_code=143, signal=15, timed_out=True)["exit"] == "timed out (143)"
    failed = row(error=models.ErrorBody(code="machine_failed", message="the VM died"))
    assert (failed["exit"], failed["ok"]) == ("failed: the VM died", False)


def test_a_process_row_names_its_command_shortly() -> None:
    from boxd.console import views

    p = pm.Process(id="p-1", machine="m", argv=["python3", "-c", "x" * 200],
                   state="exited", exit_code=3, started_at=0.0)
    r = views.process_row(p)
    assert r["state"] == "exited (3)" and not r["running"]
    assert r["command"].startswith("python3 -c ") and r["command"].endswith("…")
    assert len(r["command"]) == views.PROCESS_COMMAND_SHOWN
