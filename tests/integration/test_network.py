"""Guest networking on real machines (issue 2; issue 14 defect 2).

* a normal machine reaches the internet through passt: DNS and pip from the package
  index work (the one external destination tests use);
* it reaches nothing on the host: not a listener on 127.0.0.1 (QEMU's user networking
  mapped 10.0.2.2 there), not the host's other addresses, not a daemon's TCP API, not
  another machine's URL port; nothing in private ranges or link-local 169.254/16 (test
  hosts with such addresses live in a network namespace the test makes);
* an ``--isolated`` machine has no network device and cannot reach the host;
* the machine's URL reaches a server listening on the guest's port 8080.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd import errors

pytestmark = pytest.mark.vm

HOST_FROM_GUEST = "10.0.2.2"
INDEX_HOST = "pypi.org"

# Run in the guest: try each (host, port); print {"host:port": "connected" | error}.
PROBE = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        s = socket.create_connection((host, int(port)), timeout=8)
        s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
        s.close()
        out[target] = "connected"
    except OSError as e:
        out[target] = repr(e)
print(json.dumps(out))
"""


def _probe(client, machine_id: str, targets: list[str]) -> dict[str, str]:  # type: ignore[no-untyped-def]
    r = client.machines.exec(machine_id, ["python3", "-c", PROBE, *targets], timeout=300)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    result: dict[str, str] = json.loads(r.stdout)
    return result


class _Listener:
    """A TCP listener on the host that records every connection it accepts."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[object] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.accepted.append(peer)
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.fixture
def listeners() -> Iterator[list[_Listener]]:
    made: list[_Listener] = []
    yield made
    for lst in made:
        lst.close()


def _host_addresses() -> list[str]:
    """The IPv4 addresses of this host's interfaces other than loopback."""
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True,
                         check=True).stdout
    return [a["local"] for link in json.loads(out) for a in link.get("addr_info", [])
            if not a["local"].startswith("127.")]


@pytest.fixture
def tcp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A second daemon serving its API on 127.0.0.1:PORT (no machines needed)."""
    from tests._support.daemon import start_daemon

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = Path(tempfile.mkdtemp(prefix="boxd-test-tcp-", dir="/tmp"))
    d = start_daemon(home, "--listen", f"127.0.0.1:{port}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=10) as r:
            assert r.status == 200
        yield port
    finally:
        d.stop()


def test_a_machine_reaches_nothing_on_the_host(  # type: ignore[no-untyped-def]
    client, machine_factory, listeners, tcp_daemon
) -> None:
    loop = _Listener("127.0.0.1")
    listeners.append(loop)
    addrs = _host_addresses()
    wide = [_Listener(a) for a in addrs]
    listeners.extend(wide)
    a, b = machine_factory(), machine_factory()
    client.machines.wait_until_ready(b.id, timeout=600)
    assert b.port
    # the other machine's URL answers from the host (its port is open) ...
    with socket.create_connection(("127.0.0.1", b.port), timeout=10):
        pass
    targets = [f"{HOST_FROM_GUEST}:{loop.port}",       # the host's loopback (slirp's map)
               f"{HOST_FROM_GUEST}:{tcp_daemon}",      # a daemon's TCP API
               f"{HOST_FROM_GUEST}:{b.port}"]          # another machine's URL port
    for addr, lst in zip(addrs, wide, strict=True):
        targets += [f"{addr}:{lst.port}", f"{addr}:{tcp_daemon}", f"{addr}:{b.port}"]
    result = _probe(client, a.id, targets)
    reached = {t: r for t, r in result.items() if r == "connected"}
    assert reached == {}, result
    assert loop.accepted == [] and all(lst.accepted == [] for lst in wide)


@contextlib.contextmanager
def _test_hosts(addrs: list[str]) -> Iterator[tuple[int, Path]]:
    """Test hosts at ``addrs``, in a network namespace made here (a veth pair; the host
    side has no address, only /32 routes to the test hosts). Yields (port, file listing
    each connection: the test host's address it reached, then the peer)."""
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"boxdt-{tag}", f"bxh{tag}", f"bxn{tag}"
    seen = Path(tempfile.mkdtemp(prefix="boxd-far-")) / "seen"
    seen.touch()
    server = (
        "import socket, sys\n"
        "srv = socket.create_server(('0.0.0.0', 0)); print(srv.getsockname()[1], flush=True)\n"
        "while True:\n"
        "    c, peer = srv.accept()\n"
        "    open(sys.argv[1], 'a').write(f'{c.getsockname()[0]} {peer!r}\\n'); c.close()\n"
    )

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    sh("ip", "netns", "add", ns)
    proc = None
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "set", ns_if, "up")
        for addr in addrs:
            sh("ip", "-n", ns, "addr", "add", f"{addr}/32", "dev", ns_if)
            sh("ip", "route", "add", f"{addr}/32", "dev", host_if)
        sh("ip", "-n", ns, "route", "add", "default", "dev", ns_if)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", server,
                                 str(seen)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield port, seen
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


