"""The URL proxy's relay (node/_proxy.py) over real loopback sockets, with upstreams
that behave as a machine's port can: answer, refuse, or reset mid-request.

The machine side is covered end to end by the URL tests in tests/integration
(test_lifecycle.py on QEMU, test_gvisor.py on gVisor).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

from boxd.node._ports import free_port
from boxd.node._proxy import PortProxy, Upstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _relay(handler: Handler | None, request: bytes, timeout: float = 5.0,
                 half_close: bool = False) -> bytes:
    """Send ``request`` through a proxy whose upstream runs ``handler`` (None: nothing
    listens), half-close if asked, and return everything the proxy sent back until it
    closed."""
    up = None
    if handler is not None:
        up = await asyncio.start_server(handler, "127.0.0.1", 0)
    up_port = up.sockets[0].getsockname()[1] if up is not None else free_port()

    @contextlib.asynccontextmanager
    async def connect(machine_id: str) -> AsyncIterator[Upstream]:
        yield lambda _port: asyncio.open_connection("127.0.0.1", up_port)

    proxy = PortProxy(connect)
    port = free_port()
    assert await proxy.open("m", port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        if half_close:
            writer.write_eof()
        await writer.drain()
        got = await asyncio.wait_for(reader.read(), timeout)
        writer.close()
        return got
    finally:
        await proxy.close_all()
        if up is not None:
            up.close()


def test_bytes_pass_both_ways_and_the_end_of_the_request_reaches_the_machine() -> None:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read()  # until the client's half-close comes through
        w.write(b"got " + data)
        await w.drain()
        w.close()

    assert asyncio.run(_relay(echo, b"hello", half_close=True)) == b"got hello"


def test_a_port_nothing_listens_on_is_a_502_that_says_so() -> None:
    got = asyncio.run(_relay(None, b"GET / HTTP/1.0\r\n\r\n"))
    assert got.startswith(b"HTTP/1.1 502 ")
    assert b"port 8080 does not answer" in got


def test_an_upstream_that_resets_mid_request_ends_the_client_connection() -> None:
    """A gVisor sandbox whose port refuses the forward resets the stream after the
    request was written into it; the client must see the end, not wait forever."""

    async def reset(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(1)  # the request arrived, most of it unread
        sock = w.get_extra_info("socket")
        # SO_LINGER 0: close sends a reset, not a FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.transport.abort()

    got = asyncio.run(_relay(reset, b"GET / HTTP/1.0\r\nHost: x\r\n\r\n" + b"x" * 4096))
    assert got == b""  # closed without an answer: the client retries, as on a refusal


def test_an_upstream_that_closes_at_once_ends_the_client_connection() -> None:
    async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    assert asyncio.run(_relay(hang_up, b"GET / HTTP/1.0\r\n\r\n")) == b""


def test_a_tcp_upstream_is_asked_to_ack_at_once_after_every_read(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # QEMU's passt writes a response in two segments without TCP_NODELAY: the second
    # waited for a delayed ACK (~40 ms a request on a kept-alive connection) until the
    # proxy asked for TCP_QUICKACK after every read of the guest's side. The speed is
    # bench/bench_urls.py's; here: that it is asked for, on TCP upstreams only.
    from boxd.node import _proxy

    calls: list[int] = []
    real = _proxy._quickack

    def spy(writer: asyncio.StreamWriter) -> Callable[[], None]:
        family = writer.get_extra_info("socket").family
        quick = real(writer)

        def counted() -> None:
            calls.append(family)
            quick()

        return counted

    monkeypatch.setattr(_proxy, "_quickack", spy)

    async def answer_in_parts(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        for part in (b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n", b"ok", b"ok"):
            w.write(part)
            await w.drain()
            await asyncio.sleep(0.05)  # separate segments, separate reads
        w.close()

    got = asyncio.run(_relay(answer_in_parts, b"GET /t HTTP/1.1\r\nhost: x\r\n\r\n"))
    assert got.endswith(b"okok")
    assert len(calls) >= 2 and set(calls) == {socket.AF_INET}

