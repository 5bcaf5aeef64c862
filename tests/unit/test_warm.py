"""``machines.warm(ref, forks=N)``: a standby pool the user sizes (node/_spares.py
`SparePool.warm`, `NodeRuntime.warm`), on the fake engine. Real standby copies (QEMU
``-incoming`` children, frozen gVisor restores) are covered by
tests/integration/test_warm.py."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from tests._support.fake_world import ACCOUNT, World, make_world, running
from tests._support.spares import make_pool, settle, tpl

from boxd import errors, models


def test_warm_sizes_the_pool_past_the_per_template_cap_and_waits_for_it() -> None:
    async def main() -> None:
        pool, maker = make_pool(per_template=2, total=32)
        maker.current.add("t1")
        count, short = await pool.warm("src", tpl("t1"), 5)
        assert (count, short) == (5, None)
        assert pool.count("t1") == 5 and maker.made == 5
        count, _ = await pool.warm("src", tpl("t1"), 2)  # smaller: the rest are discarded
        await settle(pool)
        assert count == 2 and pool.count("t1") == 2 and len(maker.removed) == 3
        assert await pool.warm("src", tpl("t1"), 0) == (0, None)
        await settle(pool)
        assert pool.count("t1") == 0 and len(maker.removed) == 5

    asyncio.run(main())


def test_warm_is_capped_by_the_total_and_says_why_when_short() -> None:
    async def main() -> None:
        pool, maker = make_pool(per_template=8, total=3)
        maker.current.add("t1")
        count, short = await pool.warm("src", tpl("t1"), 5)  # refused whole: none made
        assert count == 0 and maker.made == 0 and pool.reserved() == 0
        assert short is not None and "at most 3 standby forks" in short.why
        assert "ask for at most 3" in short.hint
        assert (await pool.warm("src", tpl("t1"), 3)) == (3, None)

        failing, fmaker = make_pool()
        fmaker.current.add("t2")

        async def broken(source_id: str, t: Any) -> Any:
            raise errors.ResourceExhausted("host memory is low")

        fmaker.prepare_spare = broken  # type: ignore[method-assign]
        count, short = await failing.warm("src", tpl("t2"), 4)
        assert count == 0 and short is not None and "host memory is low" in short.why
        assert failing.reserved() == 0  # a warm that fell short holds nothing for it

    asyncio.run(main())


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    w = make_world(tmp_path, monkeypatch, spares=2)
    yield w
    w.repos.db.close()


def test_after_warm_n_concurrent_forks_are_all_claims(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        src = await running(world)
        standby = await world.machines.warm(ACCOUNT, src.id, 6)
        assert standby == models.Standby(machine_id=src.id, forks=6, engine="fake",
                                         memory_bytes=standby.memory_bytes)
        assert (await world.node.host_info()).standby_forks == 6
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="boxd.node"):
            kids = await asyncio.gather(
                *(world.machines.fork(ACCOUNT, src.id, [f"kid-{i}"]) for i in range(6)))
        forked = [r.getMessage() for r in caplog.records if "event=forked" in r.getMessage()]
        assert len(forked) == 6 and all("spare=True" in m for m in forked), forked
        assert all(isinstance(k[0], models.Machine) for k in kids)
        assert world.node.spares.ready() == [] or world.node.spares._tasks  # refilling
        await world.node.spares.close()

    asyncio.run(main())


def test_a_change_to_the_source_discards_its_standby_forks(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        assert (await world.machines.warm(ACCOUNT, src.id, 3)).forks == 3
        await world.machines.exec(ACCOUNT, src.id, models.ExecRequest(command="echo 1 > f"))
        for _ in range(100):
            if not world.node.spares.ready():
                break
            await asyncio.sleep(0.01)
        assert world.node.spares.ready() == []
        assert (await world.machines.warm(ACCOUNT, src.id, 0)).forks == 0
        await world.node.spares.close()

    asyncio.run(main())


def test_warm_zero_releases_and_bad_counts_are_refused(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        assert (await world.machines.warm(ACCOUNT, src.id, 0)).forks == 0  # nothing yet
        assert not list(world.paths.templates.glob("*"))  # and no template made for it
        assert (await world.machines.warm(ACCOUNT, src.id, 2)).forks == 2
        assert (await world.machines.warm(ACCOUNT, src.id, 0)).forks == 0
        with pytest.raises(errors.InvalidRequest, match="forks must be 0-64"):
            await world.machines.warm(ACCOUNT, src.id, 65)
        with pytest.raises(errors.MachineNotFound):
            await world.machines.warm(ACCOUNT, "nope", 2)
        await world.node.spares.close()

    asyncio.run(main())


# ------------------------------------------------ shared standby capacity (issue 39.5)


def test_concurrent_warm_calls_never_exceed_the_total_cap() -> None:
    """Five warm calls of two at once on a node capped at 6: the cap is reserved before
    any spare is launched, so at no moment do more than 6 exist; the calls it refuses
    say why."""
    async def main() -> None:
        pool, maker = make_pool(per_template=8, total=6)
        maker.gate = asyncio.Event()
        peak = 0

        def count_live() -> None:
            nonlocal peak
            peak = max(peak, maker.made - len(maker.removed))

        maker.after_prepare = count_live
        tids = [f"t{i}" for i in range(5)]
        maker.current |= set(tids)
        calls = [asyncio.ensure_future(pool.warm(f"src{i}", tpl(t), 2, owner=f"a{i}"))
                 for i, t in enumerate(tids)]
        await asyncio.sleep(0.05)  # every call has checked the cap and started its refill
        maker.gate.set()
        out = await asyncio.gather(*calls)
        await settle(pool)
        assert peak <= 6 and maker.made - len(maker.removed) <= 6, (peak, maker.made)
        assert len(pool.ready()) == 6 and pool.held() == 6
        refused = [short for count, short in out if short is not None]
        assert len(refused) == 2
        for short in refused:
            assert "at most 6 standby forks" in short.why and short.hint
        await pool.close()

    asyncio.run(main())


def test_one_account_holds_at_most_its_share_of_the_node() -> None:
    async def main() -> None:
        pool, maker = make_pool(per_template=8, total=6, per_account=0)  # default: half
        maker.current |= {"t1", "t2", "t3"}
        assert pool.per_account == 3
        count, short = await pool.warm("src1", tpl("t1"), 6, owner="greedy")
        assert count == 0 and short is not None and "at most 3 of this node's 6" in short.why
        assert (await pool.warm("src1", tpl("t1"), 3, owner="greedy")) == (3, None)
        count, short = await pool.warm("src2", tpl("t2"), 1, owner="greedy")  # another source
        assert short is not None and "yours hold 3 for other machines" in short.why
        # Another account still gets standby forks on the node.
        assert (await pool.warm("src3", tpl("t3"), 3, owner="other")) == (3, None)
        await pool.close()

    asyncio.run(main())


def test_an_account_holds_no_more_standby_forks_than_its_quota_could_claim() -> None:
    async def main() -> None:
        pool, maker = make_pool(per_template=8, total=6)
        maker.current |= {"t1", "t2"}
        count, short = await pool.warm("src1", tpl("t1"), 6, owner="a", claimable=2)
        assert count == 0 and short is not None and "start 2 more machine(s)" in short.why
        assert "ask for at most 2" in short.hint
        assert (await pool.warm("src1", tpl("t1"), 2, owner="a", claimable=2)) == (2, None)
        count, short = await pool.warm("src2", tpl("t2"), 1, owner="a", claimable=2)
        assert short is not None and "(2 held for other machines)" in short.why
        assert pool.held("a") == 2
        await pool.close()

    asyncio.run(main())


def test_forks_that_use_up_the_quota_shrink_the_accounts_standby_forks() -> None:
    async def main() -> None:
        pool, maker = make_pool(per_template=8, total=6)
        maker.current |= {"t1"}
        assert (await pool.warm("src1", tpl("t1"), 3, owner="a", claimable=3)) == (3, None)
        for _ in range(2):  # two forks claim two of them: one more machine may start
            assert pool.take("t1") is not None
        pool.forked("a", 2)
        await settle(pool)
        assert pool.count("t1") == 1 and pool.reserved("t1") == 1 and pool.held("a") == 1
        pool.forked("b", 5)  # another account's forks change nothing here
        assert pool.held("a") == 1
        # the two children deleted: the pool grows back to what warm asked for
        pool.freed("b", 2)  # (another account's deletes change nothing here)
        pool.freed("a", 2)
        await settle(pool)
        assert pool.count("t1") == 3 and pool.reserved("t1") == 3
        await pool.close()

    asyncio.run(main())


def test_warm_reservations_take_room_from_spares_forks_refilled_on_their_own() -> None:
    async def main() -> None:
        pool, maker = make_pool(per_template=8, total=6)
        maker.current |= {"auto", "t1"}
        pool.want("src0", tpl("auto"), 6, owner="a")  # a batch of 6 forks: 6 spares refill
        await settle(pool)
        assert pool.count("auto") == 6
        assert (await pool.warm("src1", tpl("t1"), 4, owner="b")) == (4, None)
        await settle(pool)
        assert pool.count("auto") == 2 and pool.held() == 6
        await pool.close()

    asyncio.run(main())


OTHER = "a_other"


def _account(world: World, account: str, quota: int) -> None:
    world.repos.db.execute(
        "INSERT INTO accounts (id, name, created_at, machine_quota) VALUES (?, ?, 0, ?)",
        (account, account, quota))


def test_warm_on_the_service_bounds_accounts_and_every_507_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39.5 (b), through the control plane: an account limited to 1 machine (its
    source) can warm no standby fork; another account's warm(1) on the same node then
    works; every refusal is a 507 whose message ends with a reason and has a hint."""
    w = make_world(tmp_path, monkeypatch, spares=2, spares_total=6)

    async def main() -> None:
        _account(w, "a_one", 1)
        _account(w, OTHER, 50)
        one = await running(w, "one-src", account="a_one")
        with pytest.raises(errors.ResourceExhausted) as refused:
            await w.machines.warm("a_one", one.id, 6)
        _assert_says_why(refused.value, "quota lets it start 0 more")
        assert w.node.spares.ready() == []
        other = await running(w, "other-src", account=OTHER)
        assert (await w.machines.warm(OTHER, other.id, 1)).forks == 1
        with pytest.raises(errors.ResourceExhausted) as refused:  # past its share (3 of 6)
            await w.machines.warm(OTHER, other.id, 4)
        _assert_says_why(refused.value, "one account holds at most 3")
        assert (await w.machines.warm(OTHER, other.id, 3)).forks == 3
        mine = await running(w, "mine-src")
        assert (await w.machines.warm(ACCOUNT, mine.id, 3)).forks == 3
        _account(w, "a_third", 50)
        third = await running(w, "third-src", account="a_third")
        with pytest.raises(errors.ResourceExhausted) as refused:  # the node is full
            await w.machines.warm("a_third", third.id, 1)
        _assert_says_why(refused.value, "at most 6 standby forks (BOXD_FORK_SPARES_TOTAL)")
        with pytest.raises(errors.ResourceExhausted) as refused:  # its quota binds first
            await w.machines.warm("a_one", one.id, 1)
        _assert_says_why(refused.value, "quota lets it start 0 more")
        assert len(w.node.spares.ready()) == 6
        await w.node.spares.close()

    try:
        asyncio.run(main())
    finally:
        w.repos.db.close()


