"""Suspend, hibernate and wake; and the idle policy that calls them.

`Sleep` moves a machine between ``running``, ``suspended`` (vCPUs stopped, memory
resident) and ``hibernated`` (memory and device state on disk, no VM process), each
step through `Lifecycle`. `IdleTimers` records activity (a request that needed the
machine; status reads never count) and, once a second, suspends and hibernates the
machines idle past their timers (``BOXD_SUSPEND_AFTER``, ``BOXD_HIBERNATE_AFTER`` or the
machine's own).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from boxd.config import Paths, Settings
from boxd.engine.base import MachineHandle, MemoryImage
from boxd.errors import BoxdError, Conflict
from boxd.models import MachineState
from boxd.node._launch import SWAP_DRAIN, Launch, Launcher, failed_error
from boxd.node._processes import ProcessTable
from boxd.node._templates import Templates
from boxd.node.lifecycle import Lease, Lifecycle, require
from boxd.state import MachineRecord, Repos
from boxd.storage.memory import is_sealed, remove_tree, seal

log = logging.getLogger("boxd.node")

S = MachineState


def _in_flight(rec: MachineRecord) -> Conflict:
    return Conflict(f"machine {rec.name!r} has requests in flight",
                    hint="retry when they have finished")


class Machines(Protocol):
    """What sleeping and waking need of the node: its records and leases."""

    def record(self, machine_id: str) -> MachineRecord: ...

    def lease(self, machine_id: str) -> Lease: ...

    def gc(self) -> None: ...


class IdleTimers:
    """Activity per machine, and the timer pass that puts idle machines to sleep."""

    def __init__(
        self, repos: Repos, settings: Settings, procs: ProcessTable, *, node_id: str,
        lease: Callable[[str], Lease],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
    ) -> None:
        self.repos = repos
        self.settings = settings
        self._procs = procs
        self._node_id = node_id
        self._lease = lease
        self._spawn = spawn
        self.interval = 1.0
        self._active: dict[str, float] = {}  # machine id -> last activity (seconds)
        self._active_written: dict[str, float] = {}
        self.ops: set[str] = set()  # machines an idle suspend or hibernate is under way on
        self._task: asyncio.Task[None] | None = None
        self.sleep: Sleep | None = None

    def touch(self, machine_id: str) -> None:
        """Activity: a request needed the machine (status reads never call this)."""
        now = time.time()
        self._active[machine_id] = now
        if now - self._active_written.get(machine_id, 0.0) >= 1.0:  # at most 1 write/s
            self._active_written[machine_id] = now
            self.repos.machines.touch(machine_id, now)

    def forget(self, machine_id: str) -> None:
        self._active.pop(machine_id, None)

    def last_active(self, rec: MachineRecord) -> float:
        return max(rec.last_active, self._active.get(rec.id, 0.0))

    def timers(self, rec: MachineRecord) -> tuple[float, float]:
        """(suspend_after, hibernate_after) in seconds for this machine; 0 is never."""
        sus = rec.suspend_after if rec.suspend_after is not None else self.settings.suspend_after
        hib = (rec.hibernate_after if rec.hibernate_after is not None
               else self.settings.hibernate_after)
        return sus, hib

    async def tick(self, now: float | None = None) -> None:
        """Suspend and hibernate the machines idle past their timers (one pass)."""
        assert self.sleep is not None
        now = time.time() if now is None else now
        for rec in self.repos.machines.in_states((S.RUNNING, S.SUSPENDED), self._node_id):
            lease = self._lease(rec.id)
            if rec.id in self.ops or lease.busy or lease.users or self._procs.busy(rec.id):
                continue
            idle = now - self.last_active(rec)
            sus, hib = self.timers(rec)
            if hib > 0 and idle >= hib:
                op = self.sleep.hibernate(rec.id, idle=True)
            elif rec.state == S.RUNNING and sus > 0 and idle >= sus:
                op = self.sleep.suspend(rec.id, idle=True)
            else:
                continue
            self.ops.add(rec.id)
            self._spawn(self._op(rec.id, op), f"idle {rec.id}")

    async def _op(self, machine_id: str, op: Any) -> None:
        try:
            await op
        except asyncio.CancelledError:
            raise
        except BoxdError as exc:  # gone meanwhile, or failed: the record says so
            log.warning("machine=%s event=idle_op_failed error=%s", machine_id, exc)
        finally:
            self.ops.discard(machine_id)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="idle timers")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the timer must outlive a bad pass
                log.exception("event=idle_tick_failed")


class Sleep:
    """Suspend, hibernate and wake the machines of one node."""

    def __init__(
        self, paths: Paths, repos: Repos, settings: Settings, lifecycle: Lifecycle, *,
        machines: Machines, launcher: Launcher, templates: Templates, timers: IdleTimers,
    ) -> None:
        self.paths = paths
        self.repos = repos
        self.settings = settings
        self.lifecycle = lifecycle
        self._machines = machines
        self._launcher = launcher
        self._templates = templates
        self._timers = timers
        timers.sleep = self

    def _handle(self, rec: MachineRecord) -> MachineHandle:
        handle = self._launcher.live.get(rec.id)
        if handle is None:
            raise failed_error(rec, "its VM process is not running")
        return handle

    async def step_clock(self, rec: MachineRecord, handle: MachineHandle) -> None:
        """After a wake: step the guest's wall clock to the host's (best effort)."""
        try:
            agent = await handle.agent(timeout=30)
            await agent.clock(time.time())
        except BoxdError as exc:
            log.warning("machine=%s event=clock_step_failed error=%s", rec.id, exc)

    async def resume(self, rec: MachineRecord) -> None:
        """Suspended → running (lease held): resume the vCPUs, step the clock."""
        handle = self._launcher.live.get(rec.id)
        if handle is None:
            self.lifecycle.fail(rec.id, "its VM process is not running")
            raise failed_error(rec, "its VM process is not running")
        t0 = time.perf_counter()
        await handle.resume()
        self.lifecycle.move(rec.id, S.RUNNING, expect=(S.SUSPENDED,))
        t1 = time.perf_counter()
        await self.step_clock(rec, handle)
        self._timers.touch(rec.id)
        log.info("machine=%s event=woke from=suspended resume_ms=%.3f clock_ms=%.3f",
                 rec.id, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)

    async def wake(self, rec: MachineRecord) -> None:
        """Hibernated → running (lease held): restore the VM from its image on disk.

        Raises:
            QuotaExceeded: the account has no free slot (the machine stays hibernated).
            MachineFailed: the image is missing or does not load (the machine is failed).
        """
        image_dir = self.paths.hibernated / rec.id
        if not is_sealed(image_dir) or not (image_dir / "state").is_file():
            reason = "its hibernation image is missing or incomplete"
            self.lifecycle.fail(rec.id, reason)
            raise failed_error(rec, reason)
        if not self.lifecycle.move(
            rec.id, S.WAKING, expect=(S.HIBERNATED,),
            quota=(rec.account_id, self.settings.default_max_machines),
        ):
            self._machines.record(rec.id)
            return
        t0 = time.perf_counter()
        rec = self._machines.record(rec.id)
        mem = image_dir / "mem"
        image = MemoryImage(mem if mem.is_file() else None, image_dir / "state", rec.memory_mib)
        assert rec.layer_id is not None
        try:
            handle = await self._launcher.start(
                rec, Launch(image, keep_disk=self._launcher.layer_path(rec.layer_id),
                            copy_memory=True, disk_gib=rec.disk_gib),
                identity=False,
            )
        except BoxdError as exc:
            raise failed_error(self._machines.record(rec.id), exc.message) from exc
        remove_tree(image_dir)
        await self.step_clock(rec, handle)
        self._timers.touch(rec.id)
        log.info("machine=%s event=woke from=hibernated seconds=%.3f", rec.id,
                 time.perf_counter() - t0)

    def _asleep_already(
        self, rec: MachineRecord, goal: MachineState, idle: bool, *from_: MachineState
    ) -> bool:
        """True when there is nothing to do (it is at ``goal`` already, or an idle
        timer finds it in a state it leaves alone); else check it may go to ``goal``."""
        if rec.state == goal:
            return True
        if idle and rec.state not in from_:
            return True
        if rec.state == S.FAILED:
            raise failed_error(rec, rec.error)
        require(rec, *from_)
        return False

    async def suspend(self, machine_id: str, *, idle: bool = False) -> None:
        """Stop a running machine's vCPUs; its memory stays resident.

        Raises:
            StateError: it is not running (e.g. hibernated, failed).
            Conflict: requests are in flight on it (only when asked for explicitly).
        """
        lease = self._machines.lease(machine_id)
        async with lease.op():
            rec = self._machines.record(machine_id)
            if self._asleep_already(rec, S.SUSPENDED, idle, S.RUNNING):
                return
            async with lease.replace(drain=0.0 if idle else SWAP_DRAIN):
                if lease.users:
                    if idle:
                        return  # a request slipped in: not idle after all
                    raise _in_flight(rec)
                handle = self._handle(rec)
                await handle.pause()
                self.lifecycle.move(machine_id, S.SUSPENDED, expect=(S.RUNNING,))
        log.info("machine=%s event=suspended idle=%s", machine_id, idle)

    async def hibernate(self, machine_id: str, *, idle: bool = False) -> None:
        """Write memory and device state to disk and end the VM process.

        Raises:
            StateError: it is neither running nor suspended.
            Conflict: requests are in flight on it (only when asked for explicitly).
        """
        lease = self._machines.lease(machine_id)
        async with lease.op():
            rec = self._machines.record(machine_id)
            if self._asleep_already(rec, S.HIBERNATED, idle, S.RUNNING, S.SUSPENDED):
                return
            async with lease.replace(drain=0.0 if idle else SWAP_DRAIN):
                if lease.users:
                    if idle:
                        return
                    raise _in_flight(rec)
                await self._hibernate(rec, self._handle(rec), idle)
        self._machines.gc()

    async def _hibernate(self, rec: MachineRecord, handle: MachineHandle, idle: bool) -> None:
        """`hibernate`'s work, the lease held and the gate closed."""
        machine_id = rec.id
        was = rec.state
        dest = self.paths.hibernated / machine_id

        async def undo() -> None:
            remove_tree(dest)
            if not handle.alive():  # failed, not back (the move back then misses)
                self.lifecycle.fail(machine_id, handle.exit_reason())
            elif was == S.RUNNING:
                await handle.resume()

        async with self.lifecycle.transition(
            rec, S.HIBERNATING, S.RUNNING, S.SUSPENDED, undo=undo
        ) as rec:
            remove_tree(dest)
            t0 = time.perf_counter()
            await self._templates.freeze_and_capture(rec, handle, dest, resume=False)
            await asyncio.to_thread(seal, dest)
        # Recorded first: a daemon killed now finds the machine hibernated (and kills
        # the VM process left over); never neither.
        self.lifecycle.move(machine_id, S.HIBERNATED, expect=(S.HIBERNATING,))
        self._launcher.retire(machine_id)
        await handle.destroy()
        self.repos.machines.update(machine_id, pid=None, template_id=None)
        log.info("machine=%s event=hibernated idle=%s seconds=%.3f", machine_id, idle,
                 time.perf_counter() - t0)


__all__ = ["IdleTimers", "Sleep"]
