"""A gVisor daemon of its own serving E2B, for the tests that drive E2B's SDKs."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._support.daemon import Daemon, kill_machines_of, remove_cgroups_of, start_daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def e2b_daemon(session: Daemon, name: str,
               engine: str = "gvisor") -> Iterator[tuple[Daemon, dict[str, str]]]:
    """A daemon of ``engine`` on ``/tmp/boxd-<name>-<pid>``, and E2B's variables from
    ``boxd e2b env`` put in os.environ (restored after). Its E2B port is fixed, so the
    URL outlives a restart. Skips when the engine is not available here."""
    from boxd import Boxd

    home = Path(f"/tmp/boxd-{name}-{os.getpid()}")
    home.mkdir(parents=True, exist_ok=True)
    for cached in ("host.json", "host-gvisor.json"):  # the session daemon's probes
        if (session.home / cached).exists():
            (home / cached).write_bytes((session.home / cached).read_bytes())
    saved = dict(os.environ)
    os.environ.update({"BOXD_ENGINE": engine,
                       "BOXD_E2B_LISTEN": f"127.0.0.1:{free_port()}"})
    d = start_daemon(home)
    try:
        os.environ["BOXD_HOME"] = str(home)
        with Boxd() as b:
            info = next(e for e in b.info().engines if e.name == engine)
        if info.status != "ok":
            pytest.skip(f"{engine} unavailable here: {info.reason}")
        out = subprocess.run([sys.executable, "-m", "boxd", "e2b", "env"], check=True,
                             capture_output=True, text=True, env=dict(os.environ)).stdout
        exports = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines())
        os.environ.update(exports)
        yield d, exports
    finally:
        os.environ.clear()
        os.environ.update(saved)
        d.stop()
        kill_machines_of(home)
        time.sleep(0.2)
        remove_cgroups_of(home)
        from boxd.config import Paths

        shutil.rmtree(Paths(home.resolve()).shm, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
