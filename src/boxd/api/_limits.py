"""Request body limits, enforced before any route reads a byte.

A JSON body larger than ``max_body`` (``BOXD_MAX_BODY``) and a streamed upload (a guest
file, a snapshot import) larger than ``max_upload`` (``BOXD_MAX_UPLOAD``) are answered
with 413 ``payload_too_large`` naming the limit. A declared ``Content-Length`` over the
limit is refused at once, unread; a body without one (chunked) is counted as it arrives
and cut off when it passes the limit, so nothing ever parses or spools more than that.

A body that stops arriving before it is complete (a client that declared more bytes
than it sends, or stalled) is answered with 408 ``body_timeout`` after ``body_timeout``
seconds without a byte (``BOXD_BODY_TIMEOUT``): every request gets an answer, and the
route's spool file goes with it. Once the body is complete, waiting on ``receive`` (a
streaming response listening for the client to go away) has no deadline.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.encoders import jsonable_encoder

from boxd.errors import BodyTimeout, BoxdError, InfrastructureError, PayloadTooLarge

__all__ = ["AnswerWhenStopped", "BodyLimit", "is_upload"]

_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[_Message], Awaitable[None]]
_App = Callable[[_Scope, _Receive, _Send], Awaitable[None]]

# The routes whose body is raw bytes streamed somewhere, not parsed.
_UPLOADS = (
    ("PUT", re.compile(r"^/v1/machines/[^/]+/files$")),
    ("POST", re.compile(r"^/v1/snapshots/import$")),
    ("POST", re.compile(r"^/v1/images/build$")),
)


def is_upload(method: str, path: str) -> bool:
    """True for the streamed-upload routes (file upload, snapshot import, build context)."""
    return any(method == m and pattern.match(path) for m, pattern in _UPLOADS)


def _too_large(limit: int, setting: str, size: int | None) -> PayloadTooLarge:
    what = f"a request body of {size} bytes" if size is not None else "the request body"
    return PayloadTooLarge(
        f"{what} is over this daemon's limit of {limit} bytes ({setting})",
        hint=f"send at most {limit} bytes, or raise {setting} on the daemon",
        field="body", limit=limit,
    )


class BodyLimit:
    """ASGI middleware capping request bodies (see the module docstring)."""

    def __init__(
        self, app: _App, *, max_body: int, max_upload: int, body_timeout: float = 60.0
    ) -> None:
        self.app = app
        self.max_body = max_body
        self.max_upload = max_upload
        self.body_timeout = body_timeout

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if is_upload(scope["method"], scope["path"]):
            limit, setting = self.max_upload, "BOXD_MAX_UPLOAD"
        else:
            limit, setting = self.max_body, "BOXD_MAX_BODY"
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _answer(send, _too_large(limit, setting, declared))
            return
        guard = _Guard(receive, send, limit, setting, self.body_timeout)
        try:
            await self.app(scope, guard.receive, guard.send)
        except (PayloadTooLarge, BodyTimeout):
            if not guard.started:
                await _answer(send, guard.over or _too_large(limit, setting, None))


class AnswerWhenStopped:
    """ASGI middleware: a request still unanswered when the server stops and its grace
    for requests in flight ran out (uvicorn then cancels them) is answered 503
    ``infrastructure_error`` saying so, not with uvicorn's bare 500."""

    def __init__(self, app: _App) -> None:
        self.app = app

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: _Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started:
                raise
            await _answer(send, InfrastructureError(
                "the daemon stopped before it finished this request: its outcome is "
                "unknown (it may have been carried out in part or whole)",
                hint="retry once the daemon is back; an exec's outcome can be read by its "
                "exec_id (GET /v1/machines/{id}/execs/{exec_id})"))


class _Guard:
    """One request's body, counted against its limit, and its answer: once the body is
    over the limit (or stops arriving), the answer is that error, whatever the route
    made of the cut body."""

    def __init__(self, receive: _Receive, send: _Send, limit: int, setting: str,
                 timeout: float) -> None:
        self._receive = receive
        self._send = send
        self._limit = limit
        self._setting = setting
        self._timeout = timeout
        self.received = 0
        self.over: BoxdError | None = None
        self.started = False
        self.complete = False

    async def receive(self) -> _Message:
        if self.complete:
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), self._timeout)
        except TimeoutError:
            self.over = BodyTimeout(
                f"the request body stopped arriving: no byte for {self._timeout:g} s"
                f" after {self.received} bytes", field="body", seconds=self._timeout,
                hint="send the whole body (its Content-Length), or raise "
                "BOXD_BODY_TIMEOUT on the daemon",
            )
            raise self.over from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.complete = not message.get("more_body", False)
            if self.received > self._limit:
                self.over = _too_large(self._limit, self._setting, None)
                raise self.over  # stops the route; the answer is replaced below
        else:
            self.complete = True  # http.disconnect
        return message

    async def send(self, message: _Message) -> None:
        if self.over is not None:
            # Whatever the route made of the cut body (a parse error, a failed
            # import), the answer is the limit.
            if message["type"] == "http.response.start" and not self.started:
                self.started = True
                await _answer(self._send, self.over)
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


def _content_length(scope: _Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _answer(send: _Send, exc: BoxdError) -> None:
    body = json.dumps(jsonable_encoder(exc.to_body())).encode()
    await send({
        "type": "http.response.start", "status": exc.status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")],
    })
    await send({"type": "http.response.body", "body": body})
