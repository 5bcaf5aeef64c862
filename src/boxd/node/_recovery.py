"""After a daemon (re)start: find the VMs of recorded machines again, sweep the rest.

A machine whose process is gone is failed with the reason; one left mid-launch
(``starting`` without a process) is failed; one left hibernating or waking ends
hibernated (its image is complete) or running (its VM still runs), never neither; a
suspended one stays suspended; ``deleting`` records are finished off. Then files and
processes no record knows are swept (standby children of a daemon that died among
them: spares are never recorded), and the idle timers start.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from boxd.config import Paths
from boxd.engine.base import Engine
from boxd.errors import MachineFailed
from boxd.models import MachineState
from boxd.node._guests import GuestRelay
from boxd.node._host import Host
from boxd.node._launch import Launcher
from boxd.node._proxy import PortProxy
from boxd.node.lifecycle import HAS_VM, TRANSIENT, Lifecycle
from boxd.state import MachineRecord, Repos
from boxd.storage.memory import is_sealed, remove_tree

log = logging.getLogger("boxd.node")

S = MachineState


class Recovery:
    """One node's recovery after a restart (once per process)."""

    def __init__(
        self, paths: Paths, repos: Repos, host: Host, lifecycle: Lifecycle, *, node_id: str,
        launcher: Launcher, guests: GuestRelay, proxy: PortProxy,
        purge: Callable[[str], Awaitable[None]], record: Callable[[str], MachineRecord],
    ) -> None:
        self.paths = paths
        self.repos = repos
        self.host = host
        self.lifecycle = lifecycle
        self._node_id = node_id
        self._launcher = launcher
        self._guests = guests
        self._proxy = proxy
        self._purge = purge
        self._rec = record
        self.done = False

    async def recover(self) -> None:
        """Re-attach, fail or finish every recorded machine of this node; sweep."""
        self.done = True
        machines, node = self.repos.machines, self._node_id
        for rec in machines.in_states((S.DELETING,), node):
            await self._purge(rec.id)
        for rec in machines.in_states((S.HIBERNATED,), node):
            if rec.pid:  # killed between recording the hibernation and ending the VM
                _, engine = await self.host.ready(rec.engine)
                engine.kill_stray(rec.vm_id, self._launcher.run_dir(rec.vm_id), rec.pid)
                machines.update(rec.id, pid=None)
        for rec in machines.in_states(HAS_VM, node):
            _, engine = await self.host.ready(rec.engine)
            await self._reattach(engine, rec)
        for rec in machines.in_states((*HAS_VM, S.HIBERNATED, S.FAILED), node):
            if rec.port and rec.fwd_port != rec.port:  # (equal: QEMU itself holds it)
                await self._proxy.open(rec.id, rec.port)
        await self._sweep()

    def _left_mid_launch(self, engine: Engine, rec: MachineRecord, image_ok: bool) -> None:
        # Killed mid-launch: its VM process may have started before the pid was
        # recorded (the run directory has it; the sweep skips recorded VM ids).
        if rec.vm_id and engine.kill_stray(rec.vm_id, self._launcher.run_dir(rec.vm_id)):
            log.info("machine=%s event=stray_vm_killed vm=%s", rec.id, rec.vm_id)
        if rec.state in (S.HIBERNATING, S.WAKING) and image_ok:
            self.lifecycle.move(rec.id, S.HIBERNATED, expect=(rec.state,))
        else:
            self.lifecycle.fail(rec.id, "the daemon stopped while the machine was launched")

    async def _reattach(self, engine: Engine, rec: MachineRecord) -> None:
        image_ok = is_sealed(self.paths.hibernated / rec.id)
        if not rec.pid or rec.layer_id is None:
            self._left_mid_launch(engine, rec, image_ok)
            return
        launcher = self._launcher
        try:
            handle = engine.attach(
                launcher.config(rec), launcher.run_dir(rec.vm_id), rec.pid,
                launcher.layer_path(rec.layer_id), rec.ram_shared, launcher.log_path(rec.vm_id),
            )
            undone = await handle.recover()
        except MachineFailed as exc:
            # Alive but not answering (a QMP timeout on a loaded host): its VM must not
            # run on under a failed or hibernated record, an orphan no one owns.
            if engine.kill_stray(rec.vm_id, launcher.run_dir(rec.vm_id), rec.pid):
                log.info("machine=%s event=unanswering_vm_killed vm=%s", rec.id, rec.vm_id)
            if rec.state in (S.HIBERNATING, S.WAKING) and image_ok:
                self.lifecycle.move(rec.id, S.HIBERNATED, expect=(rec.state,))
            else:
                self.lifecycle.fail(rec.id, exc.message)
            return
        if undone:
            log.info("machine=%s event=recovered undone=%r", rec.id, undone)
        launcher.install(rec.id, handle)
        if rec.state == S.SUSPENDED:
            await handle.pause()  # recover() resumed it: it was paused on purpose
        elif rec.state in TRANSIENT:
            remove_tree(self.paths.hibernated / rec.id)  # the VM ran on: drop a half image
            self.lifecycle.move(rec.id, S.RUNNING, expect=(rec.state,))
        if self._rec(rec.id).state in (S.RUNNING, S.SUSPENDED):
            # A new daemon: a new credential (relay_listen writes it).
            self._guests.serve(rec, handle, self._guests.new_key(rec))

    async def _sweep(self) -> None:
        """Remove run directories, templates and checkpoints no record knows."""
        known = self.repos.machines.vm_ids()
        await self._sweep_vms(known)
        for d in self.paths.machines.glob("*"):
            if d.name not in known:
                remove_tree(d)
        tpls = self.repos.layers.template_dirs()
        for d in self.paths.templates.glob("*"):
            if d.name not in tpls:
                remove_tree(d)
        cks = self.repos.checkpoints.ids()
        for d in self.paths.checkpoints.glob("*"):
            if d.name not in cks:
                remove_tree(d)
        for d in (self.paths.shm / "tmp").glob("*"):  # the folder itself keeps its modes
            remove_tree(d)
        layers = self.repos.layers.ids()
        for f in self.paths.disks.glob("*.qcow2*"):
            if f.name.split(".")[0] not in layers:
                f.unlink(missing_ok=True)

    async def _sweep_vms(self, known: set[str]) -> None:
        strays = [d for d in (self.paths.shm / "machines").glob("*") if d.name not in known]
        if strays:
            # Standby children of a daemon that died (spares are never recorded), or
            # machines whose records are gone: their VMs may still be running.
            await self.host.ready()
            for d in strays:
                if any(e.kill_stray(d.name, d) for e in self.host.engines.values()):
                    log.info("machine=%s event=stray_vm_killed", d.name)
                remove_tree(d)


__all__ = ["Recovery"]
