"""Idempotent create and fork (issue 42, item 3): ``idempotency_key=`` / the
``Idempotency-Key`` header.

The SDK talks in process to the real FastAPI app on the real control plane, node
runtime and SQLite state over the fake engine (tests/_support/fake_world.py); the
concurrency and expiry tests call the control plane on one event loop, with its clock
replaced.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World, running

from boxd import AsyncBoxd, Boxd, cli, errors, models
from boxd.cli import main
from boxd.control.idempotency import KEY_MIN_TTL, KEY_TTL
from boxd.control.plane import Machines
from boxd.state import Database, Repos

paths = support.paths  # fixtures
no_daemon = support.no_daemon

pytestmark = pytest.mark.timeout(60)


world = support.world  # fixture


boxd = support.world_boxd  # fixture


def _run(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """An async test run on its own event loop."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def names(world: World) -> list[str]:
    return sorted(r.name for r in world.repos.machines.list(ACCOUNT))


# ----------------------------------------------------------------------- create


def test_a_create_retried_with_its_key_returns_the_first_machine(
    boxd: Boxd, world: World,
) -> None:
    first = boxd.machines.new(labels={"run": "1"}, idempotency_key="create-1")
    again = boxd.machines.new(labels={"run": "1"}, idempotency_key="create-1")
    assert again.id == first.id and again.name == first.name  # a generated name, once
    assert len(world.repos.machines.list(ACCOUNT)) == 1
    # the retry shows the machine as it is now, not as the first reply described it
    boxd.machines.wait_until_ready(first.id)
    assert boxd.machines.new(labels={"run": "1"}, idempotency_key="create-1").state == (
        models.MachineState.RUNNING)
    # another key is another request
    other = boxd.machines.new(labels={"run": "1"}, idempotency_key="create-2")
    assert other.id != first.id and len(world.repos.machines.list(ACCOUNT)) == 2
    # no key: every call creates
    assert boxd.machines.new().id not in (first.id, other.id)


def test_a_key_sent_with_another_request_is_a_typed_409(boxd: Boxd, world: World) -> None:
    first = boxd.machines.new("a", idempotency_key="k-1")
    with pytest.raises(errors.IdempotencyKeyReused, match="different request") as caught:
        boxd.machines.new("a", vcpus=2, idempotency_key="k-1")
    assert isinstance(caught.value, errors.Conflict) and caught.value.key == "k-1"
    boxd.machines.wait_until_ready("a")
    with pytest.raises(errors.IdempotencyKeyReused):  # a fork under a create's key
        boxd.machines.fork("a", "child", idempotency_key="k-1")
    resp = boxd._client().post("/v1/machines", json={"name": "b"},
                               headers={"Idempotency-Key": "k-1"})
    assert resp.status_code == 409, resp.text
    assert resp.json()["error"]["code"] == "idempotency_key_reused"
    assert names(world) == ["a"]
    assert boxd.machines.new("a", idempotency_key="k-1").id == first.id  # still the first's


def test_a_failed_request_releases_its_key(boxd: Boxd, world: World) -> None:
    boxd.machines.new("taken")
    with pytest.raises(errors.AlreadyExists):
        boxd.machines.new("taken", idempotency_key="k-fail")
    assert world.repos.idempotency.get(ACCOUNT, "k-fail") is None
    boxd.machines.delete("taken")
    made = boxd.machines.new("taken", idempotency_key="k-fail")  # the retry runs anew
    assert boxd.machines.new("taken", idempotency_key="k-fail").id == made.id


def test_bad_keys_are_refused_by_the_sdk_and_by_the_daemon(boxd: Boxd, world: World) -> None:
    for bad in ("", "a b", "k" * 256, "é", "line\n"):
        with pytest.raises(errors.InvalidRequest, match="idempotency key"):
            boxd.machines.new(idempotency_key=bad)
    for bad in ("a b", "k" * 256):
        resp = boxd._client().post("/v1/machines", json={},
                                   headers={"Idempotency-Key": bad})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["details"]["field"] == "Idempotency-Key"
    assert world.repos.machines.list(ACCOUNT) == []


def test_keys_are_per_account(world: World) -> None:
    world.repos.db.execute("INSERT INTO accounts (id, name, created_at) VALUES "
                           "('acct_other', 'other', 0)")

    async def main() -> None:
        mine = await world.machines.create(ACCOUNT, models.MachineCreate(), "same")
        theirs = await world.machines.create("acct_other", models.MachineCreate(), "same")
        assert mine.id != theirs.id

    asyncio.run(main())


# ------------------------------------------------------------------------- fork


