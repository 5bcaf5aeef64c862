"""Machine lifetimes: their ends, and the reaper that ends machines at their deadline.

A machine's end (``end_at``) and what it does (``on_timeout``: delete or hibernate)
are columns of the control plane's ``machines`` table, so a restarted daemon (even
one killed with SIGKILL) finds every deadline where it left it, and ends at once the
machines whose end passed while it was down.

One task serves every machine: it asks the table for the earliest ends (an indexed
query, `Machines.due`), ends those that are due, a batch at a time, and sleeps until
the next end, at most `MAX_SLEEP` seconds (a ``set_timeout`` that moves an end
earlier wakes it). A machine whose end failed is logged and tried again after a
backoff (1, 2, 4 ... `MAX_BACKOFF` seconds); its failure never stops the loop. A
machine deleted by hand is simply no longer in the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator

from boxd import models
from boxd.errors import MachineNotFound
from boxd.models import MachineState
from boxd.state import MachineRecord, Repos

log = logging.getLogger("boxd.control")

#: Machines ended at once (one query's page; the rest follow at once).
BATCH = 32
#: The longest the reaper sleeps without looking at the table.
MAX_SLEEP = 5.0
#: The longest wait before a machine whose end failed is tried again.
MAX_BACKOFF = 60.0


class Reaper:
    """Ends machines whose lifetime is over, by calling ``end`` with each record.

    ``end`` does the work (delete or hibernate, `Machines.end_of_life`); the reaper
    decides when, and keeps the retry times of the machines whose end failed (one
    entry per such machine, dropped when it succeeds or the machine is no longer due).
    """

    def __init__(
        self, repos: Repos, end: Callable[[MachineRecord], Awaitable[None]], *,
        clock: Callable[[], float] = time.time, batch: int = BATCH,
    ) -> None:
        self._repos = repos
        self._end = end
        self.clock = clock
        self._batch = batch
        self._retry: dict[str, tuple[float, int]] = {}  # id -> (next try, failures)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def failing(self) -> dict[str, int]:
        """Machines whose end failed, with their failures so far (for tests and logs)."""
        return {mid: n for mid, (_, n) in self._retry.items()}

    def start(self) -> None:
        """Start the loop (once) on the running event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="boxd lifetimes")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def changed(self) -> None:
        """An end was set or moved: look again now (it may be earlier than the sleep)."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                delay = await self.run_once()
            except Exception:  # the table could not be read: log, and look again later
                log.exception("event=lifetimes_failed")
                delay = MAX_SLEEP
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()

    async def run_once(self) -> float:
        """End the machines that are due now (a batch); return the seconds until the
        next look (0: a full batch, more may be due). A machine still due after its end
        succeeded (its record lags) is looked at again after the sleep, not at once."""
        now = self.clock()
        limit = self._batch + len(self._retry)  # failing ones never hide due ones
        due = self._repos.machines.due(now, limit)
        if len(due) < limit:  # every due machine is here: forget the rest
            ids = {r.id for r in due}
            for mid in [m for m in self._retry if m not in ids]:
                del self._retry[mid]
        todo = [r for r in due if self._retry.get(r.id, (0.0, 0))[0] <= now][:self._batch]
        results = await asyncio.gather(*(self._end(r) for r in todo), return_exceptions=True)
        for rec, res in zip(todo, results, strict=True):
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res  # a cancellation is the loop's, not a machine's
            if res is None:
                self._retry.pop(rec.id, None)
                continue
            failures = self._retry.get(rec.id, (0.0, 0))[1] + 1
            backoff = min(MAX_BACKOFF, 2.0 ** (failures - 1))
            self._retry[rec.id] = (now + backoff, failures)
            log.warning("machine=%s event=lifetime_end_failed action=%s failures=%d "
                        "retry_in=%.0fs error=%s", rec.id, rec.on_timeout, failures, backoff,
                        res)
        if len(todo) == self._batch:  # a full batch: more may be due now
            return 0.0
        wake = [t for t, _ in self._retry.values()]
        nxt = self._repos.machines.next_end()
        if nxt is not None and nxt > now:
            wake.append(nxt)
        return min([MAX_SLEEP] + [max(0.0, t - now) for t in wake])


class Lifetimes:
    """The control plane's part of lifetimes (`Machines` delegates to it): the end a
    claim records, ``set_timeout``'s new end, and what an end does (`end_of_life`,
    which its `Reaper` calls). ``delete`` and ``hibernate`` end a machine through its
    node (`Machines.delete`, its node's hibernate).
    """

    def __init__(
        self, repos: Repos, *, delete: Callable[[MachineRecord], Awaitable[None]],
        hibernate: Callable[[MachineRecord], Awaitable[None]],
    ) -> None:
        self._repos = repos
        self._delete = delete
        self._hibernate = hibernate
        self.reaper = Reaper(repos, self.end_of_life)
        # Machines with a lifetime whose create or fork is still in flight: their end
        # waits for the call to return (a boot longer than the lifetime never turns the
        # create into a 404); the reaper ends them as soon as it did. One entry per
        # create or fork in flight.
        self._launching: set[str] = set()

    @staticmethod
    def check(timeout: int | None, on_timeout: str) -> None:
        """Raises: InvalidRequest: a bad ``timeout`` or ``on_timeout``."""
        if timeout is not None:
            models.check_timeout(timeout)
        models.check_on_timeout(on_timeout)

    def end_at(self, timeout: int | None) -> float | None:
        """The end of a lifetime of ``timeout`` seconds from now (None: none).

        Raises:
            InvalidRequest: ``timeout`` is not 1-`models.MAX_TIMEOUT`.
        """
        if timeout is None:
            return None
        return self.reaper.clock() + models.check_timeout(timeout)

    def hold(self, rec: MachineRecord) -> MachineRecord:
        """``rec`` was just claimed: its end waits for `launched` (`launching`)."""
        if rec.end_at is not None:
            self._launching.add(rec.id)
        return rec

    @contextlib.contextmanager
    def launching(self, claimed: Iterable[object] = ()) -> Iterator[list[object]]:
        """Release the records of ``claimed`` and those the body appends to the list
        it gets (`launched`) when the body ends, however it ends."""
        held = list(claimed)
        try:
            yield held
        finally:
            self.launched([r.id for r in held if isinstance(r, MachineRecord)])

    def launched(self, ids: list[str]) -> None:
        """The create or fork of ``ids`` returned (or failed): they may end now."""
        if ids:
            self._launching.difference_update(ids)
            self.reaper.changed()

    def set(self, rec: MachineRecord, timeout: int | None, on_timeout: str | None) -> None:
        """Give ``rec`` a new end, ``timeout`` seconds from now (None: no lifetime; it
        then runs until deleted); ``on_timeout`` None keeps what its end did ('delete'
        if it had no lifetime).

        Raises:
            InvalidRequest: a bad ``timeout`` or ``on_timeout``.
            MachineNotFound: it was deleted meanwhile.
        """
        action = models.check_on_timeout(on_timeout if on_timeout is not None
                                         else rec.on_timeout or "delete")
        end = self.end_at(timeout)
        if not self._repos.machines.set_end(rec.id, end, action):
            raise MachineNotFound(f"no machine named {rec.name!r}", machine=rec.name,
                                  hint="it was deleted meanwhile")
        log.info("machine=%s event=lifetime_set end_at=%s on_timeout=%s", rec.id,
                 f"{end:.3f}" if end is not None else None, action)
        self.reaper.changed()

    async def end_of_life(self, rec: MachineRecord) -> None:
        """End a machine whose lifetime is over: delete it, or hibernate it and drop its
        lifetime (woken, it runs without one until a ``set_timeout``). Nothing if it is
        gone, its end moved meanwhile, or its create or fork is still in flight.

        Raises:
            BoxdError: the delete or hibernate failed (the reaper tries again).
        """
        fresh = self._repos.machines.get(rec.id)
        if (fresh is None or fresh.state == MachineState.DELETING or fresh.end_at is None
                or fresh.end_at > self.reaper.clock()):
            return  # deleted by hand, or given another end meanwhile
        if fresh.id in self._launching:
            return  # `launched` wakes the reaper for it
        if fresh.on_timeout == "hibernate":
            if fresh.state in (MachineState.FAILED, MachineState.LOST):
                log.warning("machine=%s event=lifetime_ended action=none state=%s (it "
                            "cannot hibernate; its lifetime is dropped)", fresh.id,
                            fresh.state)
            elif fresh.state != MachineState.HIBERNATED:
                await self._hibernate(fresh)
            self._repos.machines.clear_end(fresh.id, fresh.end_at)
            log.info("machine=%s event=lifetime_ended action=hibernate", fresh.id)
            return
        with contextlib.suppress(MachineNotFound):  # deleted meanwhile: as good
            await self._delete(fresh)
        log.info("machine=%s event=lifetime_ended action=delete", fresh.id)


__all__ = ["Lifetimes", "Reaper"]
