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

After each fork the pool is refilled, in the background (two spares at a time, once
forks of the template have paused for a second, at most three seconds later, or at once
when a fork finds none ready and waits for the next), up to
the largest number of children forked from that template at once: one fork of count N,
or N one-child forks in flight together (at most ``BOXD_FORK_SPARES``, default 8; 0
turns spares off), and never beyond ``BOXD_FORK_SPARES_TOTAL`` (default 32) across the
daemon. A fork that finds no ready spare while some are being prepared waits for one of
them (one fork per spare coming) rather than starting its child from scratch.
`warm` sizes a template's pool by hand (``machines.warm(ref, forks=N)``): exactly N
spares, not capped by ``BOXD_FORK_SPARES``, made at once and kept at N after forks claim
them. The node's standby capacity is shared: `warm` reserves its N before making any
(so concurrent calls never exceed a cap), against the total, the account's share of the
node (``BOXD_FORK_SPARES_PER_ACCOUNT``, default half the total) and the machines its
quota still lets it start (less with each machine it starts, more with each it deletes:
a pool cut to that headroom grows back to N as machines go); a request that does not
fit is refused whole, saying which cap and what to do. Spares that forks refilled on
their own give way to it. Spares live only while their template is the one the next
fork would use: when the source changes, is deleted or its template is collected, they
are killed. They are never in the
database (a claimed spare's VM id becomes the record's ``vm_id``); a restarted daemon
kills the VM processes of run directories no machine owns (see ``boxd.node._recovery``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from boxd.engine.base import MachineHandle

if TYPE_CHECKING:
    from boxd.state import TemplateRecord

log = logging.getLogger("boxd.node")


@dataclass(frozen=True)
class Shortfall:
    """Why a standby pool holds fewer spares than asked, and what to do about it."""

    why: str
    hint: str


@dataclass
class Spare:
    """One prepared, paused fork child of a template (its own VM id, no record)."""

    vm_id: str
    layer_id: str
    port: int | None
    handle: MachineHandle
    template_id: str = ""  # what it was made from (it holds a reference to it until gone)


class SpareMaker(Protocol):
    """What the pool needs of its node runtime."""

    async def prepare_spare(self, source_id: str, tpl: TemplateRecord) -> Spare: ...

    def remove_spare_files(self, spare: Spare) -> None: ...

    def template_is_current(self, template_id: str) -> bool: ...


class SparePool:
    """The spares of every template, and their background refill."""

    def __init__(self, maker: SpareMaker, *, per_template: int, total: int,
                 per_account: int = 0, parallel: int = 2, settle: float = 0.0) -> None:
        self._maker = maker
        # One account's share of the node's spares (0: half the total, at least one), so
        # that one account cannot take the whole node's standby budget from the others.
        self.per_account = min(total, per_account) if per_account > 0 else (
            max(1, total // 2) if total > 0 else 0)
        # Refilling waits until forks of the template have paused this long: a burst of
        # forks (the spec's 8 rollouts) claims its spares and runs its work first, and
        # the restores that replace them do not compete with it for the CPU.
        self.settle = settle
        self._last_take: dict[str, float] = {}
        self._settling: dict[str, asyncio.Event] = {}  # refills waiting for forks to pause
        self.per_template = per_template
        self.total = total
        # Spares prepared at once: a gVisor spare is a CPU-bound restore (~0.3 s), so
        # two at a time refill a batch of 8 in about half the time on a 2-core host.
        self.parallel = max(1, parallel)
        self._spares: dict[str, list[Spare]] = {}
        self._target: dict[str, int] = {}
        self._refilling: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._making: dict[str, int] = {}  # spares being prepared right now, per template
        # Forks waiting for a spare being prepared (see `claim`), per template.
        self._waiters: dict[str, list[asyncio.Future[Spare | None]]] = {}
        self._failed: dict[str, str] = {}  # why the last refill of a template stopped
        # Standby capacity is shared (see `warm`): whose source each template is, what
        # `warm` reserved for it (held against the caps even before it is made), and how
        # many more machines each account could start (its quota, when `warm` was told,
        # less the children forked since).
        self._owner: dict[str, str] = {}
        self._reserved: dict[str, int] = {}
        # What `warm` asked for, and of what source: what `freed` restores a pool that
        # `forked` cut to the account's headroom back up to, as machines go.
        self._asked: dict[str, tuple[int, str, TemplateRecord]] = {}
        self._claimable: dict[str, int] = {}  # by account
        # Set (and replaced) whenever a spare is kept or a refill ends: what `warm` waits on.
        self._progress = asyncio.Event()

    def count(self, template_id: str) -> int:
        return len(self._spares.get(template_id, []))

    def take(self, template_id: str) -> Spare | None:
        """A live spare of this template, or None."""
        self._last_take[template_id] = time.monotonic()
        pool = self._spares.get(template_id, [])
        while pool:
            spare = pool.pop(0)
            if spare.handle.alive():
                return spare
            log.warning("machine=%s event=spare_died reason=%r", spare.vm_id,
                        spare.handle.exit_reason())
            self._background(self._discard(spare))
        return None

    async def claim(self, template_id: str, timeout: float) -> Spare | None:
        """A live spare of this template: a ready one, else one being prepared that no
        other fork waits for (it is closer to done than a start from scratch, which
        would also compete with it for the CPU), waited for up to ``timeout`` seconds;
        None when there is neither."""
        spare = self.take(template_id)
        if spare is not None:
            return spare
        hurry = self._settling.get(template_id)
        if hurry is not None:
            hurry.set()  # the burst wants more than is ready: refill now, not after it
        waiters = self._waiters.setdefault(template_id, [])
        if self._making.get(template_id, 0) <= len(waiters):
            return None
        fut: asyncio.Future[Spare | None] = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        try:
            await asyncio.wait({fut}, timeout=timeout)
        except BaseException:
            if fut.done() and (given := fut.result()) is not None:
                self._keep(template_id, given)  # handed over as we were cancelled
            raise
        finally:
            waiters.remove(fut)
            if not fut.done():
                fut.cancel()
        return None if fut.cancelled() else fut.result()

    def want(self, source_id: str, tpl: TemplateRecord, batch: int, owner: str = "") -> None:
        """After a fork of ``batch`` children: keep that many spares (capped) ready."""
        if self.per_template == 0:
            return
        self._owner.setdefault(tpl.id, owner)
        self._target[tpl.id] = max(self._target.get(tpl.id, 0), min(batch, self.per_template))
        self._start_refill(source_id, tpl)

    async def warm(self, source_id: str, tpl: TemplateRecord, n: int, *, owner: str = "",
                   claimable: int | None = None) -> tuple[int, Shortfall | None]:
        """Keep exactly ``n`` spares of ``tpl`` (the user sized the pool: not capped by
        ``per_template``) and return once they are ready: how many there are, and why
        fewer, if so. ``n == 0`` releases them.

        The ``n`` are reserved before any is made, against the node's ``total`` and the
        share of ``owner`` (the source's account): at most ``per_account`` on this node,
        and at most ``claimable`` (the machines its quota still lets it start: a spare it
        could never claim holds memory for nothing). Concurrent calls therefore never
        exceed either cap. Spares that forks refilled on their own (not reserved) give way
        to a reservation. Refused by a cap, the pool is left as it was; when the refill
        falls short (a failed start, the source changed), back to what was reserved before.
        """
        self._owner[tpl.id] = owner
        if claimable is not None:
            self._claimable[owner] = max(0, claimable)
        before = self._reserved.get(tpl.id, 0)
        if n > before and (short := self._refusal(tpl.id, n)) is not None:
            return self.count(tpl.id), short
        self._reserve(tpl.id, n)
        if n:
            self._asked[tpl.id] = (n, source_id, tpl)
            self._make_room(tpl.id)
        else:
            self._asked.pop(tpl.id, None)
        self._failed.pop(tpl.id, None)
        self._last_take.pop(tpl.id, None)  # asked for now: no waiting for forks to pause
        if hurry := self._settling.get(tpl.id):
            hurry.set()
        if self.count(tpl.id) < n:
            self._start_refill(source_id, tpl)
        while self.count(tpl.id) < n and tpl.id in self._refilling:
            await self._progress.wait()
        if self.count(tpl.id) >= n:
            return self.count(tpl.id), None
        self._reserve(tpl.id, min(before, n))  # nothing half-made is held for it
        why = self._failed.get(tpl.id) or (
            "the source changed meanwhile (an exec, upload or restore discards its "
            "standby forks)")
        return self.count(tpl.id), Shortfall(
            f"preparing them failed: {why}",
            "warm it again once the source is ready and no longer changing; if the host is "
            "short of memory, free some or ask for fewer")

    def forked(self, owner: str, children: int) -> None:
        """``owner`` started ``children`` machines (forks): they count against its quota
        now, so its pools here hold no more than it could still claim (the standby forks
        beyond, ready or reserved, are let go; the next `warm` asks the quota again)."""
        left = self._claimable.get(owner)
        if left is None or children <= 0:
            return
        left = self._claimable[owner] = max(0, left - children)
        def wanted(t: str) -> int:  # held, or the refill's target
            return max(self._claimed(t), self._target.get(t, 0))

        for t in sorted((t for t in self._templates() if self._owner.get(t, "") == owner),
                        key=wanted):
            keep = min(wanted(t), left)
            left -= keep
            if t in self._reserved:
                self._reserved[t] = min(self._reserved[t], keep)
                if not self._reserved[t]:
                    del self._reserved[t]
            self._target[t] = min(self._target.get(t, 0), keep)
            pool = self._spares.get(t, [])
            while len(pool) > keep:
                self._background(self._discard(pool.pop()))

    def freed(self, owner: str, machines: int) -> None:
        """``owner`` has ``machines`` fewer (deleted): its quota lets it start that many
        more, so the pools `forked` cut short grow back towards what `warm` asked for
        (as far as every cap allows) and refill. Without this a warm pool that forks had
        drained to the account's headroom stayed empty however many machines went."""
        if owner not in self._claimable or machines <= 0:
            return
        self._claimable[owner] += machines
        for tid, (asked, source_id, tpl) in list(self._asked.items()):
            if self._owner.get(tid, "") != owner or not self._maker.template_is_current(tid):
                continue
            have = self._reserved.get(tid, 0)
            grow = next((k for k in range(asked, have, -1) if self._refusal(tid, k) is None),
                        have)
            if grow > have:
                self._reserve(tid, grow)
                self._start_refill(source_id, tpl)

    def reserved(self, template_id: str | None = None) -> int:
        """Spares `warm` reserved: for one template, or in all."""
        if template_id is not None:
            return self._reserved.get(template_id, 0)
        return sum(self._reserved.values())

    def claimable(self, owner: str) -> int | None:
        """How many more machines ``owner`` may start, as its pools here count it (None:
        it warmed none here)."""
        return self._claimable.get(owner)

    def held(self, owner: str | None = None) -> int:
        """Spares held (ready, being made or reserved): by one account, or in all."""
        return sum(self._claimed(t) for t in self._templates()
                   if owner is None or self._owner.get(t, "") == owner)

    def ready(self, template_id: str | None = None) -> list[Spare]:
        """The spares ready right now, of one template or all (for reporting)."""
        if template_id is not None:
            return list(self._spares.get(template_id, []))
        return [s for pool in self._spares.values() for s in pool]

    def prune(self) -> None:
        """Kill the spares of templates the next fork would no longer use."""
        for tid in list(self._templates()):
            if not self._maker.template_is_current(tid):
                for spare in self._spares.pop(tid, []):
                    self._background(self._discard(spare))
                for table in (self._target, self._last_take, self._reserved, self._owner,
                              self._asked):
                    table.pop(tid, None)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        # Their clean-up (a standby copy half restored is killed) runs before we go on.
        await asyncio.gather(*tasks, return_exceptions=True)
        # A discard drops its template's reference, and the node's gc that may follow
        # prunes (discards in the background) the spares of templates gone stale.
        while self._spares:
            for spare in self._spares.pop(next(iter(self._spares))):
                await self._discard(spare)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ----------------------------------------------------------------- internals

    def _start_refill(self, source_id: str, tpl: TemplateRecord) -> None:
        if tpl.id not in self._refilling:
            self._refilling.add(tpl.id)
            self._background(self._refill(source_id, tpl))

    def _pulse(self) -> None:
        """Wake whoever waits on `_progress` (each waiter re-checks its condition)."""
        done, self._progress = self._progress, asyncio.Event()
        done.set()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refill(self, source_id: str, tpl: TemplateRecord) -> None:
        try:
            while self._maker.template_is_current(tpl.id):
                if not await self._refill_round(source_id, tpl):
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("event=spare_failed template=%s error=%r", tpl.id, exc)
            self._failed[tpl.id] = str(exc) or repr(exc)
        finally:
            self._refilling.discard(tpl.id)
            for fut in self._waiters.get(tpl.id, []):
                if not fut.done():
                    fut.set_result(None)  # no more spares coming: start from scratch
            self._pulse()

    async def _refill_round(self, source_id: str, tpl: TemplateRecord) -> bool:
        """One round of a refill: up to ``parallel`` spares made at once and kept. False
        when the refill is done (full, its template stale, or a spare failed)."""
        # Reserved before any await: concurrent refills and `warm` calls see these spares
        # as taken (`_claimed`) from here on, so no cap is exceeded between check and act.
        room = min(self._target.get(tpl.id, 0), self._budget(tpl.id, self._claimed)[0])
        room = min(room - self.count(tpl.id), self.parallel)
        if room <= 0:
            return False
        self._making[tpl.id] = room  # from now: a fork finding none waits for one
        try:
            await self._settled(tpl.id)
            made = await self._prepare(source_id, tpl, room)
        finally:
            self._making.pop(tpl.id, None)
        failed = [r for r in made if not isinstance(r, Spare)]
        spares = [r for r in made if isinstance(r, Spare)]
        if not self._maker.template_is_current(tpl.id):
            for spare in spares:
                await self._discard(spare)
            return False
        for spare in spares:
            self._give(tpl.id, spare)
        for exc in failed:
            if not isinstance(exc, Exception):
                raise exc  # cancelled
        if failed:
            # A spare is an optimisation: forks still work without.
            log.warning("event=spare_failed template=%s error=%r", tpl.id, failed[0])
            self._failed[tpl.id] = str(failed[0]) or repr(failed[0])
            return False
        return True

    async def _prepare(self, source_id: str, tpl: TemplateRecord, n: int) -> list[Any]:
        """``n`` spares made at once: each a `Spare` or the exception that stopped it.
        Cancelled (the daemon closing), the ones already made are discarded: a gather
        cancelled would drop their sandboxes unowned, still running."""
        jobs = [asyncio.ensure_future(self._maker.prepare_spare(source_id, tpl))
                for _ in range(n)]
        try:
            return await asyncio.gather(*jobs, return_exceptions=True)
        except BaseException:
            for job in jobs:
                job.cancel()
            for made in await asyncio.gather(*jobs, return_exceptions=True):
                if isinstance(made, Spare):
                    await self._discard(made)
            raise

    async def _settled(self, template_id: str) -> None:
        """Wait until no fork has taken a spare of this template for ``settle`` seconds,
        at most ``3 * settle`` (forks that never pause still get spares), and no longer
        once a fork found none ready (`claim` hurries it: that fork waits for this
        refill)."""
        hurry = self._settling[template_id] = asyncio.Event()
        deadline = time.monotonic() + 3 * self.settle
        try:
            while not hurry.is_set():
                now = time.monotonic()
                wait = min(self.settle - (now - self._last_take.get(template_id, 0.0)),
                           deadline - now)
                if wait <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(hurry.wait(), wait)
        finally:
            if self._settling.get(template_id) is hurry:
                del self._settling[template_id]

    # ------------------------------------------------------- shared capacity

    def _templates(self) -> set[str]:
        return set(self._spares) | set(self._target) | set(self._reserved) | set(
            self._making)

    def _claimed(self, tid: str) -> int:
        """Spares of ``tid`` held against the caps: ready, being made, or reserved."""
        return max(self._reserved.get(tid, 0), self.count(tid) + self._making.get(tid, 0))

    def _firm(self, tid: str) -> int:
        """What `_claimed` keeps of ``tid`` once its unreserved ready spares give way."""
        reserved = self._reserved.get(tid, 0)
        return max(reserved, min(self.count(tid), reserved) + self._making.get(tid, 0))

    def _budget(self, tid: str, others: Callable[[str], int]) -> tuple[int, str]:
        """The most spares ``tid`` may hold, counting each other template's as
        ``others`` says, and the cap that sets it (its reason, for `_refusal`)."""
        owner = self._owner.get(tid, "")
        rest = [t for t in self._templates() if t != tid]
        node = self.total - sum(others(t) for t in rest)
        mine = sum(others(t) for t in rest if self._owner.get(t, "") == owner)
        share = self.per_account - mine
        # On a tie the account's own limit is named: more room on the node would not help.
        out = [(node, "node")]
        if self.per_account < self.total:
            out.insert(0, (share, "share"))
        if (quota := self._claimable.get(owner)) is not None:
            out.insert(0, (quota - mine, "quota"))
        return min(out, key=lambda cap: cap[0])

    def _refusal(self, tid: str, n: int) -> Shortfall | None:
        """Why ``n`` spares of ``tid`` cannot be reserved, or None when they can."""
        most, cap = self._budget(tid, self._firm)
        if n <= most:
            return None
        most = max(0, most)
        mine = self.held(self._owner.get(tid, "")) - self._claimed(tid)
        ask = f"ask for at most {most}; " if most else ""
        if cap == "node":
            return Shortfall(
                f"this node holds at most {self.total} standby forks "
                f"(BOXD_FORK_SPARES_TOTAL) and {self.total - most} are held by other "
                "machines' pools", f"{ask}ask again once some are released; the operator "
                "raises BOXD_FORK_SPARES_TOTAL")
        if cap == "share":
            return Shortfall(
                f"one account holds at most {self.per_account} of this node's "
                f"{self.total} standby forks (BOXD_FORK_SPARES_PER_ACCOUNT)"
                + (f" and yours hold {mine} for other machines" if mine else ""),
                f"{ask}release other machines' standby forks (`warm(ref, forks=0)`)")
        quota = self._claimable.get(self._owner.get(tid, ""), 0)
        return Shortfall(
            f"your account's machine quota lets it start {quota} more machine(s), so it "
            f"could claim no more than {quota} standby forks"
            + (f" ({mine} held for other machines)" if mine else ""),
            f"{ask}delete or hibernate machines you no longer need, or ask the operator "
            "to raise the quota")

    def _reserve(self, tid: str, n: int) -> None:
        """Hold ``n`` spares of ``tid`` (discarding ready ones beyond)."""
        if n:
            self._reserved[tid] = n
        else:
            self._reserved.pop(tid, None)
        self._target[tid] = n
        pool = self._spares.get(tid, [])
        while len(pool) > n:
            self._background(self._discard(pool.pop()))

    def _make_room(self, tid: str) -> None:
        """Discard unreserved ready spares (forks refilled them on their own) until
        ``tid``'s reservation fits every cap: any template's for the node's cap, its own
        account's for the account's caps. `_refusal` checked that this is enough."""
        owner = self._owner.get(tid, "")
        while True:
            most, cap = self._budget(tid, self._claimed)
            if most >= self._reserved.get(tid, 0):
                return
            soft = [t for t in self._templates() - {tid}
                    if self.count(t) > self._reserved.get(t, 0)
                    and (cap == "node" or self._owner.get(t, "") == owner)]
            if not soft:
                return  # being made: refills stop at the caps (`_refill_round`)
            t = max(soft, key=lambda k: self.count(k) - self._reserved.get(k, 0))
            spare = self._spares[t].pop()
            self._target[t] = min(self._target.get(t, 0), self.count(t))
            self._background(self._discard(spare))

    def _give(self, template_id: str, spare: Spare) -> None:
        """A new spare: to the first fork waiting for one, else into the pool."""
        log.info("machine=%s event=spare_ready template=%s", spare.vm_id, template_id)
        for fut in self._waiters.get(template_id, []):
            if not fut.done():
                fut.set_result(spare)
                return
        self._keep(template_id, spare)

    def _keep(self, template_id: str, spare: Spare) -> None:
        self._spares.setdefault(template_id, []).append(spare)
        self._pulse()

    async def _discard(self, spare: Spare) -> None:
        with contextlib.suppress(Exception):
            await spare.handle.destroy()
        self._maker.remove_spare_files(spare)


__all__ = ["Shortfall", "Spare", "SpareMaker", "SparePool"]
