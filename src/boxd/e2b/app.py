"""The E2B app: control routes, and the envd shim for requests naming a sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from boxd.e2b import _signing as signing
from boxd.e2b import control, envd
from boxd.e2b._common import ENVD_PORT, Authenticate, E2BState, boxd_error, e2b_error
from boxd.e2b._ports import WS_MAX_MESSAGE, PortRelay
from boxd.e2b._processes import ProcessTable
from boxd.e2b._sandboxes import Sandboxes
from boxd.e2b._signing import operation_of
from boxd.e2b._store import SandboxRecord, SandboxStore
from boxd.e2b.interpreter import CODE_INTERPRETER, InterpreterTemplate
from boxd.errors import BoxdError
from boxd.services import MachineService, SnapshotService

__all__ = ["WS_MAX_MESSAGE", "create_e2b_app"]

log = logging.getLogger("boxd.e2b")


async def _boxd_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BoxdError)
    if exc.status >= 500:
        log.error("e2b request failed: %s %s: %s", request.method, request.url.path, exc)
    return boxd_error(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return e2b_error(exc.status_code, f"{exc.detail}: {request.method} {request.url.path} "
                     "(docs/e2b.md lists the supported calls)")


async def _internal(request: Request, exc: Exception) -> Response:
    log.error("e2b request failed: %s %s", request.method, request.url.path, exc_info=exc)
    return e2b_error(500, "internal error: the daemon's log has the details")


_HANDLERS = {BoxdError: _boxd_error, HTTPException: _http_error, Exception: _internal}


# Control API paths. SDKs send the sandbox headers on control calls too (Python e2b from
# 2.7 on put ``E2b-Sandbox-Id`` on ``POST /sandboxes/{id}/connect``); envd has none of
# these paths, so such a request is the control API's whatever its headers say.
_CONTROL_PREFIXES = ("/sandboxes", "/v2/", "/v3/", "/snapshots", "/templates")


class _Dispatch:
    """Requests naming a sandbox (``E2b-Sandbox-Id``) go to envd (``E2b-Sandbox-Port``
    49983 or none) or to that port in the guest (`PortRelay`), the rest to control.
    A WebSocket goes to its sandbox's port (`PortRelay`) or is refused: neither the
    control API nor envd has one.

    A request to an envd path with no ``E2b-Sandbox-Id`` but a sandbox's
    ``X-Access-Token`` is that sandbox's: e2b 2.7-2.25.0 (Python) send no sandbox
    headers from a sandbox got by ``Sandbox.connect(id)``, only its token, and with one
    URL for every sandbox nothing else names it. The token is the sandbox's secret, the
    one envd requires anyway.
    """

    def __init__(self, control_app: ASGIApp, envd_app: ASGIApp, store: SandboxStore,
                 ports: PortRelay, domain: str | None = None) -> None:
        self.control = control_app
        self.envd = envd_app
        self.store = store
        self.ports = ports
        self.host = None if domain is None else re.compile(
            rb"([0-9]{1,5})-([a-z0-9]+)\." + re.escape(domain.encode()) + rb"(?::[0-9]+)?")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.host is not None \
                and await self._by_host(scope, receive, send):
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] == "http" and not str(scope["path"]).startswith(_CONTROL_PREFIXES):
            headers = dict(scope["headers"])
            sandbox = headers.get(b"e2b-sandbox-id")
            token = headers.get(b"x-access-token")
            rec = None
            if sandbox is None and token is not None:
                rec = self.store.by_token(token.decode(errors="replace"))
            elif sandbox is None and scope["path"] == "/files":
                rec, refusal = self._signed(scope)
                if refusal is not None:
                    await refusal(scope, receive, send)
                    return
            if rec is not None:
                sandbox = rec.sandbox_id.encode()
                scope = {**scope, "headers": [*scope["headers"], (b"e2b-sandbox-id", sandbox)]}
            if sandbox is not None:
                await self._sandbox(scope, receive, send, sandbox,
                                    headers.get(b"e2b-sandbox-port"))
                return
        await self.control(scope, receive, send)

    async def _by_host(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """A ``<port>-<id>.<domain>`` Host: that sandbox's port whatever the path (a
        guest's own server may have a /sandboxes too); the name says what the headers
        say. Whether it was one (and was answered)."""
        assert self.host is not None
        named = self.host.fullmatch(dict(scope["headers"]).get(b"host", b"").lower())
        if named is None:
            return False
        scope = {**scope, "headers": [
            *[(k, v) for k, v in scope["headers"]
              if k not in (b"e2b-sandbox-id", b"e2b-sandbox-port")],
            (b"e2b-sandbox-id", named.group(2)), (b"e2b-sandbox-port", named.group(1))]}
        await self._sandbox(scope, receive, send, named.group(2), named.group(1))
        return True

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Only a sandbox's ports have WebSockets (the control API and envd none): the
        headers name the sandbox whatever the path."""
        sandbox = dict(scope["headers"]).get(b"e2b-sandbox-id")
        if sandbox is None:
            await e2b_error(404, "no WebSocket here: name a sandbox's port with "
                            "E2b-Sandbox-Id and E2b-Sandbox-Port (docs/e2b.md)")(
                scope, receive, send)
            return
        await self._sandbox(scope, receive, send, sandbox,
                            dict(scope["headers"]).get(b"e2b-sandbox-port"))

    def _signed(self, scope: Scope) -> tuple[SandboxRecord | None, Response | None]:
        """A ``/files`` request with no sandbox header nor token: a signed URL (E2B's
        ``download_url`` / ``upload_url``) names its sandbox by its signature; else it
        is refused as envd refuses an unauthenticated one."""
        query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode(
            errors="replace"), keep_blank_values=True))
        operation = operation_of(str(scope["method"]))
        if "signature" not in query or operation is None:
            return None, e2b_error(401, "unauthorized access, please provide a valid access "
                                   "token or method signing if supported")
        rec = signing.find(self.store.all(), query, operation)
        return rec, None if rec is not None else e2b_error(401, "invalid signature")

    async def _sandbox(self, scope: Scope, receive: Receive, send: Send, sandbox: bytes,
                       port_header: bytes | None) -> None:
        port = _port(port_header)
        if port is None:
            await e2b_error(400, "E2b-Sandbox-Port must be a TCP port, 1-65535")(
                scope, receive, send)
        elif port == ENVD_PORT and scope["type"] == "websocket":
            await e2b_error(404, f"envd (port {ENVD_PORT}) has no WebSocket: E2B's envd "
                            "speaks Connect over HTTP; name another port")(scope, receive, send)
        elif port == ENVD_PORT:
            await self.envd(scope, receive, send)
        else:
            await self.ports(scope, receive, send, sandbox.decode(errors="replace"), port)


