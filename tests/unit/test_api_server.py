"""The daemon for real: uvicorn on a unix socket, the data-directory lock, local.key."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests._support.api_fakes import FakeMachines, FakeSnapshots

from boxd.api.server import Daemon, local_key_path
from boxd.config import Paths
from boxd.errors import Conflict


@pytest.fixture
def paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Paths]:
    monkeypatch.setenv("BOXD_SHM", str(tmp_path / "shm"))
    # AF_UNIX paths are limited to ~107 bytes; pytest's tmp paths can be long.
    short = Path(tempfile.mkdtemp(prefix="boxd-test-", dir="/tmp"))
    yield Paths(short)
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def daemon(paths: Paths, tmp_path: Path) -> Iterator[Daemon]:
    machines = FakeMachines()
    d = Daemon(paths, machines=machines, snapshots=FakeSnapshots(machines, tmp_path))
    thread = threading.Thread(target=d.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not (d.server.started and paths.socket.exists()):
        assert time.monotonic() < deadline, "daemon did not start"
        time.sleep(0.02)
    yield d
    d.stop()
    thread.join(10)
    assert not thread.is_alive()


def _client(paths: Paths, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(
        transport=httpx.HTTPTransport(uds=str(paths.socket)), base_url="http://boxd",
        headers=headers,
    )


def test_real_server_on_unix_socket(daemon: Daemon, paths: Paths) -> None:
    key_file = local_key_path(paths)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.stat().st_uid == os.getuid()
    assert stat.S_IMODE(paths.socket.stat().st_mode) == 0o600
    secret = key_file.read_text().strip()
    assert secret.startswith("boxd_")

    with _client(paths) as anon:
        health = anon.get("/v1/health").json()
        assert health["ok"] is True and health["pid"] == os.getpid()
        assert anon.get("/v1/machines").status_code == 401
    with _client(paths, secret) as c:
        assert c.post("/v1/machines", json={"name": "a"}).status_code == 201
        with c.stream("POST", "/v1/machines/a/exec/stream", json={"command": "x"}) as r:
            lines = [json.loads(x) for x in r.iter_lines() if x]
        assert lines[-1]["type"] == "exit"
        assert c.get("/v1/machines/nope").json()["error"]["code"] == "machine_not_found"

    # The log is JSON lines in the data directory, access log included.
    records = [json.loads(line) for line in paths.log.read_text().splitlines()]
    assert any(r["msg"] == "daemon started" for r in records)
    assert any(r["logger"] == "uvicorn.access" for r in records)


def test_second_daemon_on_same_directory_is_a_conflict(daemon: Daemon, paths: Paths) -> None:
    with pytest.raises(Conflict, match="already serves this data directory"):
        Daemon(paths, machines=FakeMachines(), snapshots=daemon.snapshots)


def test_shutdown_closes_machines_and_keeps_the_key(paths: Paths, tmp_path: Path) -> None:
    machines = FakeMachines()
    d = Daemon(paths, machines=machines, snapshots=FakeSnapshots(machines, tmp_path))
    thread = threading.Thread(target=d.run, daemon=True)
    thread.start()
    while not d.server.started:
        time.sleep(0.02)
    d.stop()
    thread.join(10)
    assert machines.closed
    assert not paths.socket.exists()
    secret = local_key_path(paths).read_text()

    # A restart keeps a still-valid key file; a lost or bad one is replaced (old revoked).
    d2 = Daemon(paths, machines=FakeMachines(), snapshots=FakeSnapshots(machines, tmp_path))
    assert local_key_path(paths).read_text() == secret
    d2._unlock()
    d2.db.close()
    local_key_path(paths).write_text("boxd_garbage\n")
    d3 = Daemon(paths, machines=FakeMachines(), snapshots=FakeSnapshots(machines, tmp_path))
    new = local_key_path(paths).read_text().strip()
    assert new != secret.strip()
    assert stat.S_IMODE(local_key_path(paths).stat().st_mode) == 0o600
    keys = d3.keys.list(d3.keys.ensure_local_account())
    assert [k.revoked_at is not None for k in keys] == [True, False]
    d3._unlock()
    d3.db.close()


def test_serve_exits_cleanly_on_sigterm(paths: Paths, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    code = "from boxd.api.server import serve; from boxd.config import Paths; " \
        f"from pathlib import Path; serve(Paths(Path({str(paths.home)!r})))"
    env = {**os.environ, "BOXD_SHM": str(tmp_path / "shm2")}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while True:
            assert time.monotonic() < deadline, "daemon did not answer"
            try:
                with _client(paths) as c:
                    if c.get("/v1/health").status_code == 200:
                        break
            except httpx.TransportError:
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out == b"" and err == b""  # nothing on the terminal; it all goes to the log
    assert not paths.socket.exists()
    assert "daemon stopped" in paths.log.read_text()


def test_a_request_the_stopping_daemon_cuts_off_is_answered(
    daemon: Daemon, paths: Paths
) -> None:
    # Every request gets an answer: one still running when the daemon stops, past the
    # server's grace for requests in flight, is a typed 503, not uvicorn's bare 500.
    machines = daemon.machines
    assert isinstance(machines, FakeMachines)
    key = local_key_path(paths).read_text().strip()
    with _client(paths, key) as c:
        assert c.post("/v1/machines", json={"name": "m"}).status_code == 201
    got: dict[str, httpx.Response] = {}

    def call() -> None:
        with _client(paths, key) as c:
            got["r"] = c.post("/v1/machines/m/exec", json={"command": ["hang"]}, timeout=60)

    caller = threading.Thread(target=call)
    caller.start()
    assert machines.hanging.wait(10)
    daemon.stop()
    caller.join(30)
    r = got["r"]
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "infrastructure_error"
    assert "daemon stopped before it finished this request" in err["message"]
    assert "exec_id" in err["hint"]


@pytest.mark.parametrize("path", ["/v1/snapshots/import", "/v1/machines"])
def test_a_stalled_body_is_answered(  # every request gets an answer
    paths: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    import socket

    monkeypatch.setenv("BOXD_BODY_TIMEOUT", "1")
    machines = FakeMachines()
    d = Daemon(paths, machines=machines, snapshots=FakeSnapshots(machines, tmp_path))
    thread = threading.Thread(target=d.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not (d.server.started and paths.socket.exists()):
            assert time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.02)
        key = local_key_path(paths).read_text().strip()
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(paths.socket))
            # declares 100000 bytes, sends 1000, then waits (it used to wait forever)
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: boxd\r\nAuthorization: Bearer {key}\r\n"
                      "Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n"
                      "\r\n".encode() + b"x" * 1000)
            t0 = time.monotonic()
            data = b""
            while chunk := s.recv(65536):  # the answer closes the connection
                data += chunk
            reply = data.decode(errors="replace")
        assert time.monotonic() - t0 < 15
        assert reply.startswith("HTTP/1.1 408"), reply[:200]
        assert "body_timeout" in reply and "BOXD_BODY_TIMEOUT" in reply
        assert not list((paths.home / "uploads").glob("import-*"))  # no spool file left
    finally:
        d.stop()
        thread.join(10)


def test_the_daemon_runs_on_uvloop_unless_told_otherwise() -> None:
    import asyncio

    import uvloop

    from boxd.api.server import event_loop_runner
    from boxd.errors import InvalidRequest

    with event_loop_runner({}) as r:
        assert isinstance(r.get_loop(), uvloop.Loop)
    with event_loop_runner({"BOXD_EVENT_LOOP": "asyncio"}) as r:
        assert not isinstance(r.get_loop(), uvloop.Loop)
        assert isinstance(r.get_loop(), asyncio.AbstractEventLoop)
    with pytest.raises(InvalidRequest, match="BOXD_EVENT_LOOP"):
        event_loop_runner({"BOXD_EVENT_LOOP": "trio"})


def test_websockets_are_not_pinged_by_the_daemon(daemon: Daemon) -> None:
    # The sync SDK answers pings only while it reads; an RL env idle for a minute (a
    # training update) must keep its stream. A dead TCP peer is found by keepalive.
    import socket

    from boxd.api.server import _tcp_socket

    config = daemon.server.config
    assert config.ws_ping_interval is None and config.ws == "websockets-sansio"
    assert config.http == "h11"
    sock = _tcp_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
    finally:
        sock.close()


def test_an_idle_connection_outlives_the_clients_own_expiry(daemon: Daemon, paths: Paths) -> None:
    # A pooled connection the SDK reuses just before its own expiry must still be open
    # at the daemon: were both ends to time out together, the request written as the
    # daemon closed its end would get no answer ("Server disconnected").
    import socket

    from boxd.sdk import _base

    assert daemon.server.config.timeout_keep_alive > _base.KEEPALIVE_EXPIRY
    request = b"GET /v1/health HTTP/1.1\r\nHost: boxd\r\n\r\n"

    def response(s: socket.socket) -> bytes:
        """One whole response: its head and body may come in separate reads (under load
        a recv that took the head alone left the body to be read as the next answer)."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            chunk = s.recv(65536)
            assert chunk, data
            body += chunk
        return head

    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(paths.socket))
        s.settimeout(10)
        s.sendall(request)
        assert response(s).startswith(b"HTTP/1.1 200")
        time.sleep(_base.KEEPALIVE_EXPIRY + 0.5)  # idle past the client's expiry
        s.sendall(request)
        assert response(s).startswith(b"HTTP/1.1 200")
