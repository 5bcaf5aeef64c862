"""`AgentClient.dial`: a TCP connection to a guest port through a dialer process that
the agent starts (``boxd-init --dial PORT``, or ``agent.py --dial PORT`` where the tree
has no boxd-init), the path of every gVisor machine URL and of QEMU's URLs to ports
other than 8080. Real agent, real dialer, a real TCP server on the host's loopback
standing for the guest's."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._support import agent_guest as ta

from boxd.engine.agent import AgentClient

pytestmark = pytest.mark.timeout(120)

guest = ta.guest  # fixtures


@pytest.fixture(params=["boxd-init", "agent.py"])
def tree(request: pytest.FixtureRequest, tmp_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An agent tree holding the dialer named (boxd-init is left out for agent.py)."""
    root = tmp_path / "tree"
    root.mkdir()
    (root / "agent.py").symlink_to(ta.AGENT)
    if request.param == "boxd-init":
        (root / "boxd-init").symlink_to(ta.init_binary(tmp_path_factory))
    return root


@pytest.fixture
def echo() -> Iterator[int]:
    """A TCP echo server on 127.0.0.1 (one thread per connection); yields its port."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(5)
    srv.close()


def _dialers() -> list[str]:
    """Processes on this host whose argv has ``--dial`` as an argument of its own."""
    found = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"\0--dial\0" in p.read_bytes():
                found.append(p.parent.name)
        except OSError:
            pass
    return found


def test_a_dialed_port_carries_bytes_both_ways_and_ends_with_its_connection(
    guest: ta.Guest, tree: Path, echo: int
) -> None:
    before = set(_dialers())
    payload = os.urandom(1 << 20)  # past any one frame, window or segment

    async def body(c: AgentClient) -> None:
        reader, writer = await c.dial(echo, tree=str(tree))

        async def send() -> None:
            writer.write(payload)
            await writer.drain()
            writer.write_eof()

        sender = asyncio.ensure_future(send())
        got = await asyncio.wait_for(reader.read(), 60)  # until the dialer's EOF
        await sender
        assert got == payload
        writer.close()
        # A second connection on the same agent, while the first has gone.
        r2, w2 = await c.dial(echo, tree=str(tree))
        w2.write(b"again")
        assert await asyncio.wait_for(r2.readexactly(5), 30) == b"again"
        w2.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while set(_dialers()) - before:
            assert loop.time() < deadline, "a dialer outlived its connection"
            await asyncio.sleep(0.1)

    ta.with_client(guest, body)


def test_a_port_nothing_listens_on_is_refused(guest: ta.Guest, tree: Path) -> None:
    with socket.socket() as s:  # a free port: bound, then released
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def body(c: AgentClient) -> None:
        with pytest.raises(ConnectionRefusedError, match=f"guest port {port}"):
            await c.dial(port, tree=str(tree))
        # The agent serves on.
        assert (await c.run(["true"])).exit_code == 0

    ta.with_client(guest, body)
