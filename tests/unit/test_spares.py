"""The standby-children pool's bookkeeping (core/_spares.py), without QEMU.

Real spares (QEMU processes claimed by forks) are covered by
tests/integration/test_spares.py; this checks the caps, pruning and dead-spare handling
with stand-ins for the machine handles and the database.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from boxd.core import _spares
from boxd.core._spares import Spare, SparePool


class FakeHandle:
    def __init__(self, alive: bool = True) -> None:
        self._alive = alive
        self.destroyed = False

    def alive(self) -> bool:
        return self._alive

    def exit_reason(self) -> str:
        return "killed in a test"

    async def destroy(self) -> None:
        self.destroyed = True


class FakeMachines:
    """What SparePool uses of Machines: db.one (is the template current?) and paths."""

    def __init__(self, tmp: Path) -> None:
        self.current: set[str] = set()
        self.db = SimpleNamespace(one=self._one)
        self.paths = SimpleNamespace(machines=tmp / "machines")
        self._tmp = tmp

    def _one(self, sql: str, args: tuple[Any, ...]) -> object | None:
        if "FROM templates" in sql:
            return (1,) if args[0] in self.current else None
        return {"id": args[0]}  # the source row

    def _layer_path(self, layer_id: str) -> Path:
        return self._tmp / f"{layer_id}.qcow2"

    def _run_dir(self, machine_id: str) -> Path:
        return self._tmp / "run" / machine_id


def make_pool(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SparePool, FakeMachines]:
    m = FakeMachines(tmp)
    pool = SparePool(m)  # type: ignore[arg-type]
    made = iter(range(1000))

    async def prepare(src: object, tpl: object) -> Spare:
        n = next(made)
        return Spare(f"m_{n}", f"l_{n}", 10000 + n, FakeHandle())  # type: ignore[arg-type]

    monkeypatch.setattr(pool, "_prepare", prepare)
    return pool, m


def tpl(tid: str) -> Any:
    return SimpleNamespace(id=tid)


async def settle(pool: SparePool) -> None:
    while pool._tasks:
        await asyncio.gather(*list(pool._tasks))


def test_refill_follows_the_largest_batch_up_to_the_caps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BOXD_FORK_SPARES", "3")
    monkeypatch.setenv("BOXD_FORK_SPARES_TOTAL", "4")

    async def main() -> None:
        pool, m = make_pool(tmp_path, monkeypatch)
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

    asyncio.run(main())


def test_spares_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOXD_FORK_SPARES", "0")

    async def main() -> None:
        pool, m = make_pool(tmp_path, monkeypatch)
        m.current.add("t1")
        pool.want("src", tpl("t1"), 8)
        await settle(pool)
        assert pool.count("t1") == 0 and pool.take("t1") is None

    asyncio.run(main())


def test_prune_kills_the_spares_of_a_stale_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        pool, m = make_pool(tmp_path, monkeypatch)
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


def test_take_skips_dead_spares_and_give_back_returns_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        pool, m = make_pool(tmp_path, monkeypatch)
        m.current.add("t1")
        pool.want("a", tpl("t1"), 2)
        await settle(pool)
        first, second = pool._spares["t1"]
        first.handle._alive = False  # type: ignore[attr-defined]
        got = pool.take("t1")
        assert got is second  # the dead one is discarded, not handed out
        await settle(pool)
        assert first.handle.destroyed  # type: ignore[attr-defined]
        assert got is not None
        pool.give_back("t1", got)
        assert pool.take("t1") is got
        await pool.close()

    asyncio.run(main())


def test_a_spare_made_for_a_template_that_went_stale_meanwhile_is_discarded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        pool, m = make_pool(tmp_path, monkeypatch)
        m.current.add("t1")
        real_prepare = pool._prepare
        made: list[Spare] = []

        async def prepare_then_stale(src: object, t: object) -> Spare:
            spare = await real_prepare(src, t)  # type: ignore[arg-type]
            made.append(spare)
            m.current.discard("t1")  # e.g. an exec reached the source meanwhile
            return spare

        monkeypatch.setattr(pool, "_prepare", prepare_then_stale)
        pool.want("a", tpl("t1"), 1)
        await settle(pool)
        assert pool.count("t1") == 0
        assert made and made[0].handle.destroyed  # type: ignore[attr-defined]

    asyncio.run(main())


def test_env_values_that_are_not_numbers_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOXD_FORK_SPARES", "lots")
    monkeypatch.setenv("BOXD_FORK_SPARES_TOTAL", "-3")
    assert _spares.max_spares() == 8
    assert _spares.max_total_spares() == 0
