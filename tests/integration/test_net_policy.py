"""A route to the trainer (issue 42 item 7) on real machines, both engines:

* ``expose_host=[PORT]``: a server on the host's 127.0.0.1:PORT answers the machine at
  ``host.boxd.internal:PORT``; another host loopback port does not, nor the same port
  from a machine that does not expose it; a fork inherits the route;
* ``egress=[...]``: the machine reaches the listed test host and not another one,
  which a machine with the default policy reaches (test hosts at documentation
  addresses, TEST-NET-2/3, in a network namespace the test makes: nothing leaves the
  host);
* a gVisor machine talking to the host forks right after closing a connection and while
  holding one (gVisor resets it), and a fork while a connection is being opened waits,
  then refuses without harming it (runsc 20240729 cannot save such a connection).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd import errors
from boxd.net_policy import HOST_NAME
from tests.integration.test_network import _Listener, _probe, _test_hosts

pytestmark = pytest.mark.vm


@pytest.fixture
def doc_hosts() -> Iterator[tuple[list[str], int, Path]]:
    """Two test hosts at documentation addresses (not in the ranges every machine is
    denied, so only an egress list keeps a machine from them)."""
    tag = uuid.uuid4().hex[:4]
    addrs = [f"203.0.113.{int(tag[:2], 16) % 250 + 2}", f"198.51.100.{int(tag[2:], 16) % 250 + 2}"]
    with _test_hosts(addrs) as (port, seen):
        for addr in addrs:  # they answer the host itself: the set-up works
            with socket.create_connection((addr, port), timeout=10):
                pass
        deadline = time.monotonic() + 10
        while len(seen.read_text().splitlines()) < len(addrs):
            assert time.monotonic() < deadline, seen.read_text()
            time.sleep(0.05)
        yield addrs, port, seen


def _peers(seen: Path) -> list[str]:
    return seen.read_text().splitlines()


def _source(client, request, engine: str):  # type: ignore[no-untyped-def]
    return request.getfixturevalue("base" if engine == "qemu" else "gvisor_base")


@pytest.mark.parametrize("engine", ["qemu", "gvisor"])
def test_expose_host_and_egress_on_a_machine_and_its_fork(  # type: ignore[no-untyped-def]
    client, request, engine, doc_hosts,
) -> None:
    addrs, far_port, seen = doc_hosts
    allowed, denied = addrs
    exposed, other = _Listener("127.0.0.1"), _Listener("127.0.0.1")
    made: list[str] = []
    try:
        plain = client.machines.fork(_source(client, request, engine).id)
        made.append(plain.id)
        m = client.machines.new(f"route-{engine}-{uuid.uuid4().hex[:4]}", engine=engine,
                                expose_host=[exposed.port], egress=[f"{allowed}:{far_port}"])
        made.append(m.id)
        assert m.expose_host == [exposed.port]
        assert m.egress == [f"{allowed}/32:{far_port}"]
        client.machines.wait_until_ready(m.id, timeout=600)
        before = len(_peers(seen))
        targets = [f"{HOST_NAME}:{exposed.port}", f"{HOST_NAME}:{other.port}",
                   f"10.0.2.2:{other.port}", f"{allowed}:{far_port}", f"{denied}:{far_port}"]
        result = _probe(client, m.id, targets)
        assert result[f"{HOST_NAME}:{exposed.port}"] == "connected", result
        assert all(result[t] != "connected" for t in targets[1:3]), result
        assert result[f"{allowed}:{far_port}"] == "connected", result
        assert result[f"{denied}:{far_port}"] != "connected", result
        assert len(exposed.accepted) == 1 and other.accepted == []
        time.sleep(0.5)
        new = _peers(seen)[before:]
        assert [n.split()[0] for n in new] == [allowed], new  # the denied host saw nothing

        # A machine with the default policy: no route to the host, and the denied test
        # host (a public-looking address) answers it: the block above is the egress list.
        before = len(_peers(seen))
        result = _probe(client, plain.id, [f"10.0.2.2:{exposed.port}", f"{denied}:{far_port}"])
        assert result[f"10.0.2.2:{exposed.port}"] != "connected", result
        assert result[f"{denied}:{far_port}"] == "connected", result
        assert len(exposed.accepted) == 1

        # A fork inherits both (its own passt or pasta, its own rules).
        kid = client.machines.fork(m.id)
        made.append(kid.id)
        assert kid.expose_host == m.expose_host and kid.egress == m.egress
        result = _probe(client, kid.id, targets)
        assert result[f"{HOST_NAME}:{exposed.port}"] == "connected", result
        assert all(result[t] != "connected" for t in targets[1:3]), result
        assert result[f"{allowed}:{far_port}"] == "connected", result
        assert result[f"{denied}:{far_port}"] != "connected", result
        assert len(exposed.accepted) == 2 and other.accepted == []
    finally:
        for mid in reversed(made):
            with contextlib.suppress(errors.NotFound):
                client.machines.delete(mid)
        exposed.close()
        other.close()


def test_an_empty_egress_list_allows_only_the_exposed_port(  # type: ignore[no-untyped-def]
    client, request, doc_hosts,
) -> None:
    addrs, far_port, seen = doc_hosts
    exposed = _Listener("127.0.0.1")
    m = client.machines.new(f"closed-{uuid.uuid4().hex[:4]}", engine="gvisor",
                            expose_host=[exposed.port], egress=[])
    try:
        client.machines.wait_until_ready(m.id, timeout=600)
        before = len(_peers(seen))
        result = _probe(client, m.id, [f"{HOST_NAME}:{exposed.port}",
                                       *(f"{a}:{far_port}" for a in addrs)])
        assert result.pop(f"{HOST_NAME}:{exposed.port}") == "connected", result
        assert all(r != "connected" for r in result.values()), result
        time.sleep(0.5)
        assert _peers(seen)[before:] == []
        # and after a hibernate and wake (a new sandbox, a new pasta, the same policy)
        client.machines.hibernate(m.id)
        client.machines.resume(m.id)
        client.machines.wait_until_ready(m.id, timeout=600)
        again = _probe(client, m.id, [f"{HOST_NAME}:{exposed.port}", f"{addrs[0]}:{far_port}"])
        assert again[f"{HOST_NAME}:{exposed.port}"] == "connected", again
        assert again[f"{addrs[0]}:{far_port}"] != "connected", again
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)
        exposed.close()


class _EchoServer:
    """A host loopback server that echoes and closes a connection only after its
    client did (so the guest's side of each connection ends in TIME_WAIT)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(4096):
                conn.sendall(data)


# In the guest, in the background: a connection held open, pinged every 0.1 s; its
# fate goes to /tmp/held ("open", then the error that ended it).
_HOLD = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
open('/tmp/held', 'w').write('open')
while True:
    try:
        s.sendall(b'p')
        if not s.recv(1):
            raise EOFError('closed by the peer')
    except (OSError, EOFError) as e:
        open('/tmp/held', 'w').write(type(e).__name__)
        break
    time.sleep(0.1)
"""
# In the guest, in the background: one connection attempt; its result to /tmp/opened.
_OPEN = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=40)
    result = 'connected'
except OSError as e:
    result = repr(e)
open('/tmp/opened', 'w').write(result)
"""
# An echo through a new connection, closed by the guest first (TIME_WAIT).
_ECHO = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(b'x'); assert s.recv(1) == b'x'; s.close(); print('echoed')
"""


def _background(client, mid: str, script: str, *args: str) -> None:  # type: ignore[no-untyped-def]
    launcher = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1],"
                " *sys.argv[2:]], start_new_session=True, stdout=subprocess.DEVNULL,"
                " stderr=subprocess.DEVNULL)")
    r = client.machines.exec(mid, ["python3", "-c", launcher, script, *args], timeout=60)
    assert r.exit_code == 0, r.stderr


def _guest_file(client, mid: str, path: str, *, until: str = "", timeout: float = 60) -> str:  # type: ignore[no-untyped-def]
    """A guest file's text, once it exists (and differs from ``until``)."""
    deadline = time.monotonic() + timeout
    while True:
        r = client.machines.exec(mid, ["cat", path], timeout=60)
        if r.exit_code == 0 and r.stdout and r.stdout != until:
            return str(r.stdout)
        assert time.monotonic() < deadline, (path, r.stdout, r.stderr)
        time.sleep(0.2)


def test_a_gvisor_machine_forks_whatever_its_connections_to_the_host(  # type: ignore[no-untyped-def]
    client, gvisor_base,
) -> None:
    """gVisor cannot save a TCP connection to outside the sandbox: a fork right after
    the guest closed one (TIME_WAIT), or while it holds one, succeeds and the held
    connection is reset (in the source too: docs/security.md); a fork while a
    connection is being opened waits for it, then refuses (StateError) without
    harming that connection, which completes once the host answers."""
    echo = _EchoServer()
    slow = socket.create_server(("127.0.0.1", 0), backlog=0)  # its queue: one connection
    slow_port = slow.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", slow_port))  # fills it: SYNs wait
    m = client.machines.new(f"conns-{uuid.uuid4().hex[:4]}", engine="gvisor",
                            expose_host=[echo.port, slow_port])
    made = [m.id]
    try:
        client.machines.wait_until_ready(m.id, timeout=600)
        target = [HOST_NAME, str(echo.port)]
        r = client.machines.exec(m.id, ["python3", "-c", _ECHO, *target], timeout=60)
        assert r.stdout.strip() == "echoed", r.stderr
        kid = client.machines.fork(m.id)  # its connection is in TIME_WAIT for 60 s
        made.append(kid.id)

        _background(client, m.id, _HOLD, *target)
        assert _guest_file(client, m.id, "/tmp/held") == "open"
        kid = client.machines.fork(m.id)
        made.append(kid.id)
        assert _guest_file(client, m.id, "/tmp/held", until="open") == "ConnectionAbortedError"
        for mid in (m.id, kid.id):  # both reach the host again
            r = client.machines.exec(mid, ["python3", "-c", _ECHO, *target], timeout=60)
            assert r.stdout.strip() == "echoed", r.stderr

        _background(client, m.id, _OPEN, HOST_NAME, str(slow_port))
        time.sleep(1)
        t0 = time.monotonic()
        with pytest.raises(errors.StateError, match="still opening 1 TCP connection"):
            client.machines.fork(m.id)
        assert time.monotonic() - t0 >= 2.0  # it waited for the handshake first
        slow.accept()[0].close()  # room in the queue: the waiting SYN gets in
        assert _guest_file(client, m.id, "/tmp/opened") == "connected"
        kid = client.machines.fork(m.id)
        made.append(kid.id)
    finally:
        for mid in reversed(made):
            with contextlib.suppress(errors.NotFound):
                client.machines.delete(mid)
        filler.close()
        slow.close()
        echo.sock.close()