def test_concurrent_warm_calls_on_the_service_keep_the_node_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39.5 (a): five concurrent warm(2) calls of five sources on a node capped at
    6 (``BOXD_FORK_SPARES_TOTAL``) leave at most 6 standby forks."""
    w = make_world(tmp_path, monkeypatch, spares=2, spares_total=6)

    async def main() -> None:
        for i in range(5):
            _account(w, f"a_{i}", 50)
        srcs = [await running(w, f"src-{i}", account=f"a_{i}") for i in range(5)]
        out = await asyncio.gather(
            *(w.machines.warm(f"a_{i}", s.id, 2) for i, s in enumerate(srcs)),
            return_exceptions=True)
        await asyncio.sleep(0.1)
        assert len(w.node.spares.ready()) <= 6
        assert len(w.engine.running) - len(srcs) <= 6  # standby VMs the engine runs
        for r in out:
            if isinstance(r, BaseException):
                _assert_says_why(r, "")
        assert sum(isinstance(r, models.Standby) for r in out) == 3
        await w.node.spares.close()

    try:
        asyncio.run(main())
    finally:
        w.repos.db.close()


def test_a_warmed_pool_is_not_refilled_past_what_the_account_could_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An account with a quota of 3 machines (its source and two more) warms 2 standby
    forks and forks 2 children: its quota is full, so the pool is not refilled with
    standby forks it could never claim."""
    w = make_world(tmp_path, monkeypatch, spares=2, spares_total=6)

    async def main() -> None:
        _account(w, "a_three", 3)
        src = await running(w, "three-src", account="a_three")
        assert (await w.machines.warm("a_three", src.id, 2)).forks == 2
        kids = await w.machines.fork("a_three", src.id, ["k1", "k2"])
        assert all(isinstance(k, models.Machine) for k in kids), kids
        await asyncio.sleep(0.2)
        while w.node.spares._tasks:
            await asyncio.gather(*list(w.node.spares._tasks))
        assert w.node.spares.ready() == []
        await w.node.spares.close()

    try:
        asyncio.run(main())
    finally:
        w.repos.db.close()


