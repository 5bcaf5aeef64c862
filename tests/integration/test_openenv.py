"""OpenEnv on real machines (issue 26's acceptance): openenv-core's own ``create_app``
server (``examples/openenv/counter_env.py``) runs in a gVisor machine prepared and
saved by the docs' recipe (``examples/openenv/serve_sessions.py``); unmodified
openenv-core clients reach machines started from that snapshot, and forks of one,
through ``boxd.openenv.BoxdProvider``.

openenv-core gets into the guest as the other guest packages of the suite do: the
*host* downloads wheels and uploads them (the guest reaches no package index). Only
what the server imports is installed: openenv-core without its dependencies, then
fastapi, uvicorn, pydantic, websockets, fastmcp and requests (``openenv.core.env_server``
imports fastmcp unguarded, ``openenv.core``'s client half requests; gradio, openai and
huggingface_hub it does not need).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from boxd import errors
from tests._support.bench import load_path as _load
from tests._support.rl_guest import REPO, _ok

pytest.importorskip("openenv.core.containers.runtime",
                    reason="openenv-core is not installed (pip install 'boxd[openenv]')")

from boxd.openenv import BoxdProvider

pytestmark = pytest.mark.vm

EXAMPLE = REPO / "examples" / "openenv" / "counter_env.py"
RECIPE = REPO / "examples" / "openenv" / "serve_sessions.py"
SNAPSHOT = "openenv-counter"
WHEELS = REPO / ".cache" / "wheels-openenv"


def _wheels(recipe: Any) -> list[Path]:
    """The recipe's wheels for the guest (``download_wheels``), or a skip naming pip's
    error when the host cannot download them."""
    try:
        wheels: list[Path] = recipe.download_wheels(WHEELS)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"host cannot download the openenv wheels: {(exc.stderr or '')[-500:]}")
    return wheels


@pytest.fixture(scope="module")
def counter() -> Any:
    """examples/openenv/counter_env.py: the env's server module and its client."""
    return _load(EXAMPLE)


@pytest.fixture(scope="module")
def recipe() -> Any:
    """examples/openenv/serve_sessions.py, the docs' recipe."""
    return _load(RECIPE)


@pytest.fixture(scope="module")
def openenv_snapshot(client: Any, gvisor_base: Any, recipe: Any) -> Iterator[str]:
    """The recipe's snapshot: a gVisor machine with openenv-core installed (from the
    host's wheels) and the example's server listening on port 8080, saved."""
    try:
        recipe.prepare(client, SNAPSHOT, WHEELS if _wheels(recipe) else None, engine="gvisor")
    except SystemExit as exc:
        raise AssertionError(str(exc)) from None
    yield SNAPSHOT
    with contextlib.suppress(errors.NotFound):
        client.snapshots.delete(SNAPSHOT)


@pytest.fixture(scope="module")
def openenv_base(client: Any, openenv_snapshot: str) -> Iterator[Any]:
    """A machine started from the recipe's snapshot, its server already answering
    ``/health`` through the machine's URL."""
    m = client.machines.new("openenv-base", from_snapshot=openenv_snapshot)
    try:
        m = client.machines.wait_until_ready(m.id)
        try:
            BoxdProvider(client).wait_for_ready(m.url, timeout_s=120)
        except TimeoutError:
            log = client.machines.exec(m.id, "cat /tmp/counter_env.server.log").stdout
            raise AssertionError(f"the server did not come up: {log[-2000:]}") from None
        yield m
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)


def test_the_recipe_serves_sessions_from_its_snapshot(
        client: Any, openenv_snapshot: str, recipe: Any, counter: Any) -> None:
    """The docs' recipe: each session a machine started from the snapshot (the
    provider's snapshot path), one first observation, each its own steps."""
    before = _machines(client)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(
            lambda i: recipe.session(client, counter, openenv_snapshot, i), range(2)))
    (first0, counts0), (first1, counts1) = results
    assert first0 == first1 and first0.count == 0
    assert counts0 == [1, 2, 3] and counts1 == [2, 4, 6]
    assert _machines(client) == before


def _machines(client: Any) -> set[str]:
    return {m.id for m in client.machines.list()}


def test_four_clients_get_four_forks_with_one_first_observation(
        client: Any, openenv_base: Any, counter: Any) -> None:
    before = _machines(client)

    async def session(i: int) -> tuple[str | None, Any, list[Any]]:
        provider = BoxdProvider(client)
        env = await counter.CounterClient.from_docker_image("openenv-base", provider=provider)
        try:
            first = await env.reset()
            steps = [await env.step(counter.CounterAction(delta=i + 1)) for _ in range(3)]
            return provider.machine, first.observation, [s.observation for s in steps]
        finally:
            await env.close()  # calls provider.stop_container()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # 4 sessions at once
        results = list(pool.map(lambda i: asyncio.run(session(i)), range(4)))
    machines = {r[0] for r in results}
    assert len(machines) == 4 and not machines & before
    firsts = [r[1] for r in results]
    # the same server process in every fork: its nonce (drawn at start) and pid
    assert all(f == firsts[0] for f in firsts), firsts
    assert firsts[0].count == 0 and firsts[0].log_lines == 0
    for i, (_, _, steps) in enumerate(results):  # each session saw only its own steps
        assert [s.count for s in steps] == [(i + 1) * n for n in (1, 2, 3)]
        assert [s.log_lines for s in steps] == [1, 2, 3]
        assert {s.nonce for s in steps} == {firsts[0].nonce}
    assert _machines(client) == before  # stop_container left no machine behind
    # the source's server was not touched by any session
    _ok(client, openenv_base.id, "test ! -e /tmp/counter_env.log")


def test_branch_continues_a_session_from_its_moment(
        client: Any, openenv_base: Any, counter: Any) -> None:
    before = _machines(client)
    provider = BoxdProvider(client)
    try:
        url = provider.start_container("openenv-base")
        provider.wait_for_ready(url)
        with counter.CounterClient(base_url=url).sync() as env:
            env.reset(seed=10)
            for _ in range(5):
                at5 = env.step(counter.CounterAction(delta=1)).observation
            assert at5.count == 15 and at5.log_lines == 5
            branches = provider.branch(url, 2)
            assert len(set(branches) | {url}) == 3
            # the original goes on, unaffected by its branches
            orig = env.step(counter.CounterAction(delta=100)).observation
            assert orig.count == 115 and orig.log_lines == 6
        continued = []
        for b in branches:  # a new session in each branch re-attaches to the episode
            provider.wait_for_ready(b)
            with counter.CounterClient(base_url=b).sync() as env:
                state = env.state()
                assert (state.step_count, state.count) == (5, 15)
                continued.append(env.step(counter.CounterAction(delta=2)))
        assert continued[0].observation.count == 17 and continued[0].observation.log_lines == 6
        # same moment, same action: the same step, reward (the server's RNG) included
        assert continued[0] == continued[1]
        assert continued[0].observation.nonce == at5.nonce
    finally:
        provider.stop_container()
    assert _machines(client) == before
