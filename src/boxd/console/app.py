"""The console app: pages, their JSON and live stream, login, static assets.

Every page and JSON route needs a session (`boxd.console.sessions`); without one a page
answers 401 with a page that holds no data, and JSON routes 401. Machines are looked up
for the session's account only, so another account's machine answers 404, as in the API.
Actions (POST) need the header ``X-Boxd-Console: 1`` besides the SameSite=Strict cookie:
a cross-site form cannot send it, and a cross-site script would need a CORS preflight
this app never grants. The live streams (the machines table, a machine's page, a
process's output) are `boxd.console.live`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from boxd import models
from boxd import process_models as pm
from boxd.console import live, report, views
from boxd.console.login import TOKENS_PATH
from boxd.console.sessions import COOKIE, Logins, cookie_header
from boxd.errors import AuthError, BoxdError, InvalidRequest, MachineNotFound, NotFound
from boxd.services import MachineService, ProcessService, ReportService, SnapshotService

__all__ = ["Authenticate", "create_console_app"]

log = logging.getLogger("boxd.console")

Authenticate = Callable[[str | None], str]
"""An API key's secret -> its account id (raises AuthError)."""
AccountName = Callable[[str], str]
"""An account id -> the account's name, which the pages show (raises NotFound)."""

_HERE = Path(__file__).parent
ACTION_HEADER = "x-boxd-console"
#: Recent execs a machine's page shows.
EXECS_SHOWN = 20

_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


