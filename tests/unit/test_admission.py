"""Admission (issue 42, item 4): ``wait=`` on new and fork queues a request that meets
its account's quota or nodes without room, first in first out per account, until room
comes or its deadline (then a 429 with ``retry_after`` and a Retry-After header).

The control plane, node runtime and SQLite state are real, over the fake engine
(tests/_support/fake_world.py); the SDK tests talk in process to the real FastAPI app.
The real-machine load test is tests/integration/test_admission.py.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World, running

from boxd import Boxd, cli, errors, models
from boxd.api.errors import error_response
from boxd.control.admission import Admission

paths = support.paths  # fixtures
no_daemon = support.no_daemon
world = support.world
boxd = support.world_boxd

pytestmark = pytest.mark.timeout(60)


def _run(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def _new(name: str, wait: float = 0.0) -> models.MachineCreate:
    return models.MachineCreate(name=name, wait=wait)


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


@_run
async def test_a_create_at_its_quota_waits_for_a_delete_then_runs(world: World) -> None:
    world.repos.accounts.set_quota(ACCOUNT, 2)
    await running(world, "a")
    await running(world, "b")
    waiting = asyncio.create_task(world.machines.create(ACCOUNT, _new("c", wait=30)))
    await _until(lambda: world.machines.queue(ACCOUNT).waiting == 1)
    await asyncio.sleep(0.3)  # several polls: still no room
    assert not waiting.done()
    q = world.machines.queue(ACCOUNT)
    assert [a.account for a in q.accounts] == [ACCOUNT] and q.accounts[0].oldest_seconds > 0
    await world.machines.delete(ACCOUNT, "a")
    made = await asyncio.wait_for(waiting, 10)
    assert made.name == "c"
    assert world.machines.queue(ACCOUNT).waiting == 0


@_run
async def test_without_wait_the_quota_answers_at_once(world: World) -> None:
    world.repos.accounts.set_quota(ACCOUNT, 1)
    await running(world, "a")
    with pytest.raises(errors.QuotaExceeded) as caught:
        await world.machines.create(ACCOUNT, _new("b"))
    assert caught.value.retry_after is None and world.machines.queue(ACCOUNT).waiting == 0


@_run
async def test_a_wait_without_room_ends_in_a_429_naming_the_limit(world: World) -> None:
    world.repos.accounts.set_quota(ACCOUNT, 1)
    await running(world, "a")
    with pytest.raises(errors.QuotaExceeded) as caught:
        await world.machines.create(ACCOUNT, _new("b", wait=0.5))
    exc = caught.value
    assert "no room after waiting" in exc.message and "machine quota reached" in exc.message
    assert exc.limit == 1 and exc.used == 1
    assert isinstance(exc.retry_after, int) and 1 <= exc.retry_after <= 60
    assert exc.details["waited"] >= 0.5
    assert [m.name for m in await world.machines.list(ACCOUNT)] == ["a"]  # nothing half-made


@_run
async def test_a_quota_of_zero_is_refused_at_once_however_long_the_wait(world: World) -> None:
    # No room can come to an account allowed no machine (the API fuzz's account with a
    # 120 s client timeout sent wait=3600): waiting would only hold the client.
    world.repos.accounts.set_quota(ACCOUNT, 0)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(errors.QuotaExceeded, match="machine quota reached") as caught:
        await world.machines.create(ACCOUNT, _new("a", wait=3600))
    assert asyncio.get_running_loop().time() - t0 < 5 and caught.value.limit == 0
    assert world.machines.queue(ACCOUNT).waiting == 0


@_run
async def test_each_accounts_queue_is_first_in_first_out(world: World) -> None:
    world.repos.accounts.set_quota(ACCOUNT, 1)
    await running(world, "x")
    first = asyncio.create_task(world.machines.create(ACCOUNT, _new("first", wait=30)))
    await _until(lambda: world.machines.queue(ACCOUNT).waiting == 1)
    # One slot comes with no signal (the first finds it at its next poll), and a late
    # request arrives at once: it would take the slot if it did not queue behind.
    world.repos.accounts.set_quota(ACCOUNT, 2)
    late = asyncio.create_task(world.machines.create(ACCOUNT, _new("late", wait=30)))
    assert (await asyncio.wait_for(first, 10)).name == "first"
    await asyncio.sleep(0.5)
    assert not late.done()  # the one slot went to the first; the late one still waits
    await world.machines.delete(ACCOUNT, "first")
    assert (await asyncio.wait_for(late, 10)).name == "late"


@_run
async def test_queued_requests_hold_their_turn_for_the_claim_not_the_boot(
    world: World, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both queued creates must get their slots while the first one still boots: the
    # first's boot waits until the second has claimed. Were the turn held for the
    # whole create, this would never end.
    world.repos.accounts.set_quota(ACCOUNT, 2)
    await running(world, "x")
    await running(world, "y")
    node = world.node
    inner = node.create
    claimed = asyncio.Event()

    async def slow_create(machine_id: str, boot: Any) -> Any:
        if world.repos.machines.get(machine_id).name == "one":  # type: ignore[union-attr]
            await claimed.wait()
        return await inner(machine_id, boot)

    monkeypatch.setattr(node, "create", slow_create)
    one = asyncio.create_task(world.machines.create(ACCOUNT, _new("one", wait=30)))
    await _until(lambda: world.machines.queue(ACCOUNT).waiting == 1)
    two = asyncio.create_task(world.machines.create(ACCOUNT, _new("two", wait=30)))
    await _until(lambda: world.machines.queue(ACCOUNT).waiting == 2)
    await world.machines.delete(ACCOUNT, "x")
    await world.machines.delete(ACCOUNT, "y")
    await _until(lambda: world.repos.machines.find(ACCOUNT, "two") is not None)
    claimed.set()
    made = await asyncio.wait_for(asyncio.gather(one, two), 10)
    assert sorted(m.name for m in made) == ["one", "two"]


@_run
async def test_fork_children_without_room_wait_and_the_others_go_at_once(
    world: World,
) -> None:
    world.repos.accounts.set_quota(ACCOUNT, 3)
    src = await running(world, "src")
    batch = asyncio.create_task(world.machines.fork(
        ACCOUNT, src.id, ["k0", "k1", "k2", "k3"], wait=30))
    # two children claimed their slots and started (a child deleted while it still
    # starts is its batch item's MachineNotFound); the other two wait
    await _until(lambda: world.machines.queue(ACCOUNT).waiting == 1 and sorted(
        r.state for r in world.repos.machines.list(ACCOUNT)) == [models.MachineState.RUNNING] * 3)
    made = sorted(r.name for r in world.repos.machines.list(ACCOUNT) if r.name != "src")
    assert len(made) == 2
    for name in made:
        await world.machines.delete(ACCOUNT, name)
    items = await asyncio.wait_for(batch, 10)
    # the two that waited got the freed slots; the two deleted are theirs as the batch
    # saw them last (running, or already gone: the item's answer races the delete)
    for name, item in zip(["k0", "k1", "k2", "k3"], items, strict=True):
        if name in made:
            assert isinstance(item, models.Machine | errors.MachineNotFound), item
        else:
            assert isinstance(item, models.Machine) and item.name == name, items


@_run
async def test_a_fork_batch_past_its_wait_gives_those_children_the_429(world: World) -> None:
    world.repos.accounts.set_quota(ACCOUNT, 2)
    src = await running(world, "src")
    items = await world.machines.fork(ACCOUNT, src.id, ["k0", "k1", "k2"], wait=0.4)
    assert isinstance(items[0], models.Machine)
    for item in items[1:]:
        assert isinstance(item, errors.QuotaExceeded) and item.retry_after is not None
    assert sorted(r.name for r in world.repos.machines.list(ACCOUNT)) == ["k0", "src"]


@_run
async def test_a_full_queue_refuses_at_once(world: World) -> None:
    world.repos.accounts.set_quota(ACCOUNT, 1)
    world.machines.admission = adm = Admission(per_account=2)
    world.repos.machines.on_free = adm.freed
    await running(world, "x")
    waiters = [asyncio.create_task(world.machines.create(ACCOUNT, _new(f"w{i}", wait=30)))
               for i in range(2)]
    await _until(lambda: world.machines.queue(ACCOUNT).waiting == 2)
    with pytest.raises(errors.QuotaExceeded, match="queue is full") as caught:
        await world.machines.create(ACCOUNT, _new("w2", wait=30))
    assert caught.value.retry_after is not None
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert world.machines.queue(ACCOUNT).waiting == 0  # a cancelled request leaves


@_run
async def test_a_delete_wakes_the_queue_without_waiting_for_a_poll(world: World) -> None:
    world.repos.accounts.set_quota(ACCOUNT, 1)
    world.machines.admission = adm = Admission(poll=3600)  # only the signal can wake it
    world.repos.machines.on_free = adm.freed
    await running(world, "x")
    waiting = asyncio.create_task(world.machines.create(ACCOUNT, _new("y", wait=600)))
    await _until(lambda: world.machines.queue(ACCOUNT).waiting == 1)
    await asyncio.sleep(0.1)  # it tried once and now waits for a signal
    await asyncio.to_thread(world.repos.machines.delete,  # from another thread, too
                            world.repos.machines.find(ACCOUNT, "x").id)  # type: ignore[union-attr]
    assert (await asyncio.wait_for(waiting, 10)).name == "y"


@_run
async def test_a_retry_with_another_wait_is_the_same_idempotent_request(world: World) -> None:
    first = await world.machines.create(ACCOUNT, _new("i", wait=5), "key-1")
    again = await world.machines.create(ACCOUNT, _new("i", wait=60), "key-1")
    assert again.id == first.id


# --------------------------------------------------------------- HTTP and SDK


def test_a_429_with_retry_after_carries_the_header() -> None:
    resp = error_response(errors.QuotaExceeded("full", limit=1, used=1, retry_after=2.2))
    assert resp.status_code == 429 and resp.headers["Retry-After"] == "3"
    assert "Retry-After" not in error_response(errors.QuotaExceeded("full")).headers


def test_the_sdk_waits_and_reads_the_429(boxd: Boxd, world: World) -> None:
    world.repos.accounts.set_quota(ACCOUNT, 1)
    boxd.machines.new("a")
    with pytest.raises(errors.QuotaExceeded) as caught:
        boxd.machines.new("b", wait=0.3)
    assert caught.value.retry_after is not None and "no room after waiting" in str(caught.value)
    (item,) = boxd.machines.fork("a", count=1, wait=0.3)
    assert isinstance(item, errors.QuotaExceeded) and item.retry_after is not None
    assert boxd.info().queue is not None and boxd.info().queue.waiting == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [-1, True, "5", models.MAX_WAIT + 1])
def test_the_sdk_refuses_a_bad_wait(boxd: Boxd, bad: Any) -> None:
    with pytest.raises(errors.InvalidRequest, match="wait"):
        boxd.machines.new("a", wait=bad)



def test_cli_new_and_fork_queue_and_info_shows_the_queue(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, keys = support.world_app(world, tmp_path)
    key = keys.create(ACCOUNT, "cli").secret
    transport = support.SyncASGITransport(app)
    monkeypatch.setattr(cli, "Boxd", lambda **_: Boxd(
        api_key=key, transport=support.KeptTransport(transport)))
    world.repos.accounts.set_quota(ACCOUNT, 1)
    try:
        def run(*args: str) -> tuple[int, str, str]:
            r = CliRunner().invoke(cli.main, list(args), catch_exceptions=False)
            return r.exit_code, r.stdout, r.stderr

        assert run("machine", "new", "a", "--queue", "0.2")[0] == 0
        code, _, err = run("machine", "new", "b", "--queue", "0.3", "--no-wait")
        assert code != 0 and "no room after waiting" in err, err
        code, _, err = run("machine", "fork", "a", "c", "--queue", "0.3")
        assert code != 0 and "no room after waiting" in err, err
        code, _, err = run("machine", "new", "b", "--queue", "-1")
        assert code == 2 and "--queue" in err
        code, out, _ = run("info")
        assert code == 0 and "none waiting" in out, out
    finally:
        transport.close()
