"""Any other ``E2b-Sandbox-Port``: the request goes to that port in the guest.

It is relayed through the sandbox machine's URL (`models.Machine.url_for`), the
daemon's own port proxy for machine URLs: its per-machine token, wake, keep-awake and
first-connection resend rules apply unchanged, and no second path into guests exists.
This module only turns the ASGI request into an HTTP request to that URL and streams
the answer back (request and response bodies are never held whole).

A WebSocket (an ASGI ``websocket`` scope: noVNC, Jupyter kernels, a dev server's hot
reload) opens one to the same URL first, offering the client's subprotocols; only once
the guest's server accepted is the client's accepted, with the subprotocol the guest
chose. A guest's refusal is the client's (its status, headers and body). Then messages
pass both ways as they are (text as text, binary as binary) and a close code and reason
pass on from the side that closed (a close without a code passes as 1000; a side that
vanished without a close: 1001 to the guest, 1014 "bad gateway" to the client). Memory
is bounded whatever either side sends: a message over `WS_MAX_MESSAGE` closes the
connection with 1009 (the client's by uvicorn, the guest's here), each side's reading
pauses while a message waits to be written to the other (at most `_WS_QUEUE` frames of
the guest's are read ahead), and writes wait for the socket to drain. Neither side's
connection is compressed (the listener declines permessage-deflate, server.py): the
relay passes what the guest's server sends, and no small deflated frame inflates to a
big message in the daemon.

The sandbox id is what admits a request, as for E2B's public sandbox traffic (the code
interpreter SDK sends no ``X-Access-Token`` on most of its calls); docs/e2b.md says so.
An unknown sandbox answers 502 "... was not found" (the SDK's
``SandboxNotRunningException``); a port nothing answers on, or a sandbox without a URL
(created without internet access: an isolated machine), answers 502 "port is not open".
A WebSocket is refused with the same responses (uvicorn's ``websocket.http.response``
denial), so a client sees the status and E2B's JSON message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.frames import EXTERNAL_CLOSE_CODES

from boxd.e2b._store import SandboxStore
from boxd.e2b.envd import not_found_response
from boxd.errors import BoxdError, MachineNotFound
from boxd.services import MachineService

__all__ = ["WS_MAX_MESSAGE", "PortRelay", "port_closed_response"]

#: Seconds to reach the machine URL's listener (the guest's side has the proxy's grace).
_CONNECT_TIMEOUT = 60.0
# Hop-by-hop headers (RFC 9110 7.6.1) and what the relay sets itself.
_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"host", b"proxy-authenticate", b"proxy-authorization",
})
#: The largest WebSocket message relayed either way, in bytes (uvicorn's default for the
#: client's side; the E2B listener sets it, server.py). Larger ones close with 1009.
WS_MAX_MESSAGE = 16 * 1024 * 1024
#: Frames of the guest's side read ahead of the client (websockets' high-water mark).
_WS_QUEUE = 4
#: What a WebSocket handshake sets itself, on each of its two connections.
_WS_OWN = _HOP | frozenset({
    b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
    b"sec-websocket-protocol", b"sec-websocket-accept", b"content-length", b"date",
    b"server",
})
#: Seconds the guest's side gets to finish its closing handshake.
_WS_CLOSE_TIMEOUT = 10.0
#: The longest close reason a close frame carries (RFC 6455 5.5: 125-byte payloads).
_REASON_BYTES = 123


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
            await response(scope, receive, send)  # a WebSocket's: an HTTP denial
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, response, sandbox_id, port)
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

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, url: str,
                         sandbox_id: str, port: int) -> None:
        """Open the guest's WebSocket, accept the client's, and relay until one closes."""
        if (await receive())["type"] != "websocket.connect":
            return  # the client went before its handshake was read
        opened = await _open_guest(scope, "ws" + url.removeprefix("http") + _path(scope),
                                   sandbox_id, port)
        if isinstance(opened, Response):
            await opened(scope, receive, send)
            return
        guest = opened
        answer = guest.response  # set once the handshake is done, as it is here
        headers = [] if answer is None else [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in answer.headers.raw_items() if k.lower().encode("latin-1") not in _WS_OWN]
        try:
            await send({"type": "websocket.accept", "subprotocol": guest.subprotocol,
                        "headers": headers})
        except OSError:  # uvicorn's ClientDisconnected: the client is gone already
            await guest.close(1001, "the client went away")
            return
        await _pump(receive, send, guest)

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


async def _open_guest(scope: Scope, url: str, sandbox_id: str, port: int
                      ) -> ClientConnection | Response:
    """The guest's side of a WebSocket, or the response that refuses the client."""
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
               if k.lower() not in _WS_OWN]
    try:
        # The client's own headers (Origin, cookies, its User-Agent) and subprotocols;
        # no proxy from the environment, no compression (loopback to the URL proxy),
        # no pings of the relay's own (each side's pings are answered where they arrive).
        return await connect(
            url, additional_headers=headers, user_agent_header=None, proxy=None,
            subprotocols=scope.get("subprotocols") or None, compression=None,
            open_timeout=_CONNECT_TIMEOUT, ping_interval=None,
            max_size=WS_MAX_MESSAGE, max_queue=_WS_QUEUE)
    except InvalidStatus as exc:
        answer = exc.response
        body = bytes(answer.body or b"")  # websockets may give a bytearray
        text = body.decode(errors="replace").strip()
        if answer.status_code == 502 and answer.reason_phrase == "boxd":
            return port_closed_response(sandbox_id, port, text)  # the URL proxy's own
        # The guest's server refused the handshake: its answer is the client's.
        return Response(body, status_code=answer.status_code, headers={
            k: v for k, v in answer.headers.raw_items()
            if k.lower().encode("latin-1") not in _WS_OWN})
    except (OSError, TimeoutError, WebSocketException) as exc:  # a bad handshake too
        return port_closed_response(sandbox_id, port, f"{type(exc).__name__}: {exc}")


