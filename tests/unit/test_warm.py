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
        count, why = await pool.warm("src", tpl("t1"), 5)
        assert (count, why) == (5, "")
        assert pool.count("t1") == 5 and maker.made == 5
        count, _ = await pool.warm("src", tpl("t1"), 2)  # smaller: the rest are discarded
        await settle(pool)
        assert count == 2 and pool.count("t1") == 2 and len(maker.removed) == 3
        assert await pool.warm("src", tpl("t1"), 0) == (0, "")
        await settle(pool)
        assert pool.count("t1") == 0 and len(maker.removed) == 5

    asyncio.run(main())


def test_warm_is_capped_by_the_total_and_says_why_when_short() -> None:
    async def main() -> None:
        pool, maker = make_pool(per_template=8, total=3)
        maker.current.add("t1")
        assert (await pool.warm("src", tpl("t1"), 5))[0] == 3

        failing, fmaker = make_pool()
        fmaker.current.add("t2")

        async def broken(source_id: str, t: Any) -> Any:
            raise errors.ResourceExhausted("host memory is low")

        fmaker.prepare_spare = broken  # type: ignore[method-assign]
        count, why = await failing.warm("src", tpl("t2"), 4)
        assert count == 0 and "host memory is low" in why

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