@pytest.fixture
def far_hosts() -> Iterator[tuple[list[str], int, Path]]:
    """Test hosts at a private and a link-local address (`_test_hosts`).
    Yields (addresses, port, file listing the peers that connected)."""
    tag = uuid.uuid4().hex[:6]
    addrs = [f"10.{int(tag[:2], 16)}.{int(tag[2:4], 16)}.2", f"169.254.{int(tag[4:], 16)}.2"]
    with _test_hosts(addrs) as (port, seen):
        yield addrs, port, seen


def test_private_and_link_local_ranges_are_unreachable(  # type: ignore[no-untyped-def]
    client, machine, far_hosts
) -> None:
    addrs, port, seen = far_hosts
    # The test hosts answer the host itself: the set-up works, the block is boxd's.
    for addr in addrs:
        with socket.create_connection((addr, port), timeout=10):
            pass
    deadline = time.monotonic() + 10
    while len(seen.read_text().splitlines()) < len(addrs) and time.monotonic() < deadline:
        time.sleep(0.05)
    before = seen.read_text()
    assert len(before.splitlines()) == len(addrs), before
    result = _probe(client, machine.id, [f"{a}:{port}" for a in addrs])
    assert all(r != "connected" for r in result.values()), result
    time.sleep(0.5)
    assert seen.read_text() == before


def _index_reachable() -> str | None:
    """Why the host cannot reach the package index, or None when it can."""
    try:
        with socket.create_connection((INDEX_HOST, 443), timeout=10):
            return None
    except OSError as exc:
        return f"this host has no route to the package index ({INDEX_HOST}): {exc}"


def test_guest_dns_and_pip_reach_the_package_index(client, machine) -> None:  # type: ignore[no-untyped-def]
    if why := _index_reachable():
        pytest.skip(why)
    lookup = f"import socket; print(socket.gethostbyname({INDEX_HOST!r}))"
    dns = client.machines.exec(machine.id, ["python3", "-c", lookup], timeout=120)
    assert dns.exit_code == 0 and dns.stdout.strip(), (dns.stdout, dns.stderr)
    # A small pure-Python package that the image does not carry.
    r = client.machines.exec(
        machine.id,
        "python3 -m pip install --no-cache-dir --disable-pip-version-check --no-deps "
        "--target /tmp/pipcheck iniconfig && ls /tmp/pipcheck",
        timeout=900,
    )
    assert r.exit_code == 0, f"pip failed:\n{r.stdout}\n{r.stderr}"
    assert "iniconfig" in r.stdout


def test_isolated_machine_cannot_reach_the_host(client, listeners) -> None:  # type: ignore[no-untyped-def]
    lst = _Listener("127.0.0.1")
    listeners.append(lst)
    port, requests = lst.port, lst.accepted
    m = client.machines.new(f"isolated-{int(time.time()) % 100000}", isolated=True)
    try:
        assert m.isolated and m.port is None and m.url is None
        client.machines.wait_until_ready(m.id, timeout=600)
        links = client.machines.exec(m.id, "ip -o link")
        assert links.exit_code == 0, links.stderr
        names = [ln.split(":")[1].strip() for ln in links.stdout.splitlines() if ln.strip()]
        assert names == ["lo"], links.stdout
        probe = (
            "import socket, sys\n"
            "try:\n"
            f"    socket.create_connection(({HOST_FROM_GUEST!r}, {port}), timeout=10)\n"
            "except OSError as e:\n"
            "    print('blocked', e); sys.exit(7)\n"
            "print('connected')\n"
        )
        r = client.machines.exec(m.id, ["python3", "-c", probe], timeout=120)
        assert r.exit_code == 7, (r.stdout, r.stderr)
        assert r.stdout.startswith("blocked")
        assert requests == []  # nothing reached the host's server
        # no resolver either: the guest has no route to any name server
        dns = client.machines.exec(
            m.id, ["python3", "-c", "import socket; socket.getaddrinfo('localhost.invalid', 80)"])
        assert dns.exit_code != 0
        # no credential for the API inside (nothing to reach it with, nothing to use)
        env = client.machines.exec(m.id, "env; ls /run/boxd 2>/dev/null")
        assert "BOXD_API_KEY" not in env.stdout and "boxd_" not in env.stdout
        # a fork of an isolated machine stays isolated
        child = client.machines.fork(m.id)
        try:
            assert child.isolated and child.port is None and child.url is None
            links = client.machines.exec(child.id, "ip -o link").stdout
            assert [ln.split(":")[1].strip() for ln in links.splitlines() if ln.strip()] == ["lo"]
            r = client.machines.exec(child.id, ["python3", "-c", probe], timeout=120)
            assert r.exit_code == 7 and requests == []
        finally:
            client.machines.delete(child.id)
    finally:
        client.machines.delete(m.id)


