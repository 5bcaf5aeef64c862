"""A WebSocket client connection driven in the caller's thread (websockets' Sans-I/O).

websockets' threaded client reads the socket in a background thread and hands every
message to the caller through a condition variable: two thread switches per message,
on a path (a process's step channel) whose whole round trip is about a millisecond. A
`ProcessHandle` is used from one thread at a time, request then reply, so it drives
websockets' own protocol object (`websockets.client.ClientProtocol`: the handshake,
framing, masking, ping/pong and the closing handshake) on a blocking socket itself.

Errors are websockets' own: `InvalidHandshake` for a refused upgrade, `ConnectionClosed`
once the connection is closed, `TimeoutError` when nothing arrived in time.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import ssl
import time
from collections.abc import Mapping

from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosedError
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import WebSocketURI, parse_uri

__all__ = ["SyncWebSocket"]

_READ = 256 * 1024


class SyncWebSocket:
    """One client WebSocket; `send` and `recv` run the protocol in the calling thread."""

    def __init__(self, sock: socket.socket, protocol: ClientProtocol) -> None:
        self._sock = sock
        self._proto = protocol
        self._messages: collections.deque[bytes | str] = collections.deque()
        self._parts: list[bytes] = []
        self._text = False

    @classmethod
    def connect(
        cls, url: str, *, uds: str | None, headers: Mapping[str, str], max_size: int,
        timeout: float,
    ) -> SyncWebSocket:
        """Open ``url`` (over the unix socket ``uds`` when given) and do the handshake.

        Raises:
            OSError: the connection failed; TimeoutError: no answer within ``timeout``;
            websockets.exceptions.InvalidHandshake: the server refused the upgrade.
        """
        uri = parse_uri(url)
        sock = _open_socket(uri, uds, timeout)
        try:
            ws = cls(sock, ClientProtocol(uri, max_size=max_size))
            ws._handshake(headers, timeout)
            return ws
        except BaseException:
            sock.close()
            raise

    def send(self, data: bytes) -> None:
        """Send one binary message.

        Raises:
            ConnectionClosed: the connection is closed.
        """
        if self._proto.state is not State.OPEN:
            raise self._closed()
        self._proto.send_binary(data)
        self._flush()

    def recv(self, timeout: float | None = None) -> bytes | str:
        """The next message (bytes for binary, str for text).

        Raises:
            TimeoutError: none arrived within ``timeout`` seconds.
            ConnectionClosed: the connection closed before one did.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._messages:
            if self._proto.state is State.CLOSED:
                raise self._closed()
            for event in self._read(deadline):
                if isinstance(event, Frame):
                    self._frame(event)
        return self._messages.popleft()

    def close(self) -> None:
        """Start the closing handshake (best effort) and close the socket."""
        try:
            if self._proto.state is State.OPEN:
                self._proto.send_close()
                self._flush()
        except OSError:
            pass
        finally:
            self._sock.close()

    # ------------------------------------------------------------------ internals

    def _handshake(self, headers: Mapping[str, str], timeout: float) -> None:
        """Send the upgrade request with ``headers``; wait ``timeout`` for the answer."""
        protocol = self._proto
        request = protocol.connect()
        for name, value in headers.items():
            if name in request.headers:
                del request.headers[name]  # ours replace websockets' defaults
            request.headers[name] = value
        protocol.send_request(request)
        self._flush()
        deadline = time.monotonic() + timeout
        answered = False
        while not answered:
            for event in self._read(deadline):  # the reply, maybe the first messages
                if isinstance(event, Response):
                    if protocol.handshake_exc is not None:
                        raise protocol.handshake_exc
                    answered = True
                elif isinstance(event, Frame):
                    self._frame(event)

    def _read(self, deadline: float | None) -> list[object]:
        """Read what the socket has (waiting until ``deadline``); the events it made."""
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message arrived in time")
            self._sock.settimeout(left)
        else:
            self._sock.settimeout(None)
        try:
            data = self._sock.recv(_READ)
        except TimeoutError:
            raise
        except OSError as exc:  # reset by the peer
            self._proto.receive_eof()
            self._sock.close()
            raise ConnectionClosedError(None, None) from exc
        if data:
            self._proto.receive_data(data)
        else:
            self._proto.receive_eof()
        self._flush()  # pongs and the closing handshake's reply
        events: list[object] = list(self._proto.events_received())
        if not data and not events and self._proto.state is not State.CLOSED:
            raise self._closed()
        return events

    def _frame(self, frame: Frame) -> None:
        payload = frame.data if isinstance(frame.data, bytes) else bytes(frame.data)
        if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
            self._text, self._parts = frame.opcode is Opcode.TEXT, [payload]
        elif frame.opcode is Opcode.CONT:
            self._parts.append(payload)
        else:
            return  # ping, pong, close: the protocol answers them itself
        if frame.fin:
            data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
            self._parts = []
            self._messages.append(data.decode() if self._text else data)

    def _flush(self) -> None:
        for chunk in self._proto.data_to_send():
            if chunk:
                self._sock.sendall(chunk)
            else:  # the protocol asks to half-close after the closing handshake
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_WR)

    def _closed(self) -> Exception:
        """The ConnectionClosed to raise (websockets' own once the state is CLOSED)."""
        if self._proto.state is State.CLOSED:
            return self._proto.close_exc
        p = self._proto
        return ConnectionClosedError(p.close_rcvd, p.close_sent, p.close_rcvd_then_sent)


def _open_socket(uri: WebSocketURI, uds: str | None, timeout: float) -> socket.socket:
    """A socket connected to ``uri``'s server (over the unix socket ``uds`` when given).

    Over TCP: without Nagle's delay, and in TLS for ``wss``.
    """
    if uds is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(uds)
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.create_connection((uri.host, uri.port), timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if uri.secure:
            return ssl.create_default_context().wrap_socket(sock, server_hostname=uri.host)
    except BaseException:
        sock.close()
        raise
    return sock
