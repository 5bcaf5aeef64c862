"""Fork children: from a source's template (`boxd.node._templates`), claimed standby
children first (`boxd.node._spares`), else launched (`boxd.node._launch`).

A fork checks and wakes its source, takes its template pinned (`Templates.template`),
starts each recorded child from it and unpins it once every child is started (each
then maps it: its record names it) or gone. A child that fails to start is purged, so
its quota slot is free again; the others run on. After each fork the template's
standby pool is refilled up to the number of children forked from it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from boxd import models
from boxd.config import Paths, Settings
from boxd.errors import BoxdError, ResourceExhausted
from boxd.models import MachineState
from boxd.node._host import Host
from boxd.node._launch import Launch, Launcher, failed_error
from boxd.node._ports import free_port
from boxd.node._processes import ProcessTable
from boxd.node._spares import Spare, SparePool
from boxd.node._standby import tree_pss
from boxd.node._templates import Templates
from boxd.node.lifecycle import ASLEEP, LIVE, TRANSIENT, Lease, require
from boxd.state import MachineRecord, Repos, TemplateRecord, new_id
from boxd.storage import disks
from boxd.storage.memory import remove_tree

log = logging.getLogger("boxd.node")

S = MachineState

# Seconds forks of a template must pause before its taken spares are replaced (see
# `SparePool`): a burst of forks runs its work before the refill competes for the CPU.
SPARE_SETTLE = 1.0
# How long a fork waits for a standby child that is being prepared (a gVisor restore
# takes ~0.3-0.7 s here) before it starts its child from scratch.
SPARE_WAIT = 5.0


class Machines(Protocol):
    """What forking needs of the node: records, leases, a source made ready."""

    def record(self, machine_id: str) -> MachineRecord: ...

    def lease(self, machine_id: str) -> Lease: ...

    def touch(self, machine_id: str) -> None: ...

    async def wait_until_ready(self, machine_id: str, timeout: float) -> None: ...


def results(out: list[BaseException | None]) -> list[Exception | None]:
    """Per child of a fork: its error, or None; a cancellation (not an Exception) is
    raised."""
    errors: list[Exception | None] = []
    for r in out:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r
        errors.append(r if isinstance(r, Exception) else None)
    return errors


class Forks:
    """Forks of one node's machines, and their standby children (its `SpareMaker`)."""

    def __init__(
        self, paths: Paths, repos: Repos, host: Host, settings: Settings, *,
        machines: Machines, templates: Templates, launcher: Launcher, procs: ProcessTable,
        purge: Callable[[str], Awaitable[None]],
    ) -> None:
        self.paths = paths
        self.repos = repos
        self.host = host
        self._machines = machines
        self._templates = templates
        self._launcher = launcher
        self._procs = procs
        self._purge = purge
        # Fork children being started per template right now: N one-child forks in
        # flight together (the spec's rollout threads) ask for N standby children, as
        # one fork of count N does.
        self._forking: dict[str, int] = {}
        self.spares = SparePool(self, per_template=settings.fork_spares,
                                total=settings.fork_spares_total,
                                per_account=settings.fork_spares_per_account,
                                settle=SPARE_SETTLE)

    async def source(self, source_id: str) -> tuple[MachineRecord, TemplateRecord]:
        """Check a fork's source, wake it if needed, and get its template (pinned: the
        caller unpins it)."""
        m = self._machines
        src = m.record(source_id)
        if src.state == S.FAILED:
            raise failed_error(src, src.error)
        if src.state in TRANSIENT:
            async with m.lease(source_id).op():
                pass
            src = m.record(source_id)
        require(src, *LIVE, *ASLEEP)
        if src.state == S.STARTING:
            await m.wait_until_ready(source_id, timeout=120)
        m.touch(source_id)
        tpl = await self._templates.template(source_id)
        try:
            return m.record(source_id), tpl
        except BaseException:
            self._templates.unpin(tpl.id)
            raise

    async def fork(self, source_id: str, child_ids: list[str]) -> list[Exception | None]:
        # The template stays pinned until every child is started (each then maps it:
        # its record names it) or gone: a delete of the source or a change and a gc
        # meanwhile leave its files and layers alone.
        src, tpl = await self.source(source_id)
        try:
            demand = self._forking[tpl.id] = self._forking.get(tpl.id, 0) + len(child_ids)
            try:
                out = await asyncio.gather(
                    *(self.start_child(src, tpl, cid) for cid in child_ids),
                    return_exceptions=True,
                )
            finally:
                self._forking[tpl.id] -= len(child_ids)
                if not self._forking[tpl.id]:
                    del self._forking[tpl.id]
            self.spares.want(source_id, tpl, demand, owner=src.account_id)
        finally:
            self._templates.unpin(tpl.id)
        errors = results(out)
        for cid, r in zip(child_ids, errors, strict=True):
            if r is None:
                self._procs.inherit(source_id, cid)
        # They count against the account's quota now: its standby forks here shrink to
        # what it could still claim.
        self.spares.forked(src.account_id, errors.count(None))
        return errors

    async def fork_received(
        self, src: MachineRecord, tpl: TemplateRecord, child_ids: list[str]
    ) -> list[Exception | None]:
        """Start recorded children of another node's machine ``src`` from ``tpl``, which
        the caller keeps pinned meanwhile (`Templates.receive` returned it so)."""
        out = await asyncio.gather(
            *(self.start_child(src, tpl, cid) for cid in child_ids),
            return_exceptions=True,
        )
        return results(out)

    async def start_child(self, src: MachineRecord, tpl: TemplateRecord, child_id: str) -> None:
        if not src.isolated:
            self.repos.machines.update(child_id, port=free_port())  # its URL
        rec = self._machines.record(child_id)
        t0 = time.monotonic()
        spare = await self.spares.claim(tpl.id, timeout=SPARE_WAIT)
        launch = Launch(
            self._templates.image(tpl, src.memory_mib),
            backing=self._templates.layer_path(tpl.layer_id), parent_layer=tpl.layer_id,
            disk_gib=src.disk_gib,
        )
        try:
            async with self._machines.lease(child_id).op():
                await self._launcher.start(rec, launch, template_id=tpl.id, spare=spare)
        except BaseException as exc:
            await self._purge(child_id)
            if isinstance(exc, BoxdError):
                exc.message = f"fork child {rec.name!r} failed: {exc.message}"
                exc.args = (exc.message,)
            raise
        finally:
            if spare is not None:  # claimed: the child's record (or the fork's pin) holds it
                self._templates.refs.release(spare.template_id, f"standby:{spare.vm_id}")
        log.info("machine=%s event=forked source=%s spare=%s seconds=%.3f", child_id, src.id,
                 spare is not None, time.monotonic() - t0)

    # ------------------------------------------------------------ warm

    async def warm(self, source_id: str, forks: int,
                   claimable: int | None = None) -> models.Standby:
        """Keep ``forks`` standby children of the source's current state (see
        `SparePool.warm`); 0 releases them without making a template. ``claimable``: how
        many more machines the source's account may start (its quota), which bounds the
        standby children its pools hold here."""
        src = self._machines.record(source_id)
        if forks == 0:
            tpl = self.repos.layers.template_for(source_id, src.generation)
            if tpl is not None:
                await self.spares.warm(source_id, tpl, 0, owner=src.account_id)
            return self._standby(src, tpl)
        if self.spares.total == 0:
            raise ResourceExhausted("standby forks are off on this node "
                                    "(BOXD_FORK_SPARES_TOTAL=0)",
                                    hint="set BOXD_FORK_SPARES_TOTAL above 0")
        src, tpl = await self.source(source_id)
        try:
            count, short = await self.spares.warm(source_id, tpl, forks, owner=src.account_id,
                                                  claimable=claimable)
        finally:
            self._templates.unpin(tpl.id)
        log.info("machine=%s event=warmed template=%s forks=%d of=%d", source_id, tpl.id,
                 count, forks)
        if short is not None:
            raise ResourceExhausted(
                f"{forks} standby forks of {src.name!r} were asked for and {count} are "
                f"ready: {short.why}", hint=short.hint, needed=forks, free=count)
        return self._standby(src, tpl)

    def _standby(self, src: MachineRecord, tpl: TemplateRecord | None) -> models.Standby:
        ready = self.spares.ready(tpl.id) if tpl is not None else []
        return models.Standby(machine_id=src.id, forks=len(ready), engine=src.engine,
                              memory_bytes=tree_pss(s.handle.pid for s in ready))

    # ------------------------------------------- standby children (SpareMaker)

    async def prepare_spare(self, source_id: str, tpl: TemplateRecord) -> Spare:
        """A standby child of ``tpl``: launched paused, no record (see `SparePool`)."""
        src = self._machines.record(source_id)
        await self.host.ready(src.engine)
        vm_id = new_id("m")
        port = None if src.isolated else free_port()
        config = self._launcher.config_for(
            vm_id, src.name, vcpus=src.vcpus, memory_mib=src.memory_mib,
            isolated=src.isolated, port=port, image_root=src.run_image is not None,
            net=src.net)
        try:
            # Pinned while it launches (it maps the template's files); once prepared it
            # lives only while the template is current (`SparePool.prune`).
            with self._templates.pinned(tpl):
                handle, layer_id = await self._launcher.launch(config, Launch(
                    self._templates.image(tpl, src.memory_mib),
                    backing=self._templates.layer_path(tpl.layer_id), parent_layer=tpl.layer_id,
                    paused=True, disk_gib=src.disk_gib,
                ), src.engine, record_layer=False)
                # It maps the template's files: held until it is claimed or discarded.
                self._templates.refs.acquire(tpl.id, f"standby:{vm_id}")
        except BaseException:
            remove_tree(self.paths.run_dir(vm_id))
            remove_tree(self.paths.machines / vm_id)
            raise
        assert layer_id is not None
        return Spare(vm_id, layer_id, port, handle, tpl.id)

    def remove_spare_files(self, spare: Spare) -> None:
        disks.remove(self._templates.layer_path(spare.layer_id))
        remove_tree(self.paths.run_dir(spare.vm_id))
        remove_tree(self.paths.machines / spare.vm_id)
        self._templates.refs.release(spare.template_id, f"standby:{spare.vm_id}")

    def template_is_current(self, template_id: str) -> bool:
        return self._templates.is_current(template_id)


__all__ = ["SPARE_SETTLE", "SPARE_WAIT", "Forks"]
