"""The standby-children pool's bookkeeping (node/_spares.py), without QEMU.

Real spares (QEMU processes claimed by forks) are covered by
tests/integration/test_spares.py; this checks the caps, pruning and dead-spare handling
with a stand-in for the node runtime (the pool's `SpareMaker`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests._support.spares import FakeHandle, FakeMaker, make_pool, settle, tpl

from boxd.config import Settings
from boxd.node._spares import Spare, SparePool


def test_refill_follows_the_largest_batch_up_to_the_caps() -> None:
    async def main() -> None:
        pool, m = make_pool(per_template=3, total=4)
        m.current |= {"t1", "t2"}
        pool.want("src1", tpl("t1"), 1)
        await settle(pool)
        assert pool.count("t1") == 1
        pool.want("src1", tpl("t1"), 8)  # capped per template
        await settle(pool)
        assert pool.count("t1") == 3
        pool.want("src2", tpl("t2"), 8)  # capped across the daemon
        await settle(pool)
        assert pool.count("t2") == 1
        await pool.close()
        assert len(m.removed) == 4  # closing discards every spare's files

    asyncio.run(main())


def test_spares_off() -> None:
    async def main() -> None:
        pool, m = make_pool(per_template=0)
        m.current.add("t1")
        pool.want("src", tpl("t1"), 8)
        await settle(pool)
        assert pool.count("t1") == 0 and pool.take("t1") is None and m.made == 0

    asyncio.run(main())


def test_prune_kills_the_spares_of_a_stale_template() -> None:
    async def main() -> None:
        pool, m = make_pool()
        m.current |= {"t1", "t2"}
        pool.want("a", tpl("t1"), 2)
        pool.want("b", tpl("t2"), 1)
        await settle(pool)
        handles = [s.handle for s in pool._spares["t1"]]
        m.current.discard("t1")  # the source changed
        pool.prune()
        await settle(pool)
        assert pool.count("t1") == 0 and pool.count("t2") == 1
        assert all(h.destroyed for h in handles)  # type: ignore[attr-defined]
        await pool.close()

    asyncio.run(main())


def test_take_skips_dead_spares() -> None:
    async def main() -> None:
        pool, m = make_pool()
        m.current.add("t1")
        pool.want("a", tpl("t1"), 2)
        await settle(pool)
        first, second = pool._spares["t1"]
        first.handle._alive = False  # type: ignore[attr-defined]
        got = pool.take("t1")
        assert got is second  # the dead one is discarded, not handed out
        await settle(pool)
        assert first.handle.destroyed  # type: ignore[attr-defined]
        assert got is not None and pool.take("t1") is None
        await pool.close()

    asyncio.run(main())


def test_a_spare_made_for_a_template_that_went_stale_meanwhile_is_discarded() -> None:
    async def main() -> None:
        pool, m = make_pool()
        m.current.add("t1")
        m.after_prepare = lambda: m.current.discard("t1")  # an exec reached the source
        pool.want("a", tpl("t1"), 1)
        await settle(pool)
        assert pool.count("t1") == 0
        assert m.removed == ["m_1"]

    asyncio.run(main())


def test_a_fork_waits_for_a_spare_being_prepared_instead_of_starting_from_scratch() -> None:
    async def main() -> None:
        pool, m = make_pool()
        m.current.add("t1")
        assert await pool.claim("t1", timeout=5) is None  # nothing ready or coming: at once
        m.gate = asyncio.Event()
        pool.want("a", tpl("t1"), 3)  # two being prepared (two at a time)
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(pool.claim("t1", timeout=5)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert [w.done() for w in waiting] == [False, False, True]  # one per spare coming
        assert waiting[2].result() is None
        m.gate.set()
        got = [await w for w in waiting[:2]]
        assert all(isinstance(g, Spare) for g in got) and got[0] is not got[1]
        await settle(pool)
        assert pool.count("t1") == 3 and m.made == 5  # handed out two, then refilled
        await pool.close()

    asyncio.run(main())


def test_a_fork_waiting_for_a_spare_gives_up_after_its_timeout() -> None:
    async def main() -> None:
        pool, m = make_pool()
        m.current.add("t1")
        m.gate = asyncio.Event()
        pool.want("a", tpl("t1"), 1)
        await asyncio.sleep(0)
        assert await pool.claim("t1", timeout=0.01) is None
        m.gate.set()
        await settle(pool)
        assert pool.count("t1") == 1  # kept for the next fork
        await pool.close()

    asyncio.run(main())


def test_settings_that_are_not_numbers_fall_back() -> None:
    s = Settings.from_env({"BOXD_FORK_SPARES": "lots", "BOXD_FORK_SPARES_TOTAL": "-3"})
    assert s.fork_spares == 8
    assert s.fork_spares_total == 0
    assert Settings.from_env({}).fork_spares == 8


def test_refill_waits_for_a_burst_of_forks_to_pause() -> None:
    """With ``settle``, the spares a burst of forks took are replaced only once forks
    have paused that long (the restores do not compete with the burst's work), and at
    most ``3 * settle`` after the refill was wanted when forks never pause."""

    async def main() -> None:
        m = FakeMaker()
        pool = SparePool(m, per_template=8, total=32, settle=0.2)
        m.current.add("t1")
        pool.want("src", tpl("t1"), 2)
        await settle(pool)  # nothing taken yet: no wait
        assert pool.count("t1") == 2
        made = m.made
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert pool.take("t1") is not None
        pool.want("src", tpl("t1"), 2)
        await asyncio.sleep(0.1)
        assert pool.take("t1") is not None  # the burst goes on: the settle restarts
        await asyncio.sleep(0.1)
        assert m.made == made  # 0.1 s after the last take: still waiting
        await settle(pool)
        assert m.made == made + 2 and loop.time() - t0 >= 0.3 - 0.02
        # Forks that never pause: the refill starts 3 * settle after it was wanted.
        async def keep_forking() -> None:
            while loop.time() - t1 < 1.0:
                pool.take("t1")
                await asyncio.sleep(0.05)

        t1 = loop.time()
        forking = asyncio.create_task(keep_forking())
        await asyncio.sleep(0)  # it has taken one
        pool.want("src", tpl("t1"), 4)
        while m.made == made + 2:
            await asyncio.sleep(0.01)
        assert 0.6 - 0.05 <= loop.time() - t1 < 0.9
        await forking
        await settle(pool)
        await pool.close()

    asyncio.run(main())


def test_a_fork_that_finds_no_spare_ends_the_wait_and_gets_the_next_one() -> None:
    """While a refill waits for forks to pause, a fork that finds no spare ready does not
    start its child from scratch beside it: it hurries the refill and takes the spare."""

    async def main() -> None:
        m = FakeMaker()
        pool = SparePool(m, per_template=8, total=32, settle=5.0)
        m.current.add("t1")
        pool._last_take["t1"] = 0.0  # no fork yet: the first fill does not wait
        pool.want("src", tpl("t1"), 1)
        await settle(pool)
        assert pool.take("t1") is not None  # a fork took it ...
        pool.want("src", tpl("t1"), 1)  # ... and its refill now waits up to 5 s
        await asyncio.sleep(0.05)
        assert m.made == 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await pool.claim("t1", timeout=10)
        assert got is not None and got.vm_id == "m_2"
        assert loop.time() - t0 < 1.0, "the claim waited for the settle"
        await pool.close()  # the refill replacing m_2 waits for forks to pause: cancelled

    asyncio.run(main())


def test_closing_mid_refill_discards_the_spares_already_made() -> None:
    """The daemon closes while a refill prepares two spares: one is made, the other
    still restoring. Closing cancels the refill and waits for it; the made one is
    destroyed and its files removed (a cancelled gather would drop it, its sandbox
    still running with nobody to own it)."""

    class HalfMaker(FakeMaker):
        def __init__(self) -> None:
            super().__init__()
            self.handles: list[FakeHandle] = []
            self.cancelled = 0

        async def prepare_spare(self, source_id: str, tpl: Any) -> Spare:
            if self.made >= 1:
                try:
                    await asyncio.Event().wait()  # a restore that never ends
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            spare = await super().prepare_spare(source_id, tpl)
            self.handles.append(spare.handle)  # type: ignore[arg-type]
            return spare

    async def main() -> None:
        m = HalfMaker()
        pool = SparePool(m, per_template=8, total=8, parallel=2)
        m.current.add("t1")
        pool.want("src", tpl("t1"), 2)
        while m.made < 1:
            await asyncio.sleep(0.01)
        await pool.close()
        assert m.cancelled == 1
        assert [h.destroyed for h in m.handles] == [True]
        assert m.removed == ["m_1"] and pool.count("t1") == 0

    asyncio.run(main())
