"""Machine metrics: samples of a running machine's CPU, memory and disk, from its guest.

A sample is one ``metrics`` request to the guest agent (protocol 1.8): agent.py reads
/proc/stat, /proc/meminfo and statvfs("/") in its own process, so a sample costs one
round trip on the agent channel and starts nothing in the guest. CPU use is the busy
share of the clock ticks between a machine's sample and the one before it (its first
sample: since the guest booted).

When: a request for a machine's metrics samples it now (unless its newest sample is
under a second old) and makes it *watched* for `WATCH` seconds; one task of the node
samples every watched machine every `models.METRICS_INTERVAL` seconds and ends when
none is watched. Why not every machine all the time: a sample is a request to a guest,
and a node may have hundreds of machines nobody looks at; an idle machine must stay
idle (a sample is not activity: it does not wake a sleeping machine nor hold off its
idle timers). Memory is bounded: the last `models.METRICS_KEPT` samples per machine
(about 100 bytes each), dropped when the machine is deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from boxd import models
from boxd.engine.base import GuestUsage, MachineHandle
from boxd.errors import BoxdError
from boxd.models import MachineState
from boxd.node.lifecycle import Lease
from boxd.state import MachineRecord

__all__ = ["WATCH", "Metrics"]

log = logging.getLogger("boxd.node")

#: Seconds a machine is sampled after the last request for its metrics.
WATCH = 300.0
#: A request finds a sample at most this old good enough (seconds).
FRESH = 1.0


class _Machines(Protocol):
    """What the sampler needs of the node."""

    def record(self, machine_id: str) -> MachineRecord: ...

    def lease(self, machine_id: str) -> Lease: ...

    def current(self, machine_id: str) -> MachineHandle | None: ...


class Metrics:
    """The node's kept samples, per machine id, and the task that takes them."""

    def __init__(self, machines: _Machines,
                 spawn: Callable[[Coroutine[Any, Any, None], str], None], *,
                 interval: float = models.METRICS_INTERVAL,
                 kept: int = models.METRICS_KEPT) -> None:
        self.machines = machines
        self._spawn = spawn
        self.interval = interval
        self.kept = kept
        self.samples: dict[str, deque[models.MetricSample]] = {}
        self._counters: dict[str, tuple[int, int]] = {}  # machine -> (busy, total) ticks
        self._watched: dict[str, float] = {}  # machine -> monotonic end of its watch
        self._running = False

    async def read(self, machine_id: str, start: float | None = None,
                   end: float | None = None) -> list[models.MetricSample]:
        """The machine's kept samples from ``start`` to ``end`` (Unix times; None: no
        bound), oldest first, after taking one now if it runs and has none fresh.

        Raises:
            MachineNotFound: no such machine.
            InvalidRequest: its agent is older than protocol 1.8.
            MachineFailed: its agent did not answer.
        """
        self.machines.record(machine_id)  # MachineNotFound
        self._watched[machine_id] = time.monotonic() + WATCH
        kept = self.samples.get(machine_id)
        if not kept or time.time() - kept[-1].timestamp >= FRESH:
            await self.take(machine_id)
        if not self._running:
            self._running = True
            self._spawn(self._loop(), "metrics")
        return [s for s in self.samples.get(machine_id, ())
                if (start is None or s.timestamp >= start)
                and (end is None or s.timestamp <= end)]

    async def take(self, machine_id: str) -> models.MetricSample | None:
        """Sample the machine now if it runs (None: it does not; it is not woken)."""
        got = await self._usage(machine_id)
        if got is None:
            return None
        rec, usage = got
        busy, total = self._counters.get(machine_id, (0, 0))
        if usage.cpu_total < total or usage.cpu_busy < busy:
            busy, total = 0, 0  # a new guest kernel (restored elsewhere): since its boot
        ticks = usage.cpu_total - total
        pct = 100.0 * (usage.cpu_busy - busy) / ticks if ticks > 0 else 0.0
        self._counters[machine_id] = (usage.cpu_busy, usage.cpu_total)
        # At most the machine's own sizes: a gVisor guest sees the host's memory and an
        # unbounded root (its writes live in memory, docs/http-api.md).
        mem_total = min(usage.mem_total, rec.memory_mib << 20)
        disk_total = min(usage.disk_total, rec.disk_gib << 30)
        sample = models.MetricSample(
            timestamp=time.time(), cpu_count=usage.cpu_count,
            cpu_used_pct=round(min(100.0, max(0.0, pct)), 2), mem_total=mem_total,
            mem_used=min(usage.mem_used, mem_total), mem_cache=usage.mem_cache,
            disk_total=disk_total, disk_used=min(usage.disk_used, disk_total))
        self.samples.setdefault(machine_id, deque(maxlen=self.kept)).append(sample)
        return sample

    async def _usage(self, machine_id: str) -> tuple[MachineRecord, GuestUsage] | None:
        """One reading of the guest, under the machine's lease (a swap or suspend waits
        for it), if it runs; never a wake, never activity for its idle timers."""
        if self.machines.record(machine_id).state != MachineState.RUNNING:
            return None
        async with self.machines.lease(machine_id).use():
            rec = self.machines.record(machine_id)
            handle = self.machines.current(machine_id)
            if rec.state != MachineState.RUNNING or handle is None:
                return None
            agent = await handle.agent(timeout=10.0)
            return rec, await agent.metrics()

    def forget(self, machine_id: str) -> None:
        """The machine is gone: drop its samples."""
        self.samples.pop(machine_id, None)
        self._counters.pop(machine_id, None)
        self._watched.pop(machine_id, None)

    async def _loop(self) -> None:
        """Sample the watched machines every `interval` seconds while there are any."""
        try:
            while self._watched:
                await asyncio.sleep(self.interval)
                now = time.monotonic()
                for machine_id, until in list(self._watched.items()):
                    if until < now:
                        del self._watched[machine_id]
                        continue
                    try:
                        await self.take(machine_id)
                    except BoxdError as exc:  # gone, or an agent that cannot: stop asking
                        log.info("machine=%s event=metrics-stopped error=%s",
                                 machine_id, exc.code)
                        self._watched.pop(machine_id, None)
        finally:
            self._running = False