class Console:
    """The console's state and handlers over the machine and snapshot services."""

    def __init__(self, machines: MachineService, snapshots: SnapshotService,
                 authenticate: Authenticate, logins: Logins,
                 reports: ReportService | None = None,
                 processes: ProcessService | None = None,
                 account_name: AccountName | None = None) -> None:
        self.machines = machines
        self.snapshots = snapshots
        self.reports = reports
        self.processes = processes
        self.authenticate = authenticate
        self.account_name = account_name
        self.logins = logins
        #: Set when the daemon stops: live streams end, so the listener can close.
        self.stopping = False
        #: Live streams open now (each ends when its page closes).
        self.streams = 0
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(_HERE / "templates"),
            autoescape=True, undefined=jinja2.StrictUndefined,
        )

    # -- helpers ---------------------------------------------------------------------

    def page(self, name: str, code: int = 200, *, account: str | None = None,
             **context: Any) -> HTMLResponse:
        """Render a template; ``account`` (an id) is shown by its name, in the header."""
        if account is not None:
            context["account"] = self.shown_account(account)
        html = self.templates.get_template(name).render(**context)
        return HTMLResponse(html, status_code=code, headers=_HEADERS)

    def shown_account(self, account: str) -> str:
        """The account's name (its id when the name cannot be had)."""
        if self.account_name is None:
            return account
        try:
            return self.account_name(account)
        except BoxdError:
            return account

    def stream(self, events: AsyncGenerator[str, None]) -> StreamingResponse:
        """A live stream of server-sent events, counted in `streams` while it is open."""
        async def counted() -> AsyncIterator[str]:
            self.streams += 1
            try:
                async with contextlib.aclosing(events):
                    async for chunk in events:
                        yield chunk
            finally:
                self.streams -= 1

        return StreamingResponse(counted(), media_type="text/event-stream", headers=_HEADERS)

    def account(self, request: Request) -> str:
        return self.logins.account(request.cookies.get(COOKIE))

    async def _snapshot_map(self, account: str) -> dict[str, models.Snapshot]:
        return {s.digest: s for s in await self.snapshots.list(account)}

    async def rows(self, account: str) -> list[dict[str, Any]]:
        machines = await self.machines.list(account)
        names = {m.id: m.name for m in machines}
        snaps = await self._snapshot_map(account)
        return [views.machine_row(m, names, snaps) for m in machines]

    # -- login -----------------------------------------------------------------------

    async def login_tokens(self, request: Request) -> Response:
        header = request.headers.get("authorization", "")
        scheme, _, secret = header.partition(" ")
        account = self.authenticate(secret.strip() if scheme.lower() == "bearer" else None)
        token = self.logins.mint(account)
        url = f"{str(request.base_url).rstrip('/')}/login?token={token}"
        return JSONResponse({"url": url, "expires_in": self.logins.token_seconds},
                            headers={"Cache-Control": "no-store"})

    async def login(self, request: Request) -> Response:
        _, session = self.logins.exchange(request.query_params.get("token"))
        # 303 to "/": the token leaves the address bar (and the history's latest entry).
        response = RedirectResponse("/", status_code=303, headers=_HEADERS)
        response.headers["Set-Cookie"] = cookie_header(session, self.logins.session_seconds)
        return response

    async def logout(self, request: Request) -> Response:
        self.logins.end(request.cookies.get(COOKIE))
        response = self.page("login.html", 200, reason="You are logged out.")
        response.headers["Set-Cookie"] = cookie_header("", 0)
        return response

    # -- pages -----------------------------------------------------------------------

    async def machines_page(self, request: Request) -> Response:
        account = self.account(request)
        rows = await self.rows(account)
        states = [s.value for s in models.MachineState]
        return self.page("machines.html", account=account, rows=rows, states=states,
                         actions=views.ACTIONS, nav="machines")

    async def machine_page(self, request: Request) -> Response:
        account = self.account(request)
        m = await self.machines.get(account, request.path_params["ref"])
        machines = await self.machines.list(account)
        checkpoints = await self.machines.checkpoint_list(account, m.id)
        snaps = await self._snapshot_map(account)
        names = {x.id: x.name for x in machines}
        guest = await self._guest_parts(account, m.id)
        return self.page(
            "machine.html", account=account, m=m, row=views.machine_row(m, names, snaps),
            tree=views.tree_list(m, machines), checkpoints=checkpoints,
            actions=views.ACTIONS, nav="machines", execs=guest["execs"],
            execs_shown=EXECS_SHOWN, processes=guest["processes"], time=views.clock,
        )

    async def _guest_parts(self, account: str, machine_id: str) -> dict[str, Any]:
        """A machine's recent execs and processes, as its page shows them (none when its
        node cannot say: a lost node's machine still has a page)."""
        execs: list[dict[str, Any]] = []
        procs: list[pm.Process] = []
        with contextlib.suppress(BoxdError):
            execs = [views.exec_row(e) for e in
                     await self.machines.exec_list(account, machine_id, EXECS_SHOWN)]
        if self.processes is not None:
            with contextlib.suppress(BoxdError):
                procs = await self.processes.processes(account, machine_id)
        return {"execs": execs, "processes": [views.process_row(p) for p in procs]}

    async def snapshots_page(self, request: Request) -> Response:
        account = self.account(request)
        names = {m.id: m.name for m in await self.machines.list(account)}
        rows = [views.snapshot_row(s, names) for s in await self.snapshots.list(account)]
        return self.page("snapshots.html", account=account, rows=rows, nav="snapshots")

    async def reports_page(self, request: Request) -> Response:
        account = self.account(request)
        rows = await self.reports.list(account) if self.reports is not None else []
        return self.page("reports.html", account=account, rows=rows, nav="reports",
                         time=views.clock)

    async def report_page(self, request: Request) -> Response:
        account = self.account(request)
        name = request.path_params["name"]
        if self.reports is None:
            raise NotFound(f"no report {name!r}")
        saved = await self.reports.get(account, name)
        return self.page("report.html", account=account, saved=saved, nav="reports",
                         body=Markup(report.report_sections(saved.report)),
                         data=Markup(report.script_json(saved.report)), time=views.clock)

    # -- JSON ------------------------------------------------------------------------

    async def machines_json(self, request: Request) -> Response:
        return JSONResponse({"machines": await self.rows(self.account(request))},
                            headers=_HEADERS)

    async def graph_json(self, request: Request) -> Response:
        account = self.account(request)
        m = await self.machines.get(account, request.path_params["ref"])
        elements = views.graph_elements(
            m, await self.machines.list(account), await self.snapshots.list(account),
            await self.machines.checkpoint_list(account, m.id))
        return JSONResponse({"elements": elements}, headers=_HEADERS)

    def _stopping(self) -> bool:
        return self.stopping

    async def events(self, request: Request) -> Response:
        """Server-sent events: ``machines`` with every row whenever any row changes."""
        account = self.account(request)

        async def fetch() -> Mapping[str, Any]:
            return {"machines": await self.rows(account)}

        return self.stream(live.changes(fetch, self._stopping))

    async def machine_events(self, request: Request) -> Response:
        """Server-sent events of a machine's page: ``machine`` (its state), ``execs`` and
        ``processes`` whenever one changes; ``gone`` once it is deleted."""
        account = self.account(request)
        m = await self.machines.get(account, request.path_params["ref"])

        async def fetch() -> Mapping[str, Any] | None:
            try:
                now = await self.machines.get(account, m.id)
            except MachineNotFound:
                return None
            return {"machine": views.machine_live(now),
                    **await self._guest_parts(account, m.id)}

        return self.stream(live.changes(fetch, self._stopping))

    async def process_output(self, request: Request) -> Response:
        """Server-sent events: the process's output (`boxd.console.live.tail`), from
        the ``Last-Event-ID`` a reconnecting browser sends, else all the node keeps."""
        account = self.account(request)
        if self.processes is None:
            raise NotFound("this console shows no processes")
        m = await self.machines.get(account, request.path_params["ref"])
        process_id = request.path_params["process"]
        await self.processes.process_output(account, m.id, process_id)  # 404s first
        last = request.headers.get("last-event-id", "")
        after = int(last) if last.isdigit() else None
        return self.stream(live.tail(self.processes, account, m.id, process_id, after,
                                     self._stopping))

    async def action(self, request: Request) -> Response:
        account = self.account(request)
        if request.headers.get(ACTION_HEADER) != "1":
            raise AuthError(f"a console action needs the header {ACTION_HEADER}: 1",
                            hint="actions are sent by the console's own page")
        ref, name = request.path_params["ref"], request.path_params["action"]
        do = self._actions().get(name)
        if do is None:
            raise NotFound(f"no console action {name!r}", hint=", ".join(views.ACTIONS))
        result = await do(account, ref, await _name(request))
        log.info("console action", extra={"machine": ref, "action": name,
                                          "account": account})
        out = result.model_dump(mode="json") if result is not None else None
        return JSONResponse({"ok": True, "result": out}, headers=_HEADERS)

    def _actions(self) -> dict[str, _Action]:
        m, s = self.machines, self.snapshots

        async def suspend(account: str, ref: str, _: str | None) -> BaseModel:
            return await m.suspend(account, ref)

        async def resume(account: str, ref: str, _: str | None) -> BaseModel:
            return await m.resume(account, ref)

        async def hibernate(account: str, ref: str, _: str | None) -> BaseModel:
            return await m.hibernate(account, ref)

        async def delete(account: str, ref: str, _: str | None) -> None:
            await m.delete(account, ref)

        async def fork(account: str, ref: str, name: str | None) -> BaseModel:
            [child] = await m.fork(account, ref, [name])
            if isinstance(child, Exception):
                raise child
            return child

        async def checkpoint(account: str, ref: str, name: str | None) -> BaseModel:
            return await m.checkpoint_save(
                account, ref, name or time.strftime("console-%Y%m%d-%H%M%S"))

        async def snapshot(account: str, ref: str, name: str | None) -> BaseModel:
            if name is None:
                raise InvalidRequest("a snapshot needs a name", field="name")
            return await s.save(account, ref, name)

        return {"suspend": suspend, "resume": resume, "hibernate": hibernate,
                "delete": delete, "fork": fork, "checkpoint": checkpoint,
                "snapshot": snapshot}


