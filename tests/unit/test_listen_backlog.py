"""The daemon's listening sockets queue a burst of connections (issue: races under load).

300 clients connecting while the event loop is busy (here: never accepting) all get
connected: with the old backlog of 128 the 129th unix-socket connect failed at once
(EAGAIN) and TCP handshakes were dropped (retried after 1, 3, 7… s, or reset).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from boxd.api.server import _tcp_socket, _unix_socket

BURST = 300


@pytest.mark.skipif(socket.SOMAXCONN < BURST, reason="the kernel caps the backlog lower")
def test_a_burst_of_unix_socket_connects_is_queued(tmp_path: Path) -> None:
    path = tmp_path / "boxd.sock"
    server = _unix_socket(path)
    clients: list[socket.socket] = []
    try:
        for i in range(BURST):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            clients.append(c)
            c.setblocking(False)
            try:
                c.connect(str(path))
            except BlockingIOError:
                pytest.fail(f"connect {i + 1} of {BURST} refused: the backlog is full")
    finally:
        for c in clients:
            c.close()
        server.close()


@pytest.mark.skipif(socket.SOMAXCONN < BURST, reason="the kernel caps the backlog lower")
def test_a_burst_of_tcp_connects_completes_its_handshakes() -> None:
    server = _tcp_socket("127.0.0.1", 0)
    port = server.getsockname()[1]
    clients: list[socket.socket] = []
    try:
        for i in range(BURST):
            try:  # a dropped SYN is retried after 1 s: longer than this
                c = socket.create_connection(("127.0.0.1", port), timeout=0.9)
            except TimeoutError:
                pytest.fail(f"connect {i + 1} of {BURST} not answered: the backlog is full")
            clients.append(c)
        queued = _accept_all(server)
        assert queued == BURST, f"{queued} of {BURST} connections reached the daemon"
    finally:
        for c in clients:
            c.close()
        server.close()


def _accept_all(server: socket.socket) -> int:
    n = 0
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1
