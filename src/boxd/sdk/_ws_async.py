"""The async twin of `SyncWebSocket`: websockets' asyncio client behind the same calls.

`connect(url, uds=, headers=, max_size=, timeout=)`, `send`, `recv(timeout=)` and
`close` have `SyncWebSocket`'s names and arguments, so that ``_process_async.py`` is the
one source of both process handles (``scripts/gen_sync.py`` writes the sync one).

Errors are websockets' own, as in `SyncWebSocket`: `InvalidHandshake` for a refused
upgrade, `ConnectionClosed` once the connection is closed, `TimeoutError` when nothing
arrived in time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

__all__ = ["AsyncWebSocket"]


class AsyncWebSocket:
    """One client WebSocket on the running event loop."""

    def __init__(self, conn: ClientConnection) -> None:
        self._conn = conn

    @classmethod
    async def connect(
        cls, url: str, *, uds: str | None, headers: Mapping[str, str], max_size: int,
        timeout: float,
    ) -> AsyncWebSocket:
        """Open ``url`` (over the unix socket ``uds`` when given) and do the handshake.

        Raises:
            OSError: the connection failed; TimeoutError: no answer within ``timeout``;
            websockets.exceptions.InvalidHandshake: the server refused the upgrade.
        """
        from websockets.asyncio.client import connect, unix_connect

        opts: dict[str, Any] = {
            "additional_headers": dict(headers), "compression": None, "max_size": max_size,
            "open_timeout": timeout, "ping_interval": None, "max_queue": None,
        }
        if uds is not None:
            return cls(await unix_connect(uds, url, **opts))
        return cls(await connect(url, proxy=None, **opts))

    async def send(self, data: bytes) -> None:
        """Send one binary message."""
        await self._conn.send(data)

    async def recv(self, timeout: float | None = None) -> bytes | str:
        """The next message.

        Raises:
            TimeoutError: none arrived within ``timeout`` seconds.
            websockets.exceptions.ConnectionClosed: the connection is closed.
        """
        if timeout is None:
            return await self._conn.recv()
        return await asyncio.wait_for(self._conn.recv(), timeout=timeout)

    async def close(self) -> None:
        """Run the closing handshake and close the socket."""
        await self._conn.close()
