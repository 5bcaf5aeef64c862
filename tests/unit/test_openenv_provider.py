"""boxd.openenv.BoxdProvider over the real app, control plane and node runtime on the
fake engine (in process, ``transport=``): what each session is a fork of, what stop
leaves, typed refusals; and an unmodified OpenEnv client (openenv-core's ``EnvClient``
and ``from_docker_image``) through a machine's URL, WebSocket included.

The fake machines' port 8080 is a real openenv-core server of the test's
(``examples/openenv/counter_env.py``, ``create_app`` under uvicorn on loopback): every
fake machine reaches the same server, so these tests show the wiring (URL, proxy,
WebSocket, provider lifecycle); what a fork copies is tested on real machines in
tests/integration/test_openenv.py.
"""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("openenv.core.containers.runtime",
                    reason="openenv-core is not installed (pip install 'boxd[openenv]')")

import uvicorn
from openenv.core.containers.runtime import ContainerProvider
from tests._support import sdk_daemon as support
from tests._support.api_fakes import host_info
from tests._support.fake_world import ACCOUNT, World, make_world
from tests._support.oci import make_image, write_layout

from boxd import Boxd, errors
from boxd.api import create_app
from boxd.api.services.images import ImageService
from boxd.api.services.keys import KeyService
from boxd.config import Paths
from boxd.engine.fake import FakeMachine
from boxd.images.oci import import_image
from boxd.openenv import BoxdProvider
from boxd.storage.oci import ImageStore

paths = support.paths  # fixtures
no_daemon = support.no_daemon

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openenv" / "counter_env.py"


