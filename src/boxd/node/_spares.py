"""Standby fork children: prepared before anyone asks, claimed by the next fork.

A spare is a fork child of one template with all of the host-side work done: its qcow2
overlay is created, its QEMU process is started (``-incoming``), the template's device
state is loaded and its RAM is mapped. The guest has not run a single instruction, so a
claimed spare is exactly the child a fork would have started: claiming it only inserts
the machine's record, resumes the vCPU and sets the new identity. That takes the QEMU
start (~40 ms) and the overlay (~10 ms) off the fork's critical path. On gVisor a spare
is a restored, paused sandbox: the whole restore (~0.3-0.5 s here) and its network
namespace leave the fork's path, and the engine restores it at the lowest CPU priority
so that refilling does not slow the machines that just claimed spares.

After each fork the pool is refilled, in the background (two spares at a time), up to
the largest number of children forked from that template at once: one fork of count N,
or N one-child forks in flight together (at most ``BOXD_FORK_SPARES``, default 8; 0
turns spares off), and never beyond ``BOXD_FORK_SPARES_TOTAL`` (default 32) across the
daemon.
Spares live only while their template is the one the next fork would use: when the
source changes, is deleted or its template is collected, they are killed. They are
never in the database (a claimed spare's VM id becomes the record's ``vm_id``); a
restarted daemon kills the VM processes of run directories no machine owns (see
``NodeRuntime._sweep``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from boxd.engine.base import MachineHandle

if TYPE_CHECKING:
    from boxd.state import TemplateRecord

log = logging.getLogger("boxd.node")


@dataclass
class Spare:
    """One prepared, paused fork child of a template (its own VM id, no record)."""

    vm_id: str
    layer_id: str
    port: int | None
    handle: MachineHandle


class SpareMaker(Protocol):
    """What the pool needs of its node runtime."""

    async def prepare_spare(self, source_id: str, tpl: TemplateRecord) -> Spare: ...

    def remove_spare_files(self, spare: Spare) -> None: ...

    def template_is_current(self, template_id: str) -> bool: ...


class SparePool:
    """The spares of every template, and their background refill."""

    def __init__(self, maker: SpareMaker, *, per_template: int, total: int,
                 parallel: int = 2) -> None:
        self._maker = maker
        self.per_template = per_template
        self.total = total
        # Spares prepared at once: a gVisor spare is a CPU-bound restore (~0.3 s), so
        # two at a time refill a batch of 8 in about half the time on a 2-core host.
        self.parallel = max(1, parallel)
        self._spares: dict[str, list[Spare]] = {}
        self._target: dict[str, int] = {}
        self._refilling: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def count(self, template_id: str) -> int:
        return len(self._spares.get(template_id, []))

    def take(self, template_id: str) -> Spare | None:
        """A live spare of this template, or None."""
        pool = self._spares.get(template_id, [])
        while pool:
            spare = pool.pop(0)
            if spare.handle.alive():
                return spare
            log.warning("machine=%s event=spare_died reason=%r", spare.vm_id,
                        spare.handle.exit_reason())
            self._background(self._discard(spare))
        return None

    def want(self, source_id: str, tpl: TemplateRecord, batch: int) -> None:
        """After a fork of ``batch`` children: keep that many spares (capped) ready."""
        if self.per_template == 0:
            return
        self._target[tpl.id] = max(self._target.get(tpl.id, 0), min(batch, self.per_template))
        if tpl.id not in self._refilling:
            self._refilling.add(tpl.id)
            self._background(self._refill(source_id, tpl))

    def prune(self) -> None:
        """Kill the spares of templates the next fork would no longer use."""
        for tid in list(self._spares):
            if not self._maker.template_is_current(tid):
                for spare in self._spares.pop(tid):
                    self._background(self._discard(spare))
                self._target.pop(tid, None)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for tid in list(self._spares):
            for spare in self._spares.pop(tid):
                await self._discard(spare)

    # ----------------------------------------------------------------- internals

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refill(self, source_id: str, tpl: TemplateRecord) -> None:
        try:
            while self._maker.template_is_current(tpl.id):
                room = min(self._target.get(tpl.id, 0) - self.count(tpl.id),
                           self.total - sum(map(len, self._spares.values())), self.parallel)
                if room <= 0:
                    break
                made = await asyncio.gather(
                    *(self._maker.prepare_spare(source_id, tpl) for _ in range(room)),
                    return_exceptions=True)
                failed = [r for r in made if not isinstance(r, Spare)]
                spares = [r for r in made if isinstance(r, Spare)]
                if not self._maker.template_is_current(tpl.id):
                    for spare in spares:
                        await self._discard(spare)
                    break
                for spare in spares:
                    self._spares.setdefault(tpl.id, []).append(spare)
                    log.info("machine=%s event=spare_ready template=%s", spare.vm_id, tpl.id)
                for exc in failed:
                    if not isinstance(exc, Exception):
                        raise exc  # cancelled
                if failed:
                    # A spare is an optimisation: forks still work without.
                    log.warning("event=spare_failed template=%s error=%r", tpl.id, failed[0])
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("event=spare_failed template=%s error=%r", tpl.id, exc)
        finally:
            self._refilling.discard(tpl.id)

    async def _discard(self, spare: Spare) -> None:
        with contextlib.suppress(Exception):
            await spare.handle.destroy()
        self._maker.remove_spare_files(spare)


__all__ = ["Spare", "SpareMaker", "SparePool"]