async def _pump(receive: Receive, send: Send, guest: ClientConnection) -> None:
    """Messages both ways until a side closes; its close code goes to the other."""
    to_guest = asyncio.create_task(_client_to_guest(receive, guest))
    to_client = asyncio.create_task(_guest_to_client(guest, send))
    try:
        done, _ = await asyncio.wait({to_guest, to_client},
                                     return_when=asyncio.FIRST_COMPLETED)
        client_closed = to_guest.result() if to_guest in done else to_client.result()
        for task in (to_guest, to_client):
            task.cancel()
        if client_closed is not None:
            await guest.close(*client_closed)
            return
        with contextlib.suppress(asyncio.TimeoutError):  # its closing handshake's end
            await asyncio.wait_for(guest.wait_closed(), _WS_CLOSE_TIMEOUT)
        code, reason = _guest_close(guest)
        with contextlib.suppress(OSError):  # the client went meanwhile
            await send({"type": "websocket.close", "code": code, "reason": reason})
    finally:
        for task in (to_guest, to_client):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await guest.close(1001, "the relay ended")  # nothing once it is closed


async def _client_to_guest(receive: Receive, guest: ClientConnection
                           ) -> tuple[int, str] | None:
    """The client's messages to the guest; returns the client's close for the guest
    (None: the guest's side closed first)."""
    while True:
        message: Message = await receive()
        if message["type"] == "websocket.disconnect":
            return (_sendable(int(message.get("code", 1000)), 1001),
                    _reason(message.get("reason") or ""))
        data = message.get("bytes")
        try:
            await guest.send(message.get("text", "") if data is None else data)
        except ConnectionClosed:
            return None


async def _guest_to_client(guest: ClientConnection, send: Send) -> tuple[int, str] | None:
    """The guest's messages to the client; returns None when the guest's side closes
    (the client's close for the guest when the client went)."""
    try:
        async for data in guest:
            await send({"type": "websocket.send", "text": data} if isinstance(data, str)
                       else {"type": "websocket.send", "bytes": data})
    except ConnectionClosed:
        pass
    except OSError:  # uvicorn's ClientDisconnected: gone without a close
        return 1001, "the client went away"
    return None


def _guest_close(guest: ClientConnection) -> tuple[int, str]:
    """The close code and reason the client gets when the guest's side ended."""
    proto = guest.protocol
    got, sent = proto.close_rcvd, proto.close_sent
    if got is not None and (sent is None or proto.close_rcvd_then_sent):
        return _sendable(got.code, 1014), got.reason  # the guest closed
    if sent is not None and sent.code == 1009:
        return 1009, f"a message from the sandbox is over the {WS_MAX_MESSAGE}-byte limit"
    if sent is not None and sent.code != 1000:  # the relay failed it: bad frames
        return sent.code, _reason(f"the sandbox's side: {sent.reason}")
    return 1014, "the sandbox's side ended without a close"


def _sendable(code: int, otherwise: int) -> int:
    """``code`` as a close frame can carry it: 1005 (none given) is 1000, the codes
    that only say what happened (1006: no close at all, 1015) are ``otherwise``."""
    if code == 1005:
        return 1000
    return code if code in EXTERNAL_CLOSE_CODES or 3000 <= code < 5000 else otherwise


def _reason(text: str) -> str:
    """``text`` cut to what a close frame carries (whole UTF-8 characters)."""
    return text.encode()[:_REASON_BYTES].decode(errors="ignore")