_Action = Callable[[str, str, str | None], Awaitable[BaseModel | None]]
"""An action: (account, machine ref, the name the dialog asked for) -> what it made."""


async def _name(request: Request) -> str | None:
    """The ``name`` of an action's JSON body (none, or empty: None).

    Raises:
        InvalidRequest: a body that is not JSON, or a name that is not a string.
    """
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise InvalidRequest("an action's body is JSON: {\"name\": ...}") from exc
    name = body.get("name") if isinstance(body, dict) else None
    if name is not None and not isinstance(name, str):
        raise InvalidRequest("name must be a string", field="name")
    return name or None




def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/") or request.url.path == TOKENS_PATH


def _handler(console: Console) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def on_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BoxdError)
        if exc.status >= 500:
            log.error("console request failed: %s %s: %s", request.method,
                      request.url.path, exc)
        if _wants_json(request):
            return JSONResponse(exc.to_body(), status_code=exc.status, headers=_HEADERS)
        if isinstance(exc, AuthError):
            return console.page("login.html", exc.status, reason=exc.message)
        account = None
        with contextlib.suppress(AuthError):  # a logged-in user's header names them
            account = console.account(request)
        return console.page("error.html", exc.status, message=exc.message, hint=exc.hint,
                            status=exc.status, nav="", account=account)
    return on_error


def create_console_app(
    machines: MachineService,
    snapshots: SnapshotService,
    authenticate: Authenticate,
    logins: Logins | None = None,
    reports: ReportService | None = None,
    processes: ProcessService | None = None,
    account_name: AccountName | None = None,
) -> Starlette:
    """The console's ASGI app over the daemon's services.

    Args:
        machines: the machine service.
        snapshots: the snapshot service.
        authenticate: an API key -> its account (mints login tokens).
        logins: the login tokens and sessions (default: a new, empty store).
        reports: saved reproducibility reports (None: the console lists none).
        processes: machines' spawned processes (None: a machine's page shows none).
        account_name: an account id -> its name, for the header (None: the id).

    ``app.state.console`` is the `Console`: set its ``stopping`` to end live streams.
    """
    console = Console(machines, snapshots, authenticate, logins or Logins(), reports,
                      processes, account_name)
    c = console
    app = Starlette(routes=[
        Route(TOKENS_PATH, c.login_tokens, methods=["POST"]),
        Route("/login", c.login, methods=["GET"]),
        Route("/logout", c.logout, methods=["POST"]),
        Route("/", c.machines_page, methods=["GET"]),
        Route("/machines/{ref}", c.machine_page, methods=["GET"]),
        Route("/snapshots", c.snapshots_page, methods=["GET"]),
        Route("/reports", c.reports_page, methods=["GET"]),
        Route("/reports/{name}", c.report_page, methods=["GET"]),
        Route("/api/machines", c.machines_json, methods=["GET"]),
        Route("/api/events", c.events, methods=["GET"]),
        Route("/api/machines/{ref}/graph", c.graph_json, methods=["GET"]),
        Route("/api/machines/{ref}/events", c.machine_events, methods=["GET"]),
        Route("/api/machines/{ref}/processes/{process}/output", c.process_output,
              methods=["GET"]),
        Route("/api/machines/{ref}/actions/{action}", c.action, methods=["POST"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ], exception_handlers={BoxdError: _handler(console)})
    app.state.console = console
    return app
