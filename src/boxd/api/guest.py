"""The in-guest API: relayed guest connections served by the daemon's own HTTP app.

A process in a machine connects to ``/run/boxd/boxd.sock``; the guest agent relays the
connection over the machine's agent channel (docs/agent-protocol.md, ``relay_listen``)
and the node hands it here as a byte stream. Each stream is served by the daemon's
uvicorn protocol on one end of a socket pair, with the `GuestCaller` in the ASGI scope
(``SCOPE_KEY``): `boxd.api.auth` accepts the machine's credential only on its own
relayed connections (docs/lifecycle.md#in-machine-auth).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import uvicorn

from boxd.services import ByteStream, GuestCaller

__all__ = ["SCOPE_KEY", "GuestRelay"]

log = logging.getLogger("boxd.api.guest")

#: Where a relayed request's `GuestCaller` sits in the ASGI scope.
SCOPE_KEY = "boxd.guest"
_CHUNK = 64 * 1024


def _with_caller(app: Any, caller: GuestCaller) -> Any:
    async def guest_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") in ("http", "websocket"):
            scope = {**scope, SCOPE_KEY: caller}
        await app(scope, receive, send)

    return guest_app


class GuestRelay:
    """Serves relayed guest connections with a uvicorn server's app (a `GuestApi`)."""

    def __init__(self, server: uvicorn.Server) -> None:
        self.server = server

    async def __call__(self, caller: GuestCaller, stream: ByteStream) -> None:
        # Machines recovered at start-up may connect before uvicorn has loaded its app.
        while not self.server.started:
            if self.server.should_exit:
                await stream.close()
                return
            await asyncio.sleep(0.05)
        reader, writer = await self._connect(caller)
        await _pump(stream, reader, writer)

    async def _connect(
        self, caller: GuestCaller
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """One end of a socket pair served by uvicorn's protocol (``caller`` in its
        scope); the other end, opened as a stream."""
        config = self.server.config
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            proto: Any = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server.server_state,
                app_state=self.server.lifespan.state,
            )
            proto.app = _with_caller(proto.app, caller)
            return proto  # type: ignore[no-any-return]

        ours, theirs = socket.socketpair()
        try:
            theirs.setblocking(False)
            await loop.connect_accepted_socket(protocol, theirs)
        except BaseException:
            ours.close()
            theirs.close()
            raise
        return await asyncio.open_connection(sock=ours, limit=_CHUNK)


async def _pump(stream: ByteStream, reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter) -> None:
    """Copy bytes both ways between the guest's stream and the app until either ends."""

    async def to_app() -> None:
        while data := await stream.read():
            writer.write(data)
            await writer.drain()

    async def to_guest() -> None:
        while data := await reader.read(_CHUNK):
            await stream.write(data)

    tasks = [asyncio.ensure_future(to_app()), asyncio.ensure_future(to_guest())]
    try:
        # Either side ending ends the connection: a guest client never half-closes.
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        await stream.close()
