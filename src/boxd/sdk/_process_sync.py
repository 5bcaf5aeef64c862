# Generated from _process_async.py by scripts/gen_sync.py: edit that file, then run it.
"""`ProcessHandle`: a process started with ``boxd.machines.spawn`` (sync).

Generated from ``_process_async.py``. Each handle holds one WebSocket to the daemon
(`SyncWebSocket`, driven in the caller's thread); each binary message is one frame of
the process's stdin or stdout.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from boxd import errors
from boxd.sdk import _base, _local

if TYPE_CHECKING:
    from boxd import process_models as pm
    from boxd.sdk._ws_sync import SyncWebSocket

__all__ = ["ProcessHandle"]


class _Client(Protocol):
    """What a handle needs of its client (``Boxd``; no import: the client imports us)."""

    _target: _base.Target

    def _parse(self, model: type[_base.M], req: _base.Req) -> _base.M: ...


class ProcessHandle:
    """A long-lived process in a machine with a framed message stream.

    ``send(bytes)`` writes one frame to its stdin; ``recv()`` returns the
    next frame it wrote to stdout. Closing the handle detaches from the stream; the
    process keeps running (``kill()`` ends it). Not for concurrent use.
    """

    def __init__(self, client: _Client, ref: str, info: pm.Process) -> None:
        self._c = client
        self._ref = ref
        self.info = info
        self._ws: SyncWebSocket | None = None
        self._exit: dict[str, Any] | None = None
        self._lock = threading.Lock()

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

    def attach(self) -> None:
        """Open the stream now (`send` and `recv` open it on first use).

        Raises:
            NotFound: no such process; Conflict: another client holds its stream;
            MachineFailed: it cannot be re-attached; ConnectionError.
        """
        self._conn()

    def _conn(self) -> SyncWebSocket:
        ws = self._ws
        if ws is not None:
            return ws
        with self._lock:
            if self._ws is None:
                self._ws = self._open()
            return self._ws

    def _open(self) -> SyncWebSocket:
        from websockets.exceptions import InvalidHandshake, WebSocketException

        from boxd.sdk._ws_sync import SyncWebSocket

        t = self._c._target
        if t.local:
            _local.ensure_daemon(t.paths)
        key = t.api_key or _local.read_local_key(t.paths)
        url = _base.stream_url(t, self._ref, self.id)
        try:
            ws = SyncWebSocket.connect(
                url, uds=str(t.uds) if t.uds is not None else None,
                headers=_base.headers(key), max_size=_base.MAX_MESSAGE + 1024,
                timeout=_base.STREAM_OPEN_TIMEOUT,
            )
            first = ws.recv(timeout=_base.STREAM_OPEN_TIMEOUT)
        except (OSError, InvalidHandshake, WebSocketException, TimeoutError) as exc:
            raise errors.ConnectionError(
                f"cannot open the stream of process {self.id} at {t.where}: {exc}",
                hint=f"is the daemon running? its log is {t.paths.log}") from exc
        msg = _base.stream_control(first)
        if msg.get("type") != "attached":
            ws.close()
            raise _base.stream_error(msg)
        return ws

    def send(self, data: bytes) -> None:
        """Write one message (one frame on the process's stdin).

        Raises:
            InvalidRequest: the message is too large; ConnectionError: the stream broke.
        """
        if len(data) > _base.MAX_MESSAGE:
            raise errors.InvalidRequest(
                f"message of {len(data)} bytes exceeds {_base.MAX_MESSAGE}", field="data")
        from websockets.exceptions import ConnectionClosed

        try:
            self._conn().send(data)
        except (ConnectionClosed, OSError) as exc:  # OSError: the socket broke (EPIPE)
            raise self._closed(exc) from exc

    def recv(self, timeout: float | None = None) -> bytes:
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
            ws = self._conn()
            msg = ws.recv(timeout=timeout)
        except ConnectionClosed as exc:
            raise self._closed(exc) from exc
        if isinstance(msg, bytes):
            return msg
        control = _base.stream_control(msg)
        self._drop()
        if control.get("type") == "exit":
            self._exit = control
            raise _base.process_exited(self.id, control)
        raise _base.stream_error(control)

    def _closed(self, exc: Exception) -> errors.BoxdError:
        self._drop()
        return errors.ConnectionError(f"the stream of process {self.id} closed: {exc}",
                                      hint="attach() again; the process may still run")

    def _drop(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.close()

    def kill(self, signal: int = 9) -> pm.Process:
        """Signal the process's group (SIGKILL by default).

        Raises:
            NotFound, MachineNotFound, MachineFailed.
        """
        from boxd import process_models as pm

        req = _base.process_kill(self._ref, self.id, signal)
        self.info = self._c._parse(pm.Process, req)
        return self.info

    def close(self) -> None:
        """Detach from the stream; the process keeps running."""
        self._drop()

    def __enter__(self) -> ProcessHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ProcessHandle {self.id} in {self.machine}>"
