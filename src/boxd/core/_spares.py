"""Standby fork children: prepared before anyone asks, claimed by the next fork.

A spare is a fork child of one template with all of the host-side work done: its qcow2
overlay is created, its QEMU process is started (``-incoming``), the template's device
state is loaded and its RAM is mapped. The guest has not run a single instruction, so a
claimed spare is exactly the child a fork would have started: claiming it only inserts
the machine's record, resumes the vCPU and sets the new identity. That takes the QEMU
start (~40 ms) and the overlay (~10 ms) off the fork's critical path.

After each fork the pool is refilled, in the background, up to the size of the largest
batch forked from that template (at most ``BOXD_FORK_SPARES``, default 8; 0 turns spares
off), and never beyond ``BOXD_FORK_SPARES_TOTAL`` (default 32) across the daemon.
Spares live only while their template is the one the next fork would use: when the
source changes, is deleted or its template is collected, they are killed. They are
never in the database; a restarted daemon kills the QEMU processes of run directories
no machine owns (see ``Machines._sweep``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from boxd.engine.base import BootDisk
from boxd.engine.qemu import QemuMachine
from boxd.state import new_id
from boxd.storage import disks
from boxd.storage.memory import remove_tree

if TYPE_CHECKING:
    import sqlite3

    from boxd.core.machines import Machines, Template

log = logging.getLogger("boxd.core")


def _env_int(name: str, default: int) -> int:
    try:
        return max(0, int(os.environ.get(name, str(default))))
    except ValueError:
        return default


def max_spares() -> int:
    """Spares kept per template (``BOXD_FORK_SPARES``, default 8; 0 disables)."""
    return _env_int("BOXD_FORK_SPARES", 8)


def max_total_spares() -> int:
    """Spares kept across all templates of the daemon (``BOXD_FORK_SPARES_TOTAL``, 32)."""
    return _env_int("BOXD_FORK_SPARES_TOTAL", 32)


@dataclass
class Spare:
    """One prepared, paused fork child of a template."""

    machine_id: str
    layer_id: str
    port: int | None
    handle: QemuMachine


class SparePool:
    """The spares of every template, and their background refill."""

    def __init__(self, machines: Machines) -> None:
        self._m = machines
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
            log.warning("machine=%s event=spare_died reason=%r", spare.machine_id,
                        spare.handle.exit_reason())
            self._background(self._discard(spare))
        return None

    def give_back(self, template_id: str, spare: Spare) -> None:
        """Return an unused spare (its fork failed before using it)."""
        self._spares.setdefault(template_id, []).insert(0, spare)

    def want(self, source_id: str, tpl: Template, batch: int) -> None:
        """After a fork of ``batch`` children: keep that many spares (capped) ready."""
        cap = max_spares()
        if cap == 0:
            return
        self._target[tpl.id] = max(self._target.get(tpl.id, 0), min(batch, cap))
        if tpl.id not in self._refilling:
            self._refilling.add(tpl.id)
            self._background(self._refill(source_id, tpl))

    def prune(self) -> None:
        """Kill the spares of templates the next fork would no longer use."""
        for tid in list(self._spares):
            if not self._current(tid):
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

    def _current(self, template_id: str) -> bool:
        row = self._m.db.one(
            "SELECT 1 FROM templates t JOIN machines s ON s.id=t.source_id"
            " WHERE t.id=? AND s.generation=t.generation AND s.state IN ('running','starting')"
            " AND t.created_at=(SELECT MAX(created_at) FROM templates WHERE source_id=s.id)",
            (template_id,),
        )
        return row is not None

    async def _refill(self, source_id: str, tpl: Template) -> None:
        try:
            while (self.count(tpl.id) < self._target.get(tpl.id, 0)
                   and sum(map(len, self._spares.values())) < max_total_spares()
                   and self._current(tpl.id)):
                src = self._m.db.one("SELECT * FROM machines WHERE id=?", (source_id,))
                if src is None:
                    break
                spare = await self._prepare(src, tpl)
                if not self._current(tpl.id):
                    await self._discard(spare)
                    break
                self._spares.setdefault(tpl.id, []).append(spare)
                log.info("machine=%s event=spare_ready template=%s", spare.machine_id, tpl.id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a spare is an optimisation: forks still work without
            log.warning("event=spare_failed template=%s error=%r", tpl.id, exc)
        finally:
            self._refilling.discard(tpl.id)

    async def _prepare(self, src: sqlite3.Row, tpl: Template) -> Spare:
        from boxd.core.machines import free_port

        m = self._m
        _, engine = await m.host.ready()
        machine_id, layer_id = new_id("m"), new_id("l")
        port = None if src["isolated"] else free_port()
        layer = m._layer_path(layer_id)
        try:
            await disks.create_overlay(
                layer, m._layer_path(tpl.layer_id), "qcow2", src["disk_gib"], owner=m._owner()
            )
            config = m._config_for(
                machine_id, src["name"], vcpus=src["vcpus"], memory_mib=src["memory_mib"],
                isolated=bool(src["isolated"]), port=port,
            )
            handle = await engine.start_from(
                config, BootDisk(layer), tpl.image, m._run_dir(machine_id),
                m._log_path(machine_id), copy_memory=False, paused=True,
            )
        except BaseException:
            self._remove_files(machine_id, layer_id)
            raise
        return Spare(machine_id, layer_id, port, handle)

    async def _discard(self, spare: Spare) -> None:
        with contextlib.suppress(Exception):
            await spare.handle.destroy()
        self._remove_files(spare.machine_id, spare.layer_id)

    def _remove_files(self, machine_id: str, layer_id: str) -> None:
        """A spare's overlay, run directory and log directory (it has no records)."""
        m = self._m
        disks.remove(m._layer_path(layer_id))
        remove_tree(m._run_dir(machine_id))
        remove_tree(m.paths.machines / machine_id)


__all__ = ["Spare", "SparePool", "max_spares", "max_total_spares"]