def _port(value: bytes | None) -> int | None:
    """The guest port a request names (envd's when it names none); None: not a port."""
    if value is None:
        return ENVD_PORT
    text = value.decode(errors="replace").strip()
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 65535:
        return None
    return int(text)


def create_e2b_app(machines: MachineService, authenticate: Authenticate,
                   directory: Path, snapshots: SnapshotService | None = None, *,
                   domain: str | None = None) -> Starlette:
    """The E2B API over ``machines``.

    Args:
        machines: the machine service (the same one the HTTP API serves).
        authenticate: an API key's secret -> its account id (raises AuthError).
        directory: where sandbox records are kept (``<data dir>/e2b``).
        snapshots: the snapshot service (E2B's snapshots are boxd's); None: no
            snapshot routes (and no ``code-interpreter-v1``, a snapshot boxd builds).
        domain: the operator's sandbox domain (``BOXD_E2B_DOMAIN``): requests whose Host
            is ``<port>-<sandbox id>.<domain>`` go to that sandbox's port, and creates
            answer it as ``domain``; None: the headers alone route.

    Returns:
        The ASGI app. Its lifespan runs the task that ends sandboxes at their timeout.
    """
    store = SandboxStore(directory)
    ports = PortRelay(machines, store)
    built = {}
    if snapshots is not None:
        interpreter = InterpreterTemplate(machines, snapshots,
                                          directory / "interpreter-wheels")
        built[CODE_INTERPRETER] = interpreter.ensure
    state = E2BState(Sandboxes(machines, store, built), ProcessTable(machines),
                     authenticate, snapshots, domain)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        reaper = asyncio.create_task(state.sandboxes.reap())
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await ports.aclose()

    control_app = Starlette(routes=control.routes, exception_handlers=_HANDLERS)
    envd_app = Starlette(routes=envd.routes, exception_handlers=_HANDLERS)
    for sub in (control_app, envd_app):
        sub.state.e2b = state
    app = Starlette(lifespan=lifespan)
    app.state.e2b = state
    app.mount("/", _Dispatch(control_app, envd_app, store, ports, domain))
    return app
