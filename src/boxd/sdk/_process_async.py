"""`AsyncProcessHandle`: a process started with ``AsyncBoxd.machines.spawn``.

The one source of both handles: ``scripts/gen_sync.py`` writes ``_process_sync.py``
from this file. Each handle holds one WebSocket to the daemon; each binary message is
one frame of the process's stdin or stdout.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from boxd import errors
from boxd.sdk import _base, _local

if TYPE_CHECKING:
    from boxd import process_models as pm
    from boxd.sdk._ws_async import AsyncWebSocket

__all__ = ["AsyncProcessHandle"]


class _Client(Protocol):
    """What a handle needs of its client (``AsyncBoxd``; no import: the client imports us)."""

    _target: _base.Target

    async def _parse(self, model: type[_base.M], req: _base.Req) -> _base.M: ...


class AsyncProcessHandle:
    """A long-lived process in a machine with a framed message stream.

    ``await send(bytes)`` writes one frame to its stdin; ``await recv()`` returns the
    next frame it wrote to stdout. Closing the handle detaches from the stream; the
    process keeps running (``kill()`` ends it). Not for concurrent use.
    """

    def __init__(self, client: _Client, ref: str, info: pm.Process) -> None:
        self._c = client
        self._ref = ref
        self.info = info
        self._ws: AsyncWebSocket | None = None
        self._exit: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    @property
    def id(self) -> str:
        """The process's id (the same in a fork child's copy)."""
        return self.info.id

    @property
    def machine(self) -> str:
        """The id of its machine."""
        return self.info.machine

    @property
    def exit_code(self) -> int | None:
        """Its exit status once `recv` has seen it exit, else None."""
        return None if self._exit is None else self._exit.get("exit_code")

    async def attach(self) -> None:
        """Open the stream now (`send` and `recv` open it on first use).

        Raises:
            NotFound: no such process; Conflict: another client holds its stream;
            MachineFailed: it cannot be re-attached; ConnectionError.
        """
        await self._conn()

    async def _conn(self) -> AsyncWebSocket:
        ws = self._ws
        if ws is not None:
            return ws
        async with self._lock:
            if self._ws is None:
                self._ws = await self._open()
            return self._ws

    async def _open(self) -> AsyncWebSocket:
        from websockets.exceptions import InvalidHandshake, WebSocketException

        from boxd.sdk._ws_async import AsyncWebSocket

        t = self._c._target
        if t.local:
            await asyncio.to_thread(_local.ensure_daemon, t.paths)
        key = t.api_key or _local.read_local_key(t.paths)
        url = _base.stream_url(t, self._ref, self.id)
        try:
            ws = await AsyncWebSocket.connect(
                url, uds=str(t.uds) if t.uds is not None else None,
                headers=_base.headers(key), max_size=_base.MAX_MESSAGE + 1024,
                timeout=_base.STREAM_OPEN_TIMEOUT,
            )
            first = await ws.recv(timeout=_base.STREAM_OPEN_TIMEOUT)
        except (OSError, InvalidHandshake, WebSocketException, TimeoutError) as exc:
            raise errors.ConnectionError(
                f"cannot open the stream of process {self.id} at {t.where}: {exc}",
                hint=f"is the daemon running? its log is {t.paths.log}") from exc
        msg = _base.stream_control(first)
        if msg.get("type") != "attached":
            await ws.close()
            raise _base.stream_error(msg)
        return ws

    async def send(self, data: bytes) -> None:
        """Write one message (one frame on the process's stdin).

        Raises:
            InvalidRequest: the message is too large; ConnectionError: the stream broke.
        """
        if len(data) > _base.MAX_MESSAGE:
            raise errors.InvalidRequest(
                f"message of {len(data)} bytes exceeds {_base.MAX_MESSAGE}", field="data")
        from websockets.exceptions import ConnectionClosed

        try:
            await (await self._conn()).send(data)
        except (ConnectionClosed, OSError) as exc:  # OSError: the socket broke (EPIPE)
            raise await self._closed(exc) from exc

    async def recv(self, timeout: float | None = None) -> bytes:
        """The next message the process wrote.

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds.
            Conflict: the process has exited (``exit_code`` in ``details``).
            MachineFailed: its stream was lost; ConnectionError: the daemon went away.
        """
        from websockets.exceptions import ConnectionClosed

        if self._exit is not None:
            raise _base.process_exited(self.id, self._exit)
        try:
            ws = await self._conn()
            msg = await ws.recv(timeout=timeout)
        except ConnectionClosed as exc:
            raise await self._closed(exc) from exc
        if isinstance(msg, bytes):
            return msg
        control = _base.stream_control(msg)
        await self._drop()
        if control.get("type") == "exit":
            self._exit = control
            raise _base.process_exited(self.id, control)
        raise _base.stream_error(control)

    async def _closed(self, exc: Exception) -> errors.BoxdError:
        await self._drop()
        return errors.ConnectionError(f"the stream of process {self.id} closed: {exc}",
                                      hint="attach() again; the process may still run")

    async def _drop(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()

    async def kill(self, signal: int = 9) -> pm.Process:
        """Signal the process's group (SIGKILL by default).

        Raises:
            NotFound, MachineNotFound, MachineFailed.
        """
        from boxd import process_models as pm

        req = _base.process_kill(self._ref, self.id, signal)
        self.info = await self._c._parse(pm.Process, req)
        return self.info

    async def close(self) -> None:
        """Detach from the stream; the process keeps running."""
        await self._drop()

    async def __aenter__(self) -> AsyncProcessHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncProcessHandle {self.id} in {self.machine}>"