def test_a_fork_retried_with_its_key_returns_the_same_children(
    boxd: Boxd, world: World,
) -> None:
    boxd.machines.new("base")
    boxd.machines.wait_until_ready("base")
    kids = boxd.machines.fork("base", count=3, idempotency_key="fork-1")
    again = boxd.machines.fork("base", count=3, idempotency_key="fork-1")
    assert [m.id for m in kids if isinstance(m, models.Machine)] == [
        m.id for m in again if isinstance(m, models.Machine)]
    assert len(kids) == 3 and len(world.repos.machines.list(ACCOUNT)) == 4
    with pytest.raises(errors.IdempotencyKeyReused):
        boxd.machines.fork("base", count=4, idempotency_key="fork-1")
    one = boxd.machines.fork("base", "one", idempotency_key="fork-2")
    assert boxd.machines.fork("base", "one", idempotency_key="fork-2").id == one.id
    assert len(world.repos.machines.list(ACCOUNT)) == 5


@_run
async def test_a_batch_item_error_is_replayed_typed(world: World) -> None:
    src = await running(world)
    await world.machines.create(ACCOUNT, models.MachineCreate(name="dup"))
    first = await world.machines.fork(ACCOUNT, src.id, ["dup", "fresh"],
                                      idempotency_key="fork-3")
    again = await world.machines.fork(ACCOUNT, src.id, ["dup", "fresh"],
                                      idempotency_key="fork-3")
    assert isinstance(first[0], errors.AlreadyExists)
    assert isinstance(again[0], errors.AlreadyExists) and again[0].message == first[0].message
    assert isinstance(first[1], models.Machine) and isinstance(again[1], models.Machine)
    assert again[1].id == first[1].id


@_run
async def test_a_fork_that_made_no_child_releases_its_key(world: World) -> None:
    src = await running(world)
    await world.machines.create(ACCOUNT, models.MachineCreate(name="dup"))
    items = await world.machines.fork(ACCOUNT, src.id, ["dup"], idempotency_key="fork-4")
    assert isinstance(items[0], errors.AlreadyExists)
    assert world.repos.idempotency.get(ACCOUNT, "fork-4") is None
    await world.machines.delete(ACCOUNT, "dup")
    (child,) = await world.machines.fork(ACCOUNT, src.id, ["dup"], idempotency_key="fork-4")
    assert isinstance(child, models.Machine) and child.name == "dup"


# ------------------------------------------------------------------ concurrency


