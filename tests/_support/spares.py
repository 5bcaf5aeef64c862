"""A stand-in for the node runtime behind `SparePool` (its `SpareMaker`), for the
standby pool's unit tests (tests/unit/test_spares.py, test_warm.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from boxd.node._spares import Spare, SparePool


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


class FakeMaker:
    """What SparePool uses of its node: make spares, remove their files, currency."""

    def __init__(self) -> None:
        self.current: set[str] = set()
        self.removed: list[str] = []
        self.made = 0
        self.after_prepare: Any = None
        self.gate: asyncio.Event | None = None  # when set: prepare waits for it

    async def prepare_spare(self, source_id: str, tpl: Any) -> Spare:
        if self.gate is not None:
            await self.gate.wait()
        self.made += 1
        spare = Spare(f"m_{self.made}", f"l_{self.made}", 10000 + self.made,
                      FakeHandle())  # type: ignore[arg-type]
        if self.after_prepare is not None:
            self.after_prepare()
        return spare

    def remove_spare_files(self, spare: Spare) -> None:
        self.removed.append(spare.vm_id)

    def template_is_current(self, template_id: str) -> bool:
        return template_id in self.current


def make_pool(per_template: int = 8, total: int = 32,
              per_account: int | None = None) -> tuple[SparePool, FakeMaker]:
    """A pool on a `FakeMaker`; one account's share is the whole node unless
    ``per_account`` says otherwise (the pool's own default is half of it)."""
    m = FakeMaker()
    share = total if per_account is None else per_account
    return SparePool(m, per_template=per_template, total=total, per_account=share), m


def tpl(tid: str) -> Any:
    return SimpleNamespace(id=tid)


async def settle(pool: SparePool) -> None:
    while pool._tasks:
        await asyncio.gather(*list(pool._tasks))