def _counter_env() -> ModuleType:
    spec = importlib.util.spec_from_file_location("counter_env", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def counter() -> ModuleType:
    return _counter_env()


@pytest.fixture(scope="module")
def env_server(counter: ModuleType) -> Iterator[int]:
    """openenv-core's ``create_app`` server of the example env on a loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(counter.app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield port
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def boxd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_daemon: Paths,
         env_server: int) -> Iterator[Boxd]:
    async def open_http(
        self: FakeMachine, port: int = 8080
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if port not in (8080, 8000):  # the env server listens on both guest ports
            raise ConnectionRefusedError(f"nothing on guest port {port}")
        return await asyncio.open_connection("127.0.0.1", env_server)

    monkeypatch.setattr(FakeMachine, "open_http", open_http)
    w: World = make_world(tmp_path, monkeypatch)
    # A boxd image of the env: the fake machines' port 8000 is the env server above.
    layout = write_layout(tmp_path / "layout", {"v1": make_image([{"srv/x": b"x"}])})
    import_image(ImageStore(w.paths.images_store), f"oci:{layout}:v1",
                 f"{ACCOUNT}/envs/counter:v1")
    sick = make_image([{"srv/x": b"x"}], config={
        "Entrypoint": ["cat"], "Healthcheck": {"Test": ["CMD", "cat", "/no such"]}})
    layout = write_layout(tmp_path / "layout-sick", {"v1": sick})
    import_image(ImageStore(w.paths.images_store), f"oci:{layout}:v1",
                 f"{ACCOUNT}/envs/sick:v1")
    keys = KeyService(w.repos.db)
    app = create_app(machines=w.machines, snapshots=w.snapshots, keys=keys,
                     host_info=host_info, upload_dir=tmp_path / "uploads",
                     private_dirs=(w.paths.home, w.paths.shm),
                     images=ImageService(w.paths.images_store))
    with Boxd(api_key=keys.create(ACCOUNT, "sdk").secret,
              transport=support.SyncASGITransport(app)) as b:
        b.machines.new("echo-warm")
        b.machines.wait_until_ready("echo-warm")
        yield b
    w.repos.db.close()


def _names(boxd: Boxd) -> list[str]:
    return sorted(m.name for m in boxd.machines.list())


def test_a_session_is_a_fork_of_the_source_and_stop_deletes_it(boxd: Boxd) -> None:
    source = boxd.machines.get("echo-warm")
    provider = BoxdProvider(boxd)
    assert isinstance(provider, ContainerProvider)
    url = provider.start_container("echo-warm")
    fork = boxd.machines.get(provider.machine or "")
    assert fork.parent_id == source.id and fork.id != source.id
    assert fork.url is not None and url == fork.url.rstrip("/")
    provider.wait_for_ready(url, timeout_s=30)  # /health through the fork's URL
    provider.stop_container()
    assert provider.machine is None
    assert _names(boxd) == ["echo-warm"]
    provider.stop_container()  # idempotent


def test_an_unmodified_openenv_client_speaks_websocket_through_the_machine_url(
        boxd: Boxd, counter: ModuleType) -> None:
    provider = BoxdProvider(boxd)
    url = provider.start_container("echo-warm")
    provider.wait_for_ready(url)
    client = counter.CounterClient(base_url=url).sync()
    with client:
        first = client.reset(seed=5)
        assert first.observation.count == 5
        step = client.step(counter.CounterAction(delta=2))
        assert step.observation.count == 7 and step.observation.log_lines == 1
        assert client.state().step_count == 1
    provider.stop_container()
    assert _names(boxd) == ["echo-warm"]


def test_from_docker_image_with_provider_starts_and_its_close_stops_the_fork(
        boxd: Boxd, counter: ModuleType) -> None:
    async def session() -> tuple[int, str | None]:
        provider = BoxdProvider(boxd)
        env = await counter.CounterClient.from_docker_image("echo-warm", provider=provider)
        try:
            assert len(boxd.machines.list()) == 2  # the source and the session's fork
            machine = provider.machine
            result = await env.reset()
            await env.step(counter.CounterAction(delta=4))
            return int(result.observation.count), machine
        finally:
            await env.close()  # OpenEnv's close calls provider.stop_container()

    count, machine = asyncio.run(session())
    assert count == 0 and machine is not None
    assert _names(boxd) == ["echo-warm"]


def test_four_providers_give_four_forks(boxd: Boxd) -> None:
    providers = [BoxdProvider(boxd) for _ in range(4)]
    urls = [p.start_container("echo-warm") for p in providers]
    assert len(set(urls)) == 4
    assert len({p.machine for p in providers}) == 4
    assert len(boxd.machines.list()) == 5
    for p in providers:
        p.stop_container()
    assert _names(boxd) == ["echo-warm"]


def test_a_snapshot_name_starts_a_machine_from_it(boxd: Boxd) -> None:
    snap = boxd.snapshots.save("echo-warm", "echo-snap")
    provider = BoxdProvider(boxd)
    url = provider.start_container("echo-snap", name="from-snap")
    made = boxd.machines.get("from-snap")
    assert made.snapshot and snap.digest.endswith(made.snapshot) and made.url is not None
    assert url == made.url.rstrip("/")
    provider.stop_container()
    assert _names(boxd) == ["echo-warm"]


def test_branch_forks_the_session_and_stop_container_deletes_branches(boxd: Boxd) -> None:
    provider = BoxdProvider(boxd)
    url = provider.start_container("echo-warm")
    branches = provider.branch(url, 3)
    assert len(set(branches)) == 3 and url not in branches
    by_url = {(m.url or "").rstrip("/"): m for m in boxd.machines.list()}
    assert {by_url[b].parent_id for b in branches} == {provider.machine}
    deeper = provider.branch(branches[0], 1)  # a branch can be branched again
    assert by_url[branches[0]].id == boxd.machines.get(
        next(m.parent_id for m in boxd.machines.list()
             if (m.url or "").rstrip("/") == deeper[0]) or "").id
    provider.stop(branches[0])
    assert len(boxd.machines.list()) == 5  # the source, the session, 2 branches, 1 deeper
    with pytest.raises(errors.InvalidRequest, match="not a session"):
        provider.stop(branches[0])
    provider.stop_container()
    assert _names(boxd) == ["echo-warm"]


def test_a_session_on_another_guest_port_and_its_branches_reach_that_port(
        boxd: Boxd) -> None:
    provider = BoxdProvider(boxd)
    url = provider.start_container("echo-warm", port=8000)
    fork = boxd.machines.get(provider.machine or "")
    assert url == fork.url_for(8000) and url.endswith(".8000")
    provider.wait_for_ready(url, timeout_s=30)  # /health through the port-8000 URL
    branches = provider.branch(url, 2)
    assert all(b.endswith(".8000") for b in branches)
    for b in branches:
        provider.wait_for_ready(b, timeout_s=30)
    provider.stop_container()
    assert _names(boxd) == ["echo-warm"]


def test_refusals_are_typed(boxd: Boxd) -> None:
    provider = BoxdProvider(boxd)
    with pytest.raises(errors.NotFound,
                       match="no machine, no snapshot and no image named 'nope'"):
        provider.start_container("nope")
    with pytest.raises(errors.InvalidRequest, match="port 70000") as port:
        provider.start_container("echo-warm", port=70000)
    assert port.value.field == "port"
    with pytest.raises(errors.InvalidRequest, match="env_vars"):
        provider.start_container("echo-warm", env_vars={"A": "1"})
    with pytest.raises(errors.InvalidRequest, match="cpu"):
        provider.start_container("echo-warm", cpu=2)
    assert _names(boxd) == ["echo-warm"]  # nothing was forked by a refused call
    url = provider.start_container("echo-warm", port=8080)
    with pytest.raises(errors.InvalidRequest, match="already holds"):
        provider.start_container("echo-warm")
    with pytest.raises(errors.InvalidRequest, match="not a session"):
        provider.branch("http://127.0.0.1:1/x", 2)
    with pytest.raises(errors.InvalidRequest, match="k=0"):
        provider.branch(url, 0)
    provider.stop_container()
    assert _names(boxd) == ["echo-warm"]


def test_an_image_name_starts_one_baseline_that_every_session_forks(
        boxd: Boxd, counter: ModuleType) -> None:
    """``from_docker_image`` of a boxd image: the first session starts the image's
    baseline machine (named by its digest), waits for its /health on port 8000 (the
    image EXPOSEs none: OpenEnv's port), and forks it; the next session forks the same
    baseline; the sessions go at close, the baseline stays for the next one."""
    digest = boxd.images.get("envs/counter:v1").digest

    async def session() -> tuple[str | None, str | None, int]:
        provider = BoxdProvider(boxd)
        env = await counter.CounterClient.from_docker_image("envs/counter:v1",
                                                            provider=provider)
        try:
            fork = boxd.machines.get(provider.machine or "")
            assert fork.parent_id == provider.baseline
            assert str(env._ws_url).endswith(".8000/ws")  # the fork's port-8000 URL
            result = await env.step(counter.CounterAction(delta=3))
            return provider.baseline, provider.machine, int(result.observation.count)
        finally:
            await env.close()

    (base1, fork1, _), (base2, fork2, _) = asyncio.run(session()), asyncio.run(session())
    assert base1 == base2 and fork1 != fork2
    baseline = boxd.machines.get(base1 or "")
    assert baseline.name == f"openenv-{digest[7:19]}"
    assert baseline.image is not None and baseline.image.digest == digest
    assert _names(boxd) == ["echo-warm", baseline.name]  # the forks went at close


def test_a_baseline_another_session_started_is_forked_and_a_sick_one_goes(
        boxd: Boxd, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session that finds the baseline's name taken (another session started it)
    waits for that machine and forks it; a baseline whose service never gets ready is
    deleted by the session that started it, which raises, leaving nothing."""
    from boxd.openenv import _provider

    digest = boxd.images.get("envs/counter:v1").digest
    theirs = boxd.machines.new(_provider.baseline_name(digest), image=digest)
    provider = BoxdProvider(boxd)
    provider.start_container("envs/counter:v1")
    assert provider.baseline == theirs.id
    assert boxd.machines.get(provider.machine or "").parent_id == theirs.id
    provider.stop_container()
    assert boxd.machines.get(theirs.id).state == "running"  # not the session's to delete
    boxd.machines.delete(theirs.id)

    monkeypatch.setattr(_provider, "BASELINE_TIMEOUT", 1.5)
    with pytest.raises(errors.StateError, match="boxd machine logs"):
        BoxdProvider(boxd).start_container("envs/sick:v1")
    assert _names(boxd) == ["echo-warm"]


def test_an_image_port_is_its_first_exposed_tcp_port_else_8000() -> None:
    from boxd import models
    from boxd.openenv._provider import image_port

    def image(*ports: str) -> models.Image:
        return models.Image(name="x:v1", digest="sha256:" + "0" * 64,
                            config_digest="sha256:" + "1" * 64, layers=[], size=0,
                            architecture="amd64", os="linux", created="",
                            config=models.ImageRunConfig(exposed_ports=list(ports)))

    assert image_port(image()) == 8000
    assert image_port(image("9000/udp", "7000/tcp", "8000/tcp")) == 7000
    assert image_port(image("5000")) == 5000


class _Health(http.server.BaseHTTPRequestHandler):
    answers = [503, 503, 200]

    def do_GET(self) -> None:
        code = self.answers.pop(0) if self.path == "/tok/health" and self.answers else 404
        self.send_response(code)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_wait_for_ready_polls_health_until_200_then_times_out_typed() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/tok"
        provider = BoxdProvider(client=None)
        provider.wait_for_ready(base + "/", timeout_s=10)
        assert _Health.answers == []  # two 503s were polled past
        with pytest.raises(TimeoutError, match="HTTP 404"):
            provider.wait_for_ready(base, timeout_s=0.5)
    finally:
        server.shutdown()
        server.server_close()
