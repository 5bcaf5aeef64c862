"""`SyncWebSocket`: the process handle's WebSocket, driven in the caller's thread.

Against a real websockets server on a unix socket (its own event loop in a thread).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.asyncio.server import ServerConnection, unix_serve
from websockets.exceptions import ConnectionClosed, InvalidStatus

from boxd.sdk._ws_sync import SyncWebSocket

pongs: list[float] = []


async def _handler(ws: ServerConnection) -> None:
    if ws.request is not None and ws.request.headers.get("X-Test") != "yes":
        await ws.close(4001, "no header")
        return
    await ws.send("hello")  # right after the handshake: often in the same read
    async for msg in ws:
        if msg == b"fragments":
            await ws.send([b"ab", b"cd", b"ef"])  # one message in three frames
        elif msg == b"ping":
            t = time.monotonic()
            await (await ws.ping())  # answered while the client reads
            pongs.append(time.monotonic() - t)
            await ws.send(b"ponged")
        elif msg == b"bye":
            await ws.close(1000, "done")
            return
        else:
            await ws.send(msg)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "ws.sock")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: asyncio.Future[None] | None = None

    async def main() -> None:
        nonlocal stop
        stop = loop.create_future()
        async with unix_serve(_handler, path, ping_interval=None):
            ready.set()
            await stop

    t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    t.start()
    assert ready.wait(10)
    yield path
    loop.call_soon_threadsafe(lambda: stop is not None and stop.set_result(None))
    t.join(10)


def _open(path: str, **headers: str) -> SyncWebSocket:
    return SyncWebSocket.connect("ws://localhost/x", uds=path,
                                 headers={"X-Test": "yes", **headers}, max_size=1 << 20,
                                 timeout=10)


def test_messages_both_ways_and_the_first_one_after_the_handshake(server: str) -> None:
    ws = _open(server)
    assert ws.recv(timeout=10) == "hello"  # text stays str
    for i in range(200):
        ws.send(i.to_bytes(4, "big") * 25)
        assert ws.recv(timeout=10) == i.to_bytes(4, "big") * 25
    ws.close()


def test_a_fragmented_message_is_one_message(server: str) -> None:
    ws = _open(server)
    ws.recv(timeout=10)
    ws.send(b"fragments")
    assert ws.recv(timeout=10) == b"abcdef"
    ws.close()


def test_pings_are_answered_while_reading(server: str) -> None:
    ws = _open(server)
    ws.recv(timeout=10)
    ws.send(b"ping")
    assert ws.recv(timeout=10) == b"ponged"
    assert pongs  # the server got its pong
    ws.close()


def test_a_timeout_leaves_the_connection_usable(server: str) -> None:
    ws = _open(server)
    ws.recv(timeout=10)
    with pytest.raises(TimeoutError):
        ws.recv(timeout=0.05)
    ws.send(b"still")
    assert ws.recv(timeout=10) == b"still"
    ws.close()


def test_the_server_closing_is_connection_closed(server: str) -> None:
    ws = _open(server)
    ws.recv(timeout=10)
    ws.send(b"bye")
    with pytest.raises(ConnectionClosed) as info:
        ws.recv(timeout=10)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1000
    with pytest.raises(ConnectionClosed):
        ws.send(b"after")
    ws.close()  # idempotent


def test_headers_are_sent_and_a_refused_upgrade_raises(server: str, tmp_path: Path) -> None:
    ws = SyncWebSocket.connect("ws://localhost/x", uds=server, headers={}, max_size=1 << 20,
                               timeout=10)
    with pytest.raises(ConnectionClosed) as info:  # the handler refused: no X-Test
        ws.recv(timeout=10)
    assert info.value.rcvd is not None and info.value.rcvd.code == 4001
    with pytest.raises(OSError):
        _open(str(tmp_path / "nothing.sock"))


def test_a_non_websocket_answer_is_invalid_status(tmp_path: Path) -> None:
    import socket

    path = str(tmp_path / "http.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()

    def answer() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer)
    t.start()
    with pytest.raises(InvalidStatus):
        _open(path)
    t.join()
    srv.close()


def test_sending_while_the_close_is_under_way_is_connection_closed(tmp_path: Path) -> None:
    # The server sends its close frame but keeps the socket open: the client answers
    # the close (CLOSING) and a send then raises ConnectionClosed, not an assertion.
    import socket

    from websockets.protocol import State
    from websockets.server import ServerProtocol

    path = str(tmp_path / "closing.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    done = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        proto = ServerProtocol()
        while proto.state is State.CONNECTING:
            proto.receive_data(conn.recv(65536))
            for req in proto.events_received():
                proto.send_response(proto.accept(req))  # type: ignore[arg-type]
        proto.send_close(1001, "going away")
        conn.sendall(b"".join(proto.data_to_send()))
        done.wait(10)
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    ws = SyncWebSocket.connect("ws://localhost/x", uds=path, headers={}, max_size=1 << 20,
                               timeout=10)
    with pytest.raises(TimeoutError):
        ws.recv(timeout=0.5)  # reads the close frame, answers it; TCP stays open
    with pytest.raises(ConnectionClosed):
        ws.send(b"late")
    done.set()
    t.join()
    ws.close()
    srv.close()