def _slow(world: World, monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Make the plane's ``name`` (``_create``, ``_fork``) take a while; count its calls."""
    calls = [0]
    inner = getattr(world.machines, name)

    async def slow(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        await asyncio.sleep(0.2)
        return await inner(*args, **kwargs)

    monkeypatch.setattr(world.machines, name, slow)
    return calls


@_run
async def test_concurrent_creates_with_one_key_make_one_machine(
    world: World, monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _slow(world, monkeypatch, "_create")
    req = models.MachineCreate(labels={"run": "c"})
    made = await asyncio.gather(*(world.machines.create(ACCOUNT, req, "same") for _ in range(8)))
    assert {m.id for m in made} == {made[0].id} and calls == [1]
    assert len(world.repos.machines.list(ACCOUNT)) == 1


@_run
async def test_concurrent_forks_with_one_key_make_one_batch(
    world: World, monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = await running(world)
    calls = _slow(world, monkeypatch, "_fork")
    batches = await asyncio.gather(*(
        world.machines.fork(ACCOUNT, src.id, [None, None], idempotency_key="same")
        for _ in range(6)))
    ids = [[m.id for m in b if isinstance(m, models.Machine)] for b in batches]
    assert all(i == ids[0] for i in ids) and len(ids[0]) == 2 and calls == [1]
    assert len(world.repos.machines.list(ACCOUNT)) == 3


@_run
async def test_a_retry_waiting_for_a_first_that_fails_runs_anew(
    world: World, monkeypatch: pytest.MonkeyPatch,
) -> None:
    inner = world.machines._create
    calls = [0]

    async def first_fails(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        await asyncio.sleep(0.2)
        if calls[0] == 1:
            raise errors.ResourceExhausted("the host is full", needed=1, free=0)
        return await inner(*args, **kwargs)

    monkeypatch.setattr(world.machines, "_create", first_fails)
    req = models.MachineCreate()
    first, second, third = await asyncio.gather(
        *(world.machines.create(ACCOUNT, req, "k") for _ in range(3)), return_exceptions=True)
    assert isinstance(first, errors.ResourceExhausted)
    assert isinstance(second, models.Machine) and isinstance(third, models.Machine)
    assert second.id == third.id and calls == [2]
    assert len(world.repos.machines.list(ACCOUNT)) == 1


def test_concurrent_http_retries_make_one_machine(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the app and the async SDK: one event loop, many requests in flight."""
    _slow(world, monkeypatch, "_create")
    app, keys = support.world_app(world, tmp_path)
    key = keys.create(ACCOUNT, "sdk").secret

    async def main() -> list[str]:
        async with AsyncBoxd(api_key=key, transport=httpx.ASGITransport(app)) as b:
            made = await asyncio.gather(*(b.machines.new(idempotency_key="http")
                                          for _ in range(5)))
        return [m.id for m in made]

    ids = asyncio.run(main())
    assert len(set(ids)) == 1 and len(world.repos.machines.list(ACCOUNT)) == 1


# --------------------------------------------------------- expiry and storage


@_run
async def test_a_key_lives_at_least_an_hour_and_expires_after_its_ttl(world: World) -> None:
    now = [1_000_000.0]
    world.machines.idempotency.clock = lambda: now[0]
    req = models.MachineCreate()
    first = await world.machines.create(ACCOUNT, req, "k")
    now[0] += KEY_MIN_TTL + 1  # an hour later
    assert (await world.machines.create(ACCOUNT, req, "k")).id == first.id
    now[0] += KEY_TTL  # past 24 h: the key is free, a new request under it creates
    later = await world.machines.create(ACCOUNT, req, "k")
    assert later.id != first.id and len(world.repos.machines.list(ACCOUNT)) == 2
    # expired keys are pruned by the next keyed request
    await world.machines.create(ACCOUNT, req, "other")
    now[0] += KEY_TTL + 61
    await world.machines.create(ACCOUNT, req, "last")
    rows = world.repos.db.all("SELECT key FROM idempotency_keys")
    assert [r["key"] for r in rows] == ["last"]


@_run
async def test_an_account_holds_a_bounded_number_of_keys(world: World) -> None:
    now = [1_000_000.0]
    world.machines.idempotency.clock = lambda: now[0]
    world.machines.idempotency.max_keys = 3
    world.repos.accounts.set_quota(ACCOUNT, 20)
    req = models.MachineCreate()
    made = [await world.machines.create(ACCOUNT, req, f"k{i}") for i in range(3)]
    with pytest.raises(errors.QuotaExceeded, match="idempotency keys") as caught:
        await world.machines.create(ACCOUNT, req, "k3")
    assert caught.value.limit == "idempotency_keys"
    assert (await world.machines.create(ACCOUNT, req, "k0")).id == made[0].id  # retries pass
    now[0] += KEY_MIN_TTL + 1  # an hour on, the oldest key gives way to a new one
    await world.machines.create(ACCOUNT, req, "k3")
    assert world.repos.idempotency.get(ACCOUNT, "k0") is None
    assert world.repos.idempotency.count(ACCOUNT) == 3


@_run
async def test_keys_survive_a_restart_and_running_ones_are_released(world: World) -> None:
    req = models.MachineCreate()
    first = await world.machines.create(ACCOUNT, req, "kept")
    world.repos.db.execute(
        "INSERT INTO idempotency_keys (account_id, key, fingerprint, response, created_at, "
        "expires_at) VALUES (?, 'running', 'x', NULL, 0, 1e12)", (ACCOUNT,))
    # a new daemon: a new connection to the file, a new control plane, its recovery
    repos = Repos(Database(world.paths.db))
    try:
        plane = Machines(repos, world.machines.local, world.machines.store)
        await plane.recover()
        assert repos.idempotency.get(ACCOUNT, "running") is None
        assert (await plane.create(ACCOUNT, req, "kept")).id == first.id
        assert len(repos.machines.list(ACCOUNT)) == 1
    finally:
        repos.db.close()


# ------------------------------------------------------------------------- CLI


def _cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr



def test_cli_new_and_fork_take_an_idempotency_key(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, keys = support.world_app(world, tmp_path)
    key = keys.create(ACCOUNT, "cli").secret
    transport = support.SyncASGITransport(app)
    monkeypatch.setattr(cli, "Boxd", lambda **_: Boxd(
        api_key=key, transport=support.KeptTransport(transport)))
    try:
        code, out, _ = _cli("machine", "new", "a", "--idempotency-key", "cli-1", "--json")
        assert code == 0, out
        first = json.loads(out)["id"]
        code, out, err = _cli("machine", "new", "a", "--idempotency-key", "cli-1", "--json")
        assert code == 0 and json.loads(out)["id"] == first, err
        code, _, err = _cli("machine", "new", "b", "--idempotency-key", "cli-1")
        assert code != 0 and "different request" in err
        code, out, _ = _cli("machine", "fork", "a", "-n", "2", "--idempotency-key", "f",
                            "--json")
        assert code == 0, out
        kids = [m["id"] for m in json.loads(out)]
        code, out, _ = _cli("machine", "fork", "a", "-n", "2", "--idempotency-key", "f",
                            "--json")
        assert [m["id"] for m in json.loads(out)] == kids
        assert len(world.repos.machines.list(ACCOUNT)) == 3
    finally:
        transport.close()
