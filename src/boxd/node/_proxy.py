"""Machine URLs: a TCP port the daemon holds per machine, relayed to the guest.

A machine's URL (``http://127.0.0.1:PORT/TOKEN``) is a listening socket of the daemon,
not of QEMU, so it stays the same while the VM process comes and goes (checkpoint
restore, hibernate and wake, a daemon restart). The port is on the host's loopback,
which every local user reaches, so the URL carries a per-machine token (a new one with
each machine) as its first path segment:

- A connection's first bytes must be an HTTP request whose path starts with the token
  (``/TOKEN/rest`` reaches the guest's port 8080 as ``/rest``; ``/TOKEN.8000/rest`` its
  port 8000), or whose ``Referer`` does (a browser following the page's own absolute
  links). Anything else gets a 404 from the proxy itself: nothing reaches the guest and
  nothing wakes the machine.
- Once the first request is admitted the connection belongs to that client: each later
  request on it (keep-alive, pipelining) has ``/TOKEN`` removed from its head when it
  carries it and passes as it is when not; an upgraded connection (WebSocket) or a
  ``CONNECT`` tunnel is relayed byte for byte from there on.
- A machine created ``public`` has the bare ``http://127.0.0.1:PORT``: every connection
  is relayed byte for byte (any TCP protocol) to its port 8080, as before tokens.

An admitted connection wakes a suspended or hibernated machine first (the node's
``connect``), counts as activity, keeps the machine awake while it is open, and is
relayed to a connection the engine opens to that guest port (`MachineHandle.open_http`:
QEMU's port 8080 is the forward its passt process gives, another port a dialer process
in the guest; gVisor: a dialer process in the sandbox for every port).

A VM process that has not yet answered through the URL (just booted, woken or
restored) may drop the first connections into it: its server is not listening yet, or
(QEMU, before the engine's `announce-self`) passt's connect into it waited 10 s and
gave up, ending the host side with no byte. Until a process first answers, the proxy
keeps the client's bytes (up to `REPLAY_LIMIT`) and, when the guest's side ends or fails
before its first byte, opens the forward again and resends them, for up to `WAKE_GRACE`
seconds; so the request that wakes a machine is the one served. A process that has
answered once is trusted: a later connection that ends with no byte ends the client's
the same way at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import NamedTuple

from boxd.errors import BoxdError
from boxd.state.records import MachineRecord

log = logging.getLogger("boxd.node")

_CHUNK = 64 * 1024
#: The longest request head (request line and headers) the proxy reads.
HEAD_LIMIT = 64 * 1024
#: Seconds a new connection has to send its first request head.
HEAD_TIMEOUT = 30.0
#: Seconds a VM process that has not answered yet gets to answer a connection.
WAKE_GRACE = 30.0
#: Client bytes kept for a resend while the guest has not answered (past it: no resend).
REPLAY_LIMIT = 1024 * 1024

#: The guest port a URL without a port suffix (and every public machine's) reaches.
DEFAULT_PORT = 8080

#: Opens one connection to a guest port of the machine (OSError: it does not answer).
Upstream = Callable[[int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
_Open = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
Connect = Callable[[str], AbstractAsyncContextManager[Upstream]]


class Access(NamedTuple):
    """What the proxy needs of a machine's record."""

    token: str | None  # the URL's token; None with public False: nothing is admitted
    public: bool  # no token required: a byte-for-byte relay
    process: object  # identifies its current VM process (a new value: not answered yet)


#: A machine's `Access` now (None: no such machine).
AccessOf = Callable[[str], Access | None]


