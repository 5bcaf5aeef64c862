"""``boxd console`` against a real daemon (uvicorn, its console listener) over fake
services: the login URL it prints logs a browser in once; the listener's URL file and
its live streams end with the daemon."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result
from tests._support import sdk_daemon as support

from boxd.api.server import Daemon
from boxd.cli import main
from boxd.config import Paths
from boxd.console.login import url_file
from boxd.console.sessions import COOKIE

daemon = support.daemon  # fixtures
paths = support.paths


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_print_url_logs_a_browser_in_once(daemon: Daemon) -> None:
    assert run("machine", "new", "seen-in-console").exit_code == 0
    r = run("console", "--print-url")
    assert r.exit_code == 0, r.output
    url = r.stdout.strip()
    base = url_file(daemon.paths.home).read_text().strip()
    assert url.startswith(f"{base}/login?token=")
    with httpx.Client(follow_redirects=True) as browser:
        login = browser.get(url)  # follows the 303 to "/"
        assert login.status_code == 200
        assert COOKIE in browser.cookies
        assert "seen-in-console" in login.text
    assert httpx.get(url).status_code == 401  # once
    token = url.split("token=", 1)[1]
    log = daemon.paths.log.read_text()
    assert "/login?token=<redacted>" in log  # the access log has the request, not the token
    assert token not in log


def test_a_remote_daemon_needs_its_console_url(paths: Paths, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    machines = support.ScriptedMachines()
    d = Daemon(paths, listen=f"127.0.0.1:{port}", machines=machines,
               snapshots=support.FakeSnapshots(machines, tmp_path))
    thread = threading.Thread(target=d.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not url_file(paths.home).exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        base = url_file(paths.home).read_text().strip()
        monkeypatch.setenv("BOXD_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("BOXD_API_KEY", (paths.home / "local.key").read_text().strip())
        r = run("console", "--print-url")
        assert r.exit_code == 1 and "--console-url" in r.stderr
        r = run("console", "--print-url", "--console-url", base)
        assert r.exit_code == 0, r.output
        assert r.stdout.startswith(f"{base}/login?token=")
    finally:
        d.stop()
        thread.join(10)


def test_a_bad_key_gets_no_login_url(daemon: Daemon) -> None:
    base = url_file(daemon.paths.home).read_text().strip()
    r = run("--api-key", "boxd_nope", "console", "--print-url", "--console-url", base)
    assert r.exit_code == 1
    assert "login?token" not in r.output


def test_the_daemon_stops_at_once_with_a_live_stream_open(
        paths: Paths, tmp_path: Path) -> None:
    d, thread = support.start_daemon(paths, tmp_path)
    base = url_file(paths.home).read_text().strip()
    r = run("console", "--print-url")
    browser = httpx.Client(timeout=30)
    browser.get(r.stdout.strip())
    got: list[bytes] = []

    def listen() -> None:
        try:
            with browser.stream("GET", f"{base}/api/events") as s:
                for chunk in s.iter_bytes():
                    got.append(chunk)
        except httpx.HTTPError:
            pass

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    deadline = time.monotonic() + 10
    while not any(b"event: machines" in c for c in got):
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    started = time.monotonic()
    d.stop()
    thread.join(15)
    assert not thread.is_alive()
    assert time.monotonic() - started < 5  # not the 10 s graceful timeout
    listener.join(5)
    assert not url_file(paths.home).exists()
    browser.close()


def test_console_off_means_no_listener(paths: Paths, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOXD_CONSOLE_LISTEN", "off")
    d, thread = support.start_daemon(paths, tmp_path)
    try:
        assert not url_file(paths.home).exists()
        r = run("console", "--print-url")
        assert r.exit_code == 1 and "BOXD_CONSOLE_LISTEN" in r.stderr
    finally:
        d.stop()
        thread.join(10)
