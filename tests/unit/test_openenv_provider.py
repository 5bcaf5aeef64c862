"""boxd.openenv.BoxdProvider against a real daemon over the fake engine (tests/unit/
test_sdk_support.py): what each session is a fork of, what stop leaves, typed refusals.
Its ``wait_for_ready`` polls a real loopback HTTP server of the test's."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
import test_sdk_support as support

from boxd import Boxd, errors
from boxd.api.server import Daemon
from boxd.openenv import BoxdProvider

pytest.importorskip("openenv.core.containers.runtime")
from openenv.core.containers.runtime import ContainerProvider  # noqa: E402

daemon = support.daemon  # fixtures
paths = support.paths


@pytest.fixture
def boxd(daemon: Daemon) -> Iterator[Boxd]:
    with Boxd() as c:
        c.machines.new("echo-warm")
        yield c


def test_a_session_is_a_fork_of_the_source_and_stop_deletes_it(boxd: Boxd) -> None:
    source = boxd.machines.get("echo-warm")
    provider = BoxdProvider(boxd)
    assert isinstance(provider, ContainerProvider)
    url = provider.start_container("echo-warm")
    fork = boxd.machines.get(provider.machine or "")
    assert fork.parent_id == source.id
    assert fork.url is not None and url == fork.url.rstrip("/")
    provider.stop_container()
    assert provider.machine is None
    assert [m.name for m in boxd.machines.list()] == ["echo-warm"]
    provider.stop_container()  # idempotent


def test_four_providers_give_four_forks(boxd: Boxd) -> None:
    providers = [BoxdProvider(boxd) for _ in range(4)]
    urls = [p.start_container("echo-warm") for p in providers]
    assert len(set(urls)) == 4
    assert len(boxd.machines.list()) == 5
    for p in providers:
        p.stop_container()
    assert [m.name for m in boxd.machines.list()] == ["echo-warm"]


def test_a_snapshot_name_starts_a_machine_from_it(boxd: Boxd) -> None:
    snap = boxd.snapshots.save("echo-warm", "echo-snap")
    provider = BoxdProvider(boxd)
    provider.start_container("echo-snap", name="from-snap")
    made = boxd.machines.get("from-snap")
    assert made.snapshot == snap.digest
    provider.stop_container()
    assert [m.name for m in boxd.machines.list()] == ["echo-warm"]


def test_branch_forks_the_session_and_stop_container_deletes_branches(boxd: Boxd) -> None:
    provider = BoxdProvider(boxd)
    url = provider.start_container("echo-warm")
    branches = provider.branch(url, 3)
    assert len(set(branches)) == 3 and url not in branches
    parents = {m.parent_id for m in boxd.machines.list() if m.url and m.url.rstrip("/") in branches}
    assert parents == {provider.machine}
    provider.stop(branches[0])
    assert len(boxd.machines.list()) == 4
    provider.stop_container()
    assert [m.name for m in boxd.machines.list()] == ["echo-warm"]


def test_refusals_are_typed(boxd: Boxd) -> None:
    provider = BoxdProvider(boxd)
    with pytest.raises(errors.NotFound, match="no machine and no snapshot named 'nope'"):
        provider.start_container("nope")
    with pytest.raises(errors.InvalidRequest, match="port 8000"):
        provider.start_container("echo-warm", port=8000)
    with pytest.raises(errors.InvalidRequest, match="env_vars"):
        provider.start_container("echo-warm", env_vars={"A": "1"})
    with pytest.raises(errors.InvalidRequest, match="cpu"):
        provider.start_container("echo-warm", cpu=2)
    url = provider.start_container("echo-warm")
    with pytest.raises(errors.InvalidRequest, match="already holds"):
        provider.start_container("echo-warm")
    with pytest.raises(errors.InvalidRequest, match="not a session"):
        provider.branch("http://127.0.0.1:1/x", 2)
    with pytest.raises(errors.InvalidRequest, match="k=0"):
        provider.branch(url, 0)
    provider.stop_container()
    assert [m.name for m in boxd.machines.list()] == ["echo-warm"]


class _Health(http.server.BaseHTTPRequestHandler):
    answers = [503, 503, 200]

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        code = self.answers.pop(0) if self.path == "/tok/health" and self.answers else 404
        self.send_response(code)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
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