class PortProxy:
    """Listening sockets per machine; ``connect(machine_id)`` yields how to open the
    upstream. ``access`` says who may use each machine's URL; without it every URL is
    a plain relay (tests of the relay itself)."""

    def __init__(self, connect: Connect, access: AccessOf | None = None) -> None:
        self._connect = connect
        self._access = access
        self._servers: dict[str, asyncio.Server] = {}
        self._answered: dict[str, object] = {}  # machine id -> a process that answered

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
        self._answered.pop(machine_id, None)
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
            admitted = await self._admit(machine_id, reader, writer)
            if admitted is None:
                return
            source, port = admitted
            async with self._connect(machine_id) as open_port:

                def upstream() -> Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
                    return open_port(port)

                now = self._access(machine_id) if self._access is not None else None
                process = now.process if now is not None else None
                fresh = process is not None and self._answered.get(machine_id) != process

                def answered() -> None:
                    if process is not None:
                        self._answered[machine_id] = process

                await _relay(source, writer, upstream, fresh, answered, machine_id, port)
        except BoxdError as exc:
            await _refuse(writer, 503 if exc.status >= 500 else exc.status, exc.message)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _admit(
        self, machine_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[AsyncIterator[bytes], int] | None:
        """The client's bytes to relay (token checked and stripped) and the guest port
        they go to, or None: refused."""
        access = self._access(machine_id) if self._access is not None else Access(None, True, None)
        if access is not None and access.public:
            return _raw(reader), DEFAULT_PORT
        try:
            head = await asyncio.wait_for(_read_head(reader), HEAD_TIMEOUT)
        except (TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError):
            head = b""
        token = access.token if access is not None else None
        port = _carries(head, token) if head and token else None
        if port is None:
            log.info("machine=%s event=url_refused reason=no_token", machine_id)
            await _refuse(writer, 404, "no such URL: use the machine's URL as given "
                          "(Machine.url, with its token; /TOKEN.PORT/ for another guest "
                          "port, 1-65535)")
            return None
        assert token is not None
        return _requests(reader, token.encode(), head), port


def _carries(head: bytes, token: str) -> int | None:
    """The guest port the request names if its path, or its Referer's, starts with the
    segment ``token`` (port 8080) or ``token.PORT``; None: it carries neither."""
    line, _, rest = head.partition(b"\r\n")
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return None
    want = token.encode()
    port = _port_of(_first_segment(parts[1]), want)
    if port is not None:
        return port
    for name, value in _headers(rest):
        if name == b"referer":
            path = _REFERER_PATH.match(value)
            if path and (port := _port_of(_first_segment(path.group(1)), want)) is not None:
                return port
    return None


def _port_of(segment: bytes, token: bytes) -> int | None:
    """``TOKEN`` -> 8080, ``TOKEN.PORT`` -> PORT (1-65535); None: not this token."""
    given, dot, suffix = segment.partition(b".")
    if not hmac.compare_digest(given, token):
        return None
    if not dot:
        return DEFAULT_PORT
    if not _PORT.fullmatch(suffix) or not 1 <= int(suffix) <= 65535:
        return None
    return int(suffix)


_REFERER_PATH = re.compile(rb"^https?://[^/?#]*(/[^?#]*)")
_SEGMENT_END = re.compile(rb"[/?#]")
_PORT = re.compile(rb"[1-9][0-9]{0,4}")


def _first_segment(target: bytes) -> bytes:
    if not target.startswith(b"/"):
        return b""
    return _SEGMENT_END.split(target[1:], maxsplit=1)[0]


def _headers(block: bytes) -> list[tuple[bytes, bytes]]:
    out = []
    for line in block.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            out.append((name.strip().lower(), value.strip()))
    return out


def _strip(head: bytes, token: bytes) -> bytes:
    """The head without ``/TOKEN`` or ``/TOKEN.PORT`` (its request target's first
    segment, a Referer's): the guest sees its own paths and never the token."""
    line, sep, rest = head.partition(b"\r\n")
    method, _, tail = line.partition(b" ")
    target, _, version = tail.rpartition(b" ")
    first = _first_segment(target)
    if _port_of(first, token) is not None:
        target = target[1 + len(first):]
        if not target.startswith(b"/"):
            target = b"/" + target
    rest = re.sub(b"/" + re.escape(token) + rb"(?:\.[0-9]{1,5})?", b"", rest)
    return method + b" " + target + b" " + version + sep + rest


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """One request head, through its blank line; b"" at EOF before any byte.

    Raises:
        ValueError: longer than `HEAD_LIMIT`, or the connection ended inside it.
    """
    buf = bytearray()
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if not buf and not exc.partial:
                return b""
            raise ValueError("the connection ended inside a request head") from exc
        except asyncio.LimitOverrunError as exc:
            raise ValueError("request head too long") from exc
        if not buf and line in (b"\r\n", b"\n"):
            continue  # blank lines before a request are allowed (RFC 9112 2.2)
        buf += line
        if len(buf) > HEAD_LIMIT:
            raise ValueError("request head too long")
        if line in (b"\r\n", b"\n"):
            return bytes(buf)


class _Unframed(Exception):
    """A body the proxy cannot frame: the rest of the stream is relayed as it is."""


async def _raw(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while data := await reader.read(_CHUNK):
        yield data


def _framing(head: bytes) -> tuple[str, int]:
    """How the body after a request head ends: ``("length", n)``, ``("chunked", 0)``,
    ``("none", 0)``; ``("raw", 0)`` when the rest of the stream is not HTTP's (an
    upgrade, a ``CONNECT``) or cannot be framed (another transfer coding, a bad
    length)."""
    line, _, block = head.partition(b"\r\n")
    values = {name: value.lower() for name, value in _headers(block)}
    if line.split(b" ", 1)[0] == b"CONNECT" or b"upgrade" in values.get(b"connection", b""):
        return "raw", 0  # whatever follows is the tunnel's, not HTTP's
    encoding = values.get(b"transfer-encoding", b"")
    if encoding:
        # Not chunked last: a body that ends with the connection.
        return ("chunked", 0) if encoding.endswith(b"chunked") else ("raw", 0)
    length = values.get(b"content-length")
    if length is None:
        return "none", 0
    return ("length", int(length)) if length.isdigit() else ("raw", 0)


async def _requests(
    reader: asyncio.StreamReader, token: bytes, head: bytes
) -> AsyncIterator[bytes]:
    """The client's requests, ``/TOKEN`` stripped from each head; the rest of the
    stream as it is after an upgrade, a ``CONNECT`` or a head the proxy cannot frame."""
    while head:
        yield _strip(head, token)
        kind, length = _framing(head)
        if kind == "raw":
            break
        if kind == "chunked":
            try:
                async for part in _chunked(reader):
                    yield part
            except _Unframed:
                break
        elif kind == "length":
            async for data in _exactly(reader, length):
                yield data
            if reader.at_eof():
                return
        head = await _read_head(reader)  # ValueError: the connection ends (see _relay)
    else:
        return
    async for data in _raw(reader):
        yield data


async def _exactly(reader: asyncio.StreamReader, n: int) -> AsyncIterator[bytes]:
    """The next ``n`` bytes as they come (fewer if the connection ends first)."""
    while n > 0:
        data = await reader.read(min(n, _CHUNK))
        if not data:
            return
        n -= len(data)
        yield data


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """A chunked body as it comes, through its last chunk and trailers."""
    while True:
        size_line = await reader.readuntil(b"\n")
        yield size_line
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise _Unframed from exc
        if size == 0:
            while (trailer := await reader.readuntil(b"\n")) not in (b"\r\n", b"\n"):
                yield trailer
            yield trailer
            return
        async for data in _exactly(reader, size + 2):  # the chunk and its CRLF
            yield data
        if reader.at_eof():
            return


_SOURCE_ERRORS = (ConnectionError, OSError, ValueError, asyncio.IncompleteReadError,
                  asyncio.LimitOverrunError)


async def _relay(
    source: AsyncIterator[bytes], client: asyncio.StreamWriter, upstream: _Open,
    fresh: bool, answered: Callable[[], None], machine_id: str = "-",
    port: int = DEFAULT_PORT,
) -> None:
    """Relay ``source`` to the guest and the guest's bytes back to ``client``.

    ``fresh``: the VM process has not answered yet; until the guest's first byte the
    client's bytes are kept and, when the guest's side ends or fails first, sent again
    on a new connection (up to `WAKE_GRACE` seconds, `REPLAY_LIMIT` bytes).
    """
    kept = _Kept(source)
    try:
        got = await kept.first_answer(client, upstream, fresh, machine_id, port)
        if got is None:
            return  # ended with no answer, as the guest's side did (or refused)
        up_r, up_w, first = got
        answered()
        kept.sent.clear()
        try:
            client.write(first)
            await client.drain()
            await asyncio.gather(
                _pump_source(source, up_w, kept.pull, kept.ended),
                _pump(up_r, client, _quickack(up_w)))
        finally:
            up_w.close()
    finally:
        if kept.pull is not None and not kept.pull.done():
            kept.pull.cancel()


def _quickack(writer: asyncio.StreamWriter) -> Callable[[], None]:
    """For a TCP upstream: ask the kernel to acknowledge what arrives at once
    (``TCP_QUICKACK``, which it drops again on its own, hence after every read).

    A forward that writes a response in two segments without ``TCP_NODELAY`` (QEMU's
    passt on the host side) holds the second until the first is acknowledged, and a
    delayed ACK waits ~40 ms: every request after the first on a kept-alive connection
    took 48 ms (docs/benchmarks.md, machine URLs).
    """
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return lambda: None

    def quick() -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    quick()
    return quick


class _Kept:
    """The client's side of `_relay` until the guest's first byte: the bytes sent so
    far (for a resend), whether the client half-closed, and the read in flight."""

    def __init__(self, source: AsyncIterator[bytes]) -> None:
        self.source = source
        self.sent: list[bytes] = []
        self.size = 0
        self.ended = False  # the client half-closed
        self.pull: asyncio.Task[bytes] | None = None

    async def first_answer(
        self, client: asyncio.StreamWriter, upstream: _Open, fresh: bool, machine_id: str,
        port: int,
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes] | None:
        """Open the guest's side and wait for its first byte, resending the kept bytes
        on a new connection while ``fresh`` and in grace; None when it ends without a
        byte, or does not open at all (the client then got a 502)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAKE_GRACE
        delay = 0.05
        while True:
            try:
                up_r, up_w = await upstream()
            except OSError as exc:
                if fresh and loop.time() < deadline:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                await _refuse(client, 502, f"the machine's port {port} does not answer: {exc}")
                return None
            try:
                first = await self._until_first_byte(up_r, up_w)
            except (ConnectionError, OSError):
                first = b""
            if first:
                return up_r, up_w, first
            up_w.close()
            if not fresh or self.size > REPLAY_LIMIT or loop.time() >= deadline:
                return None
            # The guest ended before a byte: a new forward, the same bytes.
            log.info("machine=%s event=url_resend bytes=%s", machine_id, self.size)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _until_first_byte(
        self, up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter
    ) -> bytes:
        """Send the kept bytes, then the client's as they come, until the guest's first
        bytes (b"" when its side ends first)."""
        for chunk in self.sent:
            up_w.write(chunk)
        if self.ended and up_w.can_write_eof():
            up_w.write_eof()
        await up_w.drain()
        read: asyncio.Task[bytes] = asyncio.ensure_future(up_r.read(_CHUNK))
        while not read.done():
            if self.pull is None and not self.ended and self.size <= REPLAY_LIMIT:
                self.pull = asyncio.ensure_future(anext(self.source, b""))
            waiting: set[asyncio.Future[bytes]] = {read}
            if self.pull is not None:
                waiting.add(self.pull)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if self.pull is not None and self.pull.done() and not read.done():
                await self._forward_pulled(up_w)
        return read.result()

    async def _forward_pulled(self, up_w: asyncio.StreamWriter) -> None:
        """The client's next bytes (done reading) to the guest, kept for a resend; the
        client's end (or its failure) as the guest's write EOF."""
        assert self.pull is not None
        try:
            data = self.pull.result()
        except _SOURCE_ERRORS:
            data = b""  # the client's side broke: end it as an EOF
        self.pull = None
        if not data:
            self.ended = True
            if up_w.can_write_eof():
                up_w.write_eof()
            return
        self.sent.append(data)
        self.size += len(data)
        up_w.write(data)
        await up_w.drain()


async def _pump_source(
    source: AsyncIterator[bytes], dst: asyncio.StreamWriter,
    pending: asyncio.Task[bytes] | None, ended: bool,
) -> None:
    """`_pump` for the client's side (after the guest's first byte)."""
    try:
        if not ended:
            if pending is not None:
                data = await pending
                while data:
                    dst.write(data)
                    await dst.drain()
                    data = await anext(source, b"")
            else:
                async for data in source:
                    dst.write(data)
                    await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
    except _SOURCE_ERRORS:
        dst.close()


async def _pump(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter,
    quick: Callable[[], None] = lambda: None,
) -> None:
    """Copy until EOF, with back-pressure (``drain``); half-close the other side;
    ``quick()`` after every read (`_quickack`).

    A side that fails (reset, broken pipe) closes the other side outright, so the peer
    sees the end instead of waiting for an answer: a forward into a gVisor sandbox that
    is refused resets the stream when the request is already written to it.
    """
    try:
        while data := await src.read(_CHUNK):
            quick()
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


def record_access(get: Callable[[str], MachineRecord | None]) -> AccessOf:
    """`AccessOf` from a node's machine records (``get``: by id)."""

    def access(machine_id: str) -> Access | None:
        rec = get(machine_id)
        if rec is None:
            return None
        return Access(rec.url_token, rec.url_public, (rec.vm_id, rec.pid))

    return access


__all__ = ["Access", "AccessOf", "Connect", "PortProxy", "Upstream", "record_access"]