def test_forwarded_port_reaches_the_guest(client, machine) -> None:  # type: ignore[no-untyped-def]
    assert machine.port and machine.url and not machine.public
    assert machine.url.startswith(f"http://127.0.0.1:{machine.port}/")  # and its token
    marker = f"hello from {machine.name}"
    client.machines.files.upload(machine.id, "/srv/www/index.html", marker)
    r = client.machines.exec(
        machine.id,
        "cd /srv/www && nohup python3 -m http.server 8080 >/tmp/http.log 2>&1 &",
    )
    assert r.exit_code == 0, r.stderr
    deadline = time.monotonic() + 120
    last: object = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{machine.url}/", timeout=10) as resp:
                body = resp.read().decode()
                assert resp.status == 200
                assert body == marker
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
            time.sleep(0.5)
    log = client.machines.exec(machine.id, "cat /tmp/http.log").stdout
    pytest.fail(f"no answer on {machine.url}: {last}; guest log: {log}")


def _get_until_served(url: str, timeout: float = 120) -> tuple[int, bytes]:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code != 502:
                return exc.code, exc.read()
            last = exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
        time.sleep(0.5)
    pytest.fail(f"no answer on {url}: {last}")


#: The guest's dialer processes (their argv has ``--dial`` as an argument of its own).
_DIALERS = ("python3 -c \"import pathlib; print([p.parent.name for p in "
            "pathlib.Path('/proc').glob('[0-9]*/cmdline') if b'\\0--dial\\0' in p.read_bytes()])\"")


@pytest.mark.parametrize("engine", ["qemu", "gvisor"])
def test_a_url_reaches_any_guest_port(  # type: ignore[no-untyped-def]
        client, request, engine) -> None:
    # QEMU: port 8080 is passt's forward, any other a dialer in the guest through the
    # agent; gVisor: a dialer for every port.
    source = request.getfixturevalue("base" if engine == "qemu" else "gvisor_base")
    m = client.machines.fork(source.id)
    try:
        big = uuid.uuid4().hex.encode() * 32768  # 1 MiB: the dialer's stream, both ways
        client.machines.files.upload(m.id, "/srv/p/big.bin", big)
        client.machines.files.upload(m.id, "/srv/p/index.html", b"port 8000")
        r = client.machines.exec(
            m.id, "cd /srv/p && nohup python3 -m http.server 8000 >/tmp/p.log 2>&1 &")
        assert r.exit_code == 0, r.stderr
        url = client.machines.url(m.id, port=8000)
        assert url == f"{m.url}.8000" and client.machines.url(m.id) == m.url
        assert _get_until_served(f"{url}/") == (200, b"port 8000")
        assert _get_until_served(f"{url}/big.bin") == (200, big)
        # A port number outside TCP's range is not this machine's URL.
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(f"{m.url}.70000/", timeout=30)
        assert bad.value.code == 404
        with pytest.raises(errors.InvalidRequest):
            client.machines.url(m.id, port=0)
        # Each connection's dialer ends with it.
        deadline = time.monotonic() + 15
        while (dialers := client.machines.exec(m.id, _DIALERS).stdout.strip()) != "[]":
            assert time.monotonic() < deadline, f"dialers outlived their connections: {dialers}"
            time.sleep(0.5)
    finally:
        client.machines.delete(m.id)
