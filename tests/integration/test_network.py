"""Issue 2 acceptance: guest networking on real machines.

* a guest installs a package with pip from a PEP 503 index served on the host (no
  internet in tests): in QEMU user-mode networking the host's loopback is 10.0.2.2;
* an ``--isolated`` machine has no network device and cannot reach the host;
* the machine's forwarded port reaches a server listening on the guest's port 8080.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

PKG = "boxdprobe"
VERSION = "0.1.0"
HOST_FROM_GUEST = "10.0.2.2"


def _build_wheel(dest: Path) -> Path:
    """Write a minimal pure-Python wheel by hand (no build tools needed)."""
    name = f"{PKG}-{VERSION}-py3-none-any.whl"
    dist = f"{PKG}-{VERSION}.dist-info"
    files = {
        f"{PKG}/__init__.py": b'MAGIC = "served-from-the-host"\n',
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {PKG}\nVersion: {VERSION}\n"
            "Summary: boxd network test package\n"
        ).encode(),
        f"{dist}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: boxd-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(path, data)
    out = dest / name
    out.write_bytes(buf.getvalue())
    return out


def _write_index(root: Path, wheel: Path) -> None:
    """A PEP 503 simple index with one project: /simple/<pkg>/ links to the wheel."""
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (root / "simple" / PKG).mkdir(parents=True)
    (root / "packages").mkdir()
    wheel.rename(root / "packages" / wheel.name)
    (root / "simple" / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="{PKG}/">{PKG}</a></body></html>\n'
    )
    (root / "simple" / PKG / "index.html").write_text(
        "<!DOCTYPE html><html><body>"
        f'<a href="../../packages/{wheel.name}#sha256={sha}">{wheel.name}</a>'
        "</body></html>\n"
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str]

    def log_message(self, format: str, *args: object) -> None:
        type(self).requests.append(self.path)


@pytest.fixture
def index(tmp_path: Path) -> Iterator[tuple[int, list[str]]]:
    """Serve a package index on 127.0.0.1:<free port>; yields (port, requested paths)."""
    root = tmp_path / "index"
    root.mkdir()
    _write_index(root, _build_wheel(tmp_path))
    handler = type("Handler", (_QuietHandler,), {"requests": []})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(handler, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler.requests
    finally:
        server.shutdown()
        server.server_close()


def test_guest_pip_installs_from_a_host_index(client, machine, index) -> None:  # type: ignore[no-untyped-def]
    port, requests = index
    url = f"http://{HOST_FROM_GUEST}:{port}/simple/"
    r = client.machines.exec(
        machine.id,
        f"python3 -m pip install --no-cache-dir --disable-pip-version-check "
        f"--index-url {url} --trusted-host {HOST_FROM_GUEST} {PKG}",
        timeout=600,
    )
    assert r.exit_code == 0, f"pip failed:\n{r.stdout}\n{r.stderr}"
    assert any(p.startswith(f"/simple/{PKG}") for p in requests), requests
    assert any(p.endswith(".whl") for p in requests), requests
    r = client.machines.exec(
        machine.id, ["python3", "-c", f"import {PKG}; print({PKG}.MAGIC)"], cwd="/"
    )
    assert r.stdout == "served-from-the-host\n", r.stderr


def test_isolated_machine_cannot_reach_the_host(client, index) -> None:  # type: ignore[no-untyped-def]
    port, requests = index
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
    assert machine.port and machine.url == f"http://127.0.0.1:{machine.port}"
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
