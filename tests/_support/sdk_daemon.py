"""Shared fixtures for the SDK and CLI tests: a real daemon (uvicorn on a unix socket,
real routes, auth and local.key) over the in-memory fake services of the API tests."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from boxd import models
from boxd.api.server import Daemon
from boxd.config import Paths
from tests._support.api_fakes import FakeMachines, FakeSnapshots


class ScriptedMachines(FakeMachines):
    """FakeMachines whose streamed exec understands ``exit N`` and ``echo-err TEXT``."""

    async def exec_stream(  # type: ignore[override]
        self, account: str, ref: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        self._find(account, ref)
        cmd = req.command if isinstance(req.command, str) else " ".join(req.command)
        if cmd.startswith("exit "):
            yield models.ExecEvent(type="stdout", data="out\n")
            yield models.ExecEvent(type="stderr", data="err\n")
            yield models.ExecEvent(type="exit", exit_code=int(cmd.split()[1]), duration=0.0)
            return
        if cmd == "hang":
            yield models.ExecEvent(type="stdout", data="partial\n")
            yield models.ExecEvent(type="exit", exit_code=137, timed_out=True, duration=1.0)
            return
        async for event in super().exec_stream(account, ref, req):
            yield event


@pytest.fixture
def paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Paths]:
    monkeypatch.setenv("BOXD_SHM", str(tmp_path / "shm"))
    short = Path(tempfile.mkdtemp(prefix="boxd-sdk-", dir="/tmp"))  # AF_UNIX path limit
    monkeypatch.setenv("BOXD_HOME", str(short))
    monkeypatch.delenv("BOXD_URL", raising=False)
    monkeypatch.delenv("BOXD_API_KEY", raising=False)
    yield Paths(short)
    shutil.rmtree(short, ignore_errors=True)


def start_daemon(paths: Paths, tmp: Path) -> tuple[Daemon, threading.Thread]:
    machines = ScriptedMachines()
    d = Daemon(paths, machines=machines, snapshots=FakeSnapshots(machines, tmp))
    thread = threading.Thread(target=d.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not (d.server.started and paths.socket.exists()):
        assert time.monotonic() < deadline, "daemon did not start"
        time.sleep(0.02)
    return d, thread


@pytest.fixture
def daemon(paths: Paths, tmp_path: Path) -> Iterator[Daemon]:
    d, thread = start_daemon(paths, tmp_path)
    yield d
    d.stop()
    thread.join(10)
