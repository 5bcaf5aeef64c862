"""Find the local daemon on its unix socket, and start one when none answers.

The "embedded default": a new user runs ``boxd machine new x`` or ``Boxd()`` and a daemon
appears. The client starts ``python -m boxd serve`` detached (its own session, output to
the daemon log), holding a client-side ``flock`` on ``<data dir>/spawn.lock`` so that
concurrent clients start only one, then polls ``GET /v1/health`` until it answers.

This module does blocking I/O; the async client runs it in a worker thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from boxd import errors
from boxd._server_deps import require_server
from boxd.config import Paths
from boxd.sdk import _base

__all__ = ["START_TIMEOUT", "ensure_daemon", "is_healthy", "read_local_key"]

#: Seconds to wait for a freshly started daemon to answer /v1/health.
START_TIMEOUT = 30.0
_POLL = 0.1


def spawn_lock_path(paths: Paths) -> Path:
    return paths.home / "spawn.lock"


def is_healthy(socket: Path, timeout: float = 2.0) -> bool:
    """True when a daemon answers ``GET /v1/health`` on ``socket``."""
    if not socket.exists():
        return False
    transport = httpx.HTTPTransport(uds=str(socket), retries=0)
    try:
        with httpx.Client(
            transport=transport, base_url=_base.LOCAL_BASE_URL, timeout=timeout
        ) as client:
            resp = client.get("/v1/health")
    except httpx.HTTPError:
        return False
    return resp.status_code == 200


def read_local_key(paths: Paths) -> str | None:
    """The local daemon's key for this OS user, or None if absent or unreadable."""
    try:
        key = _base.local_key_path(paths).read_text().strip()
    except OSError:
        return None
    return key or None


def _log_tail(log: Path, lines: int = 5) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])[:600]


def _spawn(paths: Paths) -> subprocess.Popen[bytes]:
    paths.home.mkdir(parents=True, exist_ok=True, mode=0o700)
    env = dict(os.environ)
    env["BOXD_HOME"] = str(paths.home)  # the daemon serves the same data dir we looked in
    env.pop("BOXD_URL", None)
    # Output goes to the daemon log so that a crash at start-up leaves its traceback there.
    # The log is the daemon's alone (docs/security.md): born 0600.
    fd = os.open(paths.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with open(fd, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "boxd", "serve"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # survives the client; no terminal signals
            close_fds=True,
            env=env,
            cwd=str(paths.home),
        )


def daemon_holds_lock(paths: Paths) -> bool:
    """True when a daemon process holds this data directory's lock (it may be busy)."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _wait_for_running(paths: Paths, timeout: float) -> bool:
    """Wait for a daemon that holds the lock but is slow to answer (a loaded host)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_healthy(paths.socket, timeout=5.0):
            return True
        if not daemon_holds_lock(paths):
            return False
        time.sleep(_POLL)
    return False


def ensure_daemon(paths: Paths, timeout: float = START_TIMEOUT) -> None:
    """Make sure a daemon answers on ``paths.socket``, starting one if needed.

    Raises:
        ConnectionError: the daemon could not be started or did not answer in time; the
            message says what failed and names the log file.
        HostSetupError: no daemon answers and this Python lacks the server extra
            (``pip install 'boxd[server]'``) to start one.
    """
    if is_healthy(paths.socket):
        return
    try:
        paths.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock_fd = os.open(spawn_lock_path(paths), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        lock = open(lock_fd, "a+b")  # noqa: SIM115 - held across the wait
    except OSError as exc:
        raise errors.ConnectionError(
            f"cannot start the boxd daemon: cannot create {paths.home}: {exc.strerror}",
            hint="set BOXD_HOME to a writable directory, or BOXD_URL to a running daemon",
        ) from exc
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            # Another client may have started it while we waited for the lock, or a
            # daemon runs but was too busy to answer in time: never start a second one.
            if is_healthy(paths.socket):
                return
            if daemon_holds_lock(paths) and _wait_for_running(paths, timeout):
                _wait_for_key(paths)
                return
            require_server()  # a light install: one line naming the extra
            try:
                proc = _spawn(paths)
            except OSError as exc:
                raise errors.ConnectionError(
                    f"cannot start the boxd daemon ({sys.executable} -m boxd serve): {exc}",
                    hint=f"see {paths.log}",
                ) from exc
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if is_healthy(paths.socket, timeout=1.0):
                    _wait_for_key(paths)
                    return
                code = proc.poll()
                if code is not None and not is_healthy(paths.socket, timeout=1.0):
                    tail = _log_tail(paths.log)
                    raise errors.ConnectionError(
                        f"the boxd daemon exited at start-up with status {code}"
                        + (f": {tail}" if tail else ""),
                        hint=f"full log: {paths.log}",
                    )
                time.sleep(_POLL)
            with contextlib.suppress(OSError):
                proc.terminate()
            raise errors.ConnectionError(
                f"the boxd daemon did not answer on {paths.socket} within {timeout:.0f} s",
                hint=f"see its log: {paths.log}",
            )
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _wait_for_key(paths: Paths, timeout: float = 5.0) -> None:
    # The daemon writes local.key before it listens; allow a short race anyway.
    deadline = time.monotonic() + timeout
    while read_local_key(paths) is None and time.monotonic() < deadline:
        time.sleep(_POLL)
