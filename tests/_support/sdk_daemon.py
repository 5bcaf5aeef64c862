"""Shared fixtures for the SDK and CLI tests: a real daemon (uvicorn on a unix socket,
real routes, auth and local.key) over the in-memory fake services of the API tests; and,
for the SDK's ``transport=``, the same app in process (`scripted_app`,
`SyncASGITransport`)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from starlette.types import ASGIApp

from boxd import models
from boxd.api import create_app
from boxd.api.server import Daemon
from boxd.api.services.keys import KeyService
from boxd.config import Paths
from boxd.state import Database
from tests._support.api_fakes import FakeMachines, FakeSnapshots, host_info

T = TypeVar("T")


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


# --- in process: the SDK's transport= over the real FastAPI app -------------------------


class SyncASGITransport(httpx.BaseTransport):
    """httpx's ``ASGITransport`` for the sync client: each request runs on one event loop
    in a background thread (the app's services and the fake engine live on that loop).

    Bodies are read whole on both sides: enough for the SDK's streams, whose fake
    sources end by themselves.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._asgi = httpx.ASGITransport(app=app)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the app's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _handle(self, request: httpx.Request, body: bytes) -> httpx.Response:
        inner = httpx.Request(request.method, request.url, headers=request.headers,
                              content=body, extensions=request.extensions)
        resp = await self._asgi.handle_async_request(inner)
        content = await resp.aread()
        await resp.aclose()
        return httpx.Response(resp.status_code, headers=resp.headers, content=content)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.run(self._handle(request, request.read()))

    def close(self) -> None:
        if self.loop.is_running():
            self.run(_cancel_others())  # e.g. the node's watchers of machines left running
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


class KeptTransport(httpx.BaseTransport):
    """A transport kept open across CLI invocations (each closes its client, and with
    it the transport it was given): what a CLI test's patched ``Boxd`` is handed."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(request)


async def _cancel_others() -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def scripted_app(tmp: Path) -> tuple[ASGIApp, str]:
    """The real app (routes, auth, error map) over `ScriptedMachines`, and a key for it."""
    db = Database(tmp / "keys.db")
    keys = KeyService(db)
    secret = keys.ensure_default_local_key(os.getuid(), None)
    machines = ScriptedMachines()
    app = create_app(machines=machines, snapshots=FakeSnapshots(machines, tmp), keys=keys,
                     host_info=host_info, upload_dir=tmp / "uploads", private_dirs=(tmp,))
    return app, secret


def world_app(world: Any, tmp: Path, **kwargs: Any) -> tuple[ASGIApp, KeyService]:
    """The real app over a fake world's control plane (`tests._support.fake_world`), and
    its key service: what a test's in-process `Boxd` (``SyncASGITransport``) talks to.
    ``kwargs`` go to `create_app` (``images=``, say)."""
    keys = KeyService(world.repos.db)
    app = create_app(machines=world.machines, snapshots=world.snapshots, keys=keys,
                     host_info=host_info, upload_dir=tmp / "uploads",
                     private_dirs=(world.paths.home, world.paths.shm), **kwargs)
    return app, keys


@pytest.fixture
def no_daemon(paths: Paths, monkeypatch: pytest.MonkeyPatch) -> Paths:
    """A client with ``transport=`` must neither start nor dial the local daemon."""
    from boxd.sdk import _local

    def refuse(p: Paths) -> None:
        raise AssertionError("a client with transport= tried to start the local daemon")

    monkeypatch.setattr(_local, "ensure_daemon", refuse)
    return paths


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_daemon: Paths) -> Iterator[Any]:
    """A fake world (`tests._support.fake_world`) with no real daemon around it."""
    from tests._support.fake_world import make_world

    w = make_world(tmp_path, monkeypatch)
    yield w
    w.repos.db.close()


@pytest.fixture
def transport(world: Any, tmp_path: Path) -> Iterator[SyncASGITransport]:
    """The in-process app over ``world``, as an httpx transport carrying (``key``) a key
    of its account."""
    from tests._support.fake_world import ACCOUNT

    app, keys = world_app(world, tmp_path)
    t = SyncASGITransport(app)
    t.key = keys.create(ACCOUNT, "sdk").secret  # type: ignore[attr-defined]
    yield t
    t.close()


@pytest.fixture
def world_boxd(world: Any, tmp_path: Path) -> Iterator[Any]:
    """A sync client of the in-process app over ``world``, with a key of its account."""
    from boxd import Boxd
    from tests._support.fake_world import ACCOUNT

    app, keys = world_app(world, tmp_path)
    key = keys.create(ACCOUNT, "sdk").secret
    with Boxd(api_key=key, transport=SyncASGITransport(app)) as b:
        yield b

