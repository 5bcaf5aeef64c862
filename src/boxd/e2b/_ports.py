"""Any other ``E2b-Sandbox-Port``: the request goes to that port in the guest.

It is relayed through the sandbox machine's URL (`models.Machine.url_for`), the
daemon's own port proxy for machine URLs: its per-machine token, wake, keep-awake and
first-connection resend rules apply unchanged, and no second path into guests exists.
This module only turns the ASGI request into an HTTP request to that URL and streams
the answer back (request and response bodies are never held whole).

The sandbox id is what admits a request, as for E2B's public sandbox traffic (the code
interpreter SDK sends no ``X-Access-Token`` on most of its calls); docs/e2b.md says so.
An unknown sandbox answers 502 "... was not found" (the SDK's
``SandboxNotRunningException``); a port nothing answers on, or a sandbox without a URL
(created without internet access: an isolated machine), answers 502 "port is not open".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from boxd.e2b._store import SandboxStore
from boxd.e2b.envd import not_found_response
from boxd.errors import BoxdError, MachineNotFound
from boxd.services import MachineService

__all__ = ["PortRelay", "port_closed_response"]

#: Seconds to reach the machine URL's listener (the guest's side has the proxy's grace).
_CONNECT_TIMEOUT = 60.0
# Hop-by-hop headers (RFC 9110 7.6.1) and what the relay sets itself.
_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"host", b"proxy-authenticate", b"proxy-authorization",
})


def port_closed_response(sandbox_id: str, port: int, why: str) -> JSONResponse:
    """E2B's answer for a running sandbox whose port does not answer."""
    return JSONResponse({"sandboxId": sandbox_id, "port": port, "code": 502,
                         "message": f"The sandbox is running but port is not open: {why}"},
                        status_code=502)


class PortRelay:
    """Relays requests for guest ports other than envd's through machine URLs."""

    def __init__(self, machines: MachineService, store: SandboxStore) -> None:
        self.machines = machines
        self.store = store
        # No kept-alive connections: an open connection to a machine URL holds its
        # machine awake, and each request's own connection ends with it.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=_CONNECT_TIMEOUT),
            limits=httpx.Limits(max_keepalive_connections=0), follow_redirects=False,
            trust_env=False)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str,
                       port: int) -> None:
        response = await self._target(sandbox_id, port)
        if isinstance(response, Response):
            await response(scope, receive, send)
            return
        url = response + _path(scope)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        body_done = asyncio.Event()
        # A request without a body is sent without one (not as an empty chunked body).
        framed = any(k.lower() in (b"content-length", b"transfer-encoding")
                     for k, _ in scope["headers"])
        if not framed:
            body_done.set()
        request = self._client.build_request(
            scope["method"], url, headers=headers,
            content=_body(receive, body_done) if framed else None)
        relay = asyncio.create_task(self._relay(request, send, sandbox_id, port, scope,
                                                receive))
        watch = asyncio.create_task(_disconnect(receive, body_done))
        try:
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The client gone: the guest's connection ends too (a code cell is
            # interrupted by it), and the relay with it.
            for task in (relay, watch):
                task.cancel()
            for task in (relay, watch):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _relay(self, request: httpx.Request, send: Send, sandbox_id: str, port: int,
                     scope: Scope, receive: Receive) -> None:
        try:
            upstream = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await port_closed_response(sandbox_id, port, f"{type(exc).__name__}: {exc}")(
                scope, receive, send)
            return
        try:
            if upstream.status_code == 502 and upstream.reason_phrase == "boxd":
                # The URL proxy's own answer: the guest port does not answer.
                text = (await upstream.aread()).decode(errors="replace").strip()
                await port_closed_response(sandbox_id, port, text)(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": [(k, v) for k, v in upstream.headers.raw
                                    if k.lower() not in _HOP]})
            async for chunk in upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError:
            pass  # the guest's side broke mid-answer: the client's connection ends too
        finally:
            await upstream.aclose()

    async def _target(self, sandbox_id: str, port: int) -> str | Response:
        """The machine URL for ``port``, or the response that refuses the request."""
        rec = self.store.get(sandbox_id)
        if rec is None:
            return not_found_response(sandbox_id)
        try:
            machine = await self.machines.get(rec.account, sandbox_id)
        except MachineNotFound:
            return not_found_response(sandbox_id)
        if machine.url is None:
            return port_closed_response(sandbox_id, port, "the sandbox has no network "
                                        "(created without internet access)")
        try:
            return machine.url_for(port).rstrip("/")
        except BoxdError as exc:
            return port_closed_response(sandbox_id, port, exc.message)


def _path(scope: Scope) -> str:
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else str(scope["path"])
    query = scope.get("query_string", b"")
    if query and "?" not in path:
        path += "?" + query.decode("latin-1")
    return path if path.startswith("/") else "/" + path


async def _body(receive: Receive, done: asyncio.Event) -> AsyncIterator[bytes]:
    """The request's body as it comes; ``done`` set at its end."""
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return
    finally:
        done.set()


async def _disconnect(receive: Receive, body_done: asyncio.Event) -> None:
    """Returns when the client goes (watched once its body was read)."""
    await body_done.wait()
    while (await receive())["type"] != "http.disconnect":
        pass
