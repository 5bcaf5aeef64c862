"""Machine URLs per engine: a GET through ``Machine.url`` on a new connection each time
and on one keep-alive connection (docs/lifecycle.md#urls).

The daemon's proxy is the same for both engines; behind it QEMU's passt forwards a
loopback port, gVisor starts one dialer process in the sandbox per connection
(``boxd-init --dial 8080`` through the agent). A request on a kept-alive connection
pays neither forward's set-up, so it is the baseline of the new-connection figure in
the same run. The guest serves a 2-byte page
over HTTP/1.1 (keep-alive, TCP_NODELAY) from Python's http.server.

``BENCH_URLS_ENGINES`` (default ``gvisor,qemu``) picks the engines; an engine the
daemon cannot run is skipped with a note.
"""

from __future__ import annotations

import http.client
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from _common import Row, row_from, say, standalone

GROUP = "urls"
N_NEW = 30
N_KEPT = 100
N_BIG = 10
BIG = 1 << 20  # bytes of the large GET
OTHER_PORT = 8000  # served as 8080 is; QEMU reaches it through the guest's dialer

SERVER = f"""
import http.server, threading
BIG = b"x" * {BIG}
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes
    def do_GET(self):
        body = BIG if self.path == "/big" else b"ok"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
other = http.server.ThreadingHTTPServer(("0.0.0.0", {OTHER_PORT}), H)
threading.Thread(target=other.serve_forever, daemon=True).start()
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def _get(conn: http.client.HTTPConnection, prefix: str = "", path: str = "/") -> None:
    conn.request("GET", prefix + path)
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 200 and len(body) == (BIG if path == "/big" else 2), resp.status


def _timed(n: int, call: Callable[[], None]) -> list[float]:
    """Seconds each of ``n`` calls took."""
    took = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        took.append(time.perf_counter() - t)
    return took


def _new_connection(host: str, port: int, prefix: str) -> None:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    _get(conn, prefix)
    conn.close()


def _kept_alive(host: str, port: int, prefix: str, n: int, path: str = "/") -> list[float]:
    """``n`` GETs of ``path`` timed on one connection (opened and warmed first)."""
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        _get(conn, prefix)
        return _timed(n, lambda: _get(conn, prefix, path))
    finally:
        conn.close()


def _wait_up(host: str, port: int, prefix: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        try:
            _get(conn, prefix)
            return
        except (OSError, http.client.HTTPException, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
        finally:
            conn.close()


def _one_engine(b: Any, engine: str, tell: Callable[[str], None]) -> list[Row]:
    tell(f"bench_urls: a {engine} machine serving 8080")
    m = b.machines.new(f"bench-urls-{engine}-{int(time.time())}", engine=engine)
    try:
        b.machines.wait_until_ready(m.id, timeout=600)
        accel = next(e.accelerator for e in b.info().engines if e.name == engine) or engine
        b.machines.files.upload(m.id, "/root/server.py", SERVER)
        r = b.machines.exec(m.id, "nohup python3 /root/server.py >/tmp/server.log 2>&1 &")
        assert r.exit_code == 0, r.stderr
        url = urlsplit(b.machines.get(m.id).url)
        host, port = url.hostname or "127.0.0.1", int(url.port or 80)
        prefix = url.path.rstrip("/")  # the machine's token (docs/lifecycle.md#urls)
        _wait_up(host, port, prefix)
        other = f"{prefix}.{OTHER_PORT}"  # the URL of guest port 8000
        _wait_up(host, port, other)
        fresh = _timed(N_NEW, lambda: _new_connection(host, port, prefix))
        fresh_other = _timed(N_NEW, lambda: _new_connection(host, port, other))
        kept = _kept_alive(host, port, prefix, N_KEPT)
        big = _kept_alive(host, port, prefix, N_BIG, "/big")
        kept_other = _kept_alive(host, port, other, N_KEPT)
        return [
            row_from(GROUP, f"{engine}: GET on a new connection", fresh, accel=accel,
                     note="proxy + the engine's forward set up per connection",
                     baseline=f"{engine}: GET on a kept-alive connection",
                     baseline_values=kept),
            row_from(GROUP, f"{engine}: GET on a new connection, guest port {OTHER_PORT}",
                     fresh_other, accel=accel,
                     note="URL/TOKEN.8000" + (": the guest's dialer" if engine == "qemu" else ""),
                     baseline=f"{engine}: GET on a new connection", baseline_values=fresh),
            row_from(GROUP, f"{engine}: GET on a kept-alive connection", kept, accel=accel,
                     note="one connection, HTTP/1.1"),
            row_from(GROUP, f"{engine}: GET on a kept-alive connection, guest port "
                     f"{OTHER_PORT}", kept_other, accel=accel, note="URL/TOKEN.8000",
                     baseline=f"{engine}: GET on a kept-alive connection",
                     baseline_values=kept),
            row_from(GROUP, f"{engine}: GET of 1 MiB on a kept-alive connection", big,
                     accel=accel, note="the body through the proxy and the engine's path",
                     baseline=f"{engine}: GET on a kept-alive connection",
                     baseline_values=kept),
        ]
    finally:
        b.machines.delete(m.id)


def run(client: Any | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    from boxd import Boxd

    tell = log or say
    b = client or Boxd()
    wanted = os.environ.get("BENCH_URLS_ENGINES", "gvisor,qemu").split(",")
    status = {e.name: e for e in b.info().engines}
    rows: list[Row] = []
    for engine in (e.strip() for e in wanted if e.strip()):
        e = status.get(engine)
        if e is None or e.status != "ok":
            tell(f"bench_urls: {engine} skipped ({e.reason if e else 'not listed'})")
            continue
        rows += _one_engine(b, engine, tell)
    return rows


if __name__ == "__main__":
    standalone(run)
