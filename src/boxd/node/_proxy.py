"""Machine URLs: a TCP port the daemon holds per machine, relayed to the guest.

A machine's URL (``http://127.0.0.1:PORT``) is a listening socket of the daemon, not
of QEMU, so it stays the same while the VM process comes and goes (checkpoint restore,
hibernate and wake, a daemon restart). Each connection wakes a suspended or hibernated
machine first (the node's ``connect``), counts as activity, keeps the machine awake
while it is open, and is relayed byte for byte to a connection the engine opens to the
guest's port 8080 (QEMU: the forward its passt process gives; gVisor: one ``runsc
port-forward`` per connection). Plain TCP: HTTP, WebSockets and anything else pass
unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

from boxd.errors import BoxdError

log = logging.getLogger("boxd.node")

_CHUNK = 64 * 1024

#: Opens one connection to the machine's port 8080 (OSError: it does not answer).
Upstream = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
Connect = Callable[[str], AbstractAsyncContextManager[Upstream]]


class PortProxy:
    """Listening sockets per machine; ``connect(machine_id)`` yields how to open the
    upstream."""

    def __init__(self, connect: Connect) -> None:
        self._connect = connect
        self._servers: dict[str, asyncio.Server] = {}

    def is_open(self, machine_id: str) -> bool:
        return machine_id in self._servers

    async def open(self, machine_id: str, port: int) -> bool:
        """Start serving ``port`` for a machine; False if the port is taken."""
        if machine_id in self._servers:
            return True
        try:
            server = await asyncio.start_server(
                lambda r, w: self._serve(machine_id, r, w), "127.0.0.1", port,
                reuse_address=True,
            )
        except OSError as exc:
            log.warning("machine=%s event=url_port_taken port=%s error=%s", machine_id, port, exc)
            return False
        self._servers[machine_id] = server
        return True

    async def close(self, machine_id: str) -> None:
        server = self._servers.pop(machine_id, None)
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()

    async def close_all(self) -> None:
        for machine_id in list(self._servers):
            await self.close(machine_id)

    async def _serve(
        self, machine_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            async with self._connect(machine_id) as upstream:
                try:
                    up_r, up_w = await upstream()
                except OSError as exc:
                    await _refuse(writer, 502, f"the machine's port 8080 does not answer: {exc}")
                    return
                try:
                    await asyncio.gather(_pump(reader, up_w), _pump(up_r, writer))
                finally:
                    up_w.close()
        except BoxdError as exc:
            await _refuse(writer, 503 if exc.status >= 500 else exc.status, exc.message)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy until EOF, with back-pressure (``drain``); half-close the other side.

    A side that fails (reset, broken pipe) closes the other side outright, so the peer
    sees the end instead of waiting for an answer: a forward into a gVisor sandbox that
    is refused resets the stream when the request is already written to it.
    """
    try:
        while data := await src.read(_CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        dst.close()


async def _refuse(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    """Answer an HTTP client that the machine could not be reached (best effort)."""
    body = (message + "\n").encode()
    head = (f"HTTP/1.1 {status} boxd\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    with contextlib.suppress(Exception):
        writer.write(head + body)
        await writer.drain()


__all__ = ["Connect", "PortProxy", "Upstream"]