def test_forks_within_the_quota_still_refill_their_standby_forks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quota bound trims only what the account could not claim: an account that
    warmed one source and forks another, with room to spare, gets that fork's standby
    child refilled as before."""
    w = make_world(tmp_path, monkeypatch, spares=2, spares_total=6)

    async def main() -> None:
        _account(w, "a_roomy", 10)
        warmed = await running(w, "warmed", account="a_roomy")
        assert (await w.machines.warm("a_roomy", warmed.id, 2)).forks == 2
        other = await running(w, "other", account="a_roomy")
        kids = await w.machines.fork("a_roomy", other.id, ["k1"])
        assert isinstance(kids[0], models.Machine), kids
        for _ in range(300):
            if len(w.node.spares.ready()) == 3:
                break
            await asyncio.sleep(0.01)
        assert len(w.node.spares.ready()) == 3  # 2 warmed + the fork's refill
        await w.node.spares.close()

    try:
        asyncio.run(main())
    finally:
        w.repos.db.close()


def test_a_warm_pool_keeps_serving_forks_deleted_one_by_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer (or E2B's warm template) forks the warm source, runs, deletes, again
    and again: many more children than its quota's headroom, never more at once. Every
    fork after the first claims a standby fork: deletes give the quota back (the pool
    had stayed empty once forks had counted to the headroom)."""
    w = make_world(tmp_path, monkeypatch, spares=2, spares_total=6)

    async def main() -> None:
        _account(w, "a_loop", 4)
        src = await running(w, "src", account="a_loop")
        assert (await w.machines.warm("a_loop", src.id, 2)).forks == 2
        claimed = 0
        for i in range(10):
            for _ in range(300):  # the refill after the last delete
                if len(w.node.spares.ready()) == 2:
                    break
                await asyncio.sleep(0.01)
            before = len(w.node.spares.ready())
            (kid,) = await w.machines.fork("a_loop", src.id, [f"k{i}"])
            assert isinstance(kid, models.Machine), kid
            claimed += before - len(w.node.spares.ready()) > 0
            await w.machines.delete("a_loop", kid.id)
        assert claimed == 10
        await w.node.spares.close()

    try:
        asyncio.run(main())
    finally:
        w.repos.db.close()


def _assert_says_why(exc: BaseException, reason: str) -> None:
    assert isinstance(exc, errors.ResourceExhausted), exc
    message = str(exc)
    assert not message.rstrip().endswith(":"), message
    assert message.split("are ready: ", 1)[1].strip(), message
    assert reason in message, message
    assert exc.hint, message


def test_a_create_that_fails_gives_back_no_more_headroom_than_it_took(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A create counts against the account's headroom in its warm pools, and its delete
    gives the slot back. Before: a create that failed (its record purged, which gives a
    slot back) had not counted yet, so each failure left the pools one more slot than
    the quota allows."""
    w = make_world(tmp_path, monkeypatch, spares=2, spares_total=6)

    async def main() -> None:
        _account(w, "a_fail", 4)
        src = await running(w, "src", account="a_fail")
        assert (await w.machines.warm("a_fail", src.id, 2)).forks == 2
        before = w.node.spares.claimable("a_fail")
        assert before is not None
        for i in range(3):
            w.engine.failures["boot"] = errors.MachineFailed("the VM died while booting")
            with pytest.raises(errors.MachineFailed):
                await w.machines.create("a_fail", models.MachineCreate(name=f"bad{i}"))
        assert w.node.spares.claimable("a_fail") == before
        ok = await w.machines.create("a_fail", models.MachineCreate(name="good"))
        assert w.node.spares.claimable("a_fail") == before - 1
        await w.machines.delete("a_fail", ok.id)
        assert w.node.spares.claimable("a_fail") == before
        await w.node.spares.close()

    try:
        asyncio.run(main())
    finally:
        w.repos.db.close()
