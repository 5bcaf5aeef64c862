"""Admission: creates and forks that wait for room instead of failing at once.

A request with ``wait`` seconds that meets its account's quota (`QuotaExceeded`) or
nodes without room (`ResourceExhausted`: a node's machine cap, the host's memory)
waits in its account's queue and tries again when room may have come (a machine of
the host was deleted or hibernated: the state layer says so, `Admission.freed`; and at
least every `POLL` seconds, for room that comes another way), until its deadline. Then
it gets a 429 (`QuotaExceeded`) naming the limit it met, with ``retry_after``.

Fairness: each account's queue is first in, first out: a request tries only once every
request ahead of it in its account's queue has taken its slots (`Admission.claimed`,
called by the control plane after a record's quota slot is taken: the turn is held for
the claim, not for the boot that follows, so queued requests launch side by side). The
queues of different accounts do not wait for each other (each has its own quota); for
room on the nodes every account's head tries when room comes. A queue holds at most
``per_account`` requests; one more is a 429 at once.

A request without ``wait`` (or 0) is not queued: it fails at once, as before.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TypeVar

from boxd import models
from boxd.errors import BoxdError, QuotaExceeded, ResourceExhausted

#: The errors a waiting request waits out.
ROOM_ERRORS = (QuotaExceeded, ResourceExhausted)
#: At most this often a waiting request tries again without being told room came.
POLL = 0.25
#: Requests one account may have waiting (one more is refused at once).
PER_ACCOUNT = 256
#: Bounds of a 429's ``retry_after`` (seconds).
RETRY_AFTER = (1, 60)


@dataclass(eq=False)
class _Ticket:
    account: str
    since: float
    claimed: bool = False  # took its slots this try: the next request may try
    tries: int = 0


_T = TypeVar("_T")
_I = TypeVar("_I")

_CURRENT: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar(
    "boxd_admission_ticket", default=None)


@dataclass(eq=False)
class Waiter:
    """One request's place in its queue (`Admission.queue`)."""

    admission: Admission | None
    ticket: _Ticket | None
    deadline: float

    async def room(self, exc: BoxdError) -> None:
        """``exc`` (a room error) ended a try: wait until room may have come and the
        request's turn is back, then return (try again).

        Raises:
            QuotaExceeded: the deadline passed (or the request did not wait): a 429
                naming the limit of ``exc``, with ``retry_after``.
        """
        adm, t = self.admission, self.ticket
        if adm is None or t is None:
            raise exc
        t.claimed = False
        adm.wake()
        if exc.details.get("limit") == 0:  # a quota of 0: no room can come (the operator's)
            raise exc
        if time.monotonic() >= self.deadline:
            raise adm.timed_out(t, exc) from exc
        await adm.changed(self.deadline)
        await adm.turn(t, self.deadline, exc)
        t.tries += 1


class Admission:
    """The control plane's admission queues (one per account)."""

    def __init__(self, *, per_account: int = PER_ACCOUNT, poll: float = POLL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_account = per_account
        self.poll = poll
        self._clock = clock
        self._queues: dict[str, list[_Ticket]] = {}
        self._event = asyncio.Event()
        self._frees: deque[float] = deque(maxlen=64)  # when room came, for retry_after
        self._loop: asyncio.AbstractEventLoop | None = None  # the waiters' (`freed`)

    # ------------------------------------------------------------- signals

    def wake(self) -> None:
        """Every waiting request looks again (its turn may have come)."""
        ev, self._event = self._event, asyncio.Event()
        ev.set()

    def freed(self) -> None:
        """Room came: a machine left its account's quota (deleted or hibernated). Any
        thread may say so (the state layer's writers run in worker threads too)."""
        self._frees.append(self._clock())
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no request has waited yet
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            self.wake()
        else:
            loop.call_soon_threadsafe(self.wake)

    def claimed(self) -> None:
        """The current request took a quota slot: the next in its queue may try."""
        t = _CURRENT.get()
        if t is not None and not t.claimed:
            t.claimed = True
            self.wake()

    async def changed(self, deadline: float) -> None:
        """Until a signal, `poll` seconds or ``deadline``, whichever is first."""
        left = min(self.poll, deadline - self._clock())
        if left > 0:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), left)

    # ------------------------------------------------------------- queueing

    @asynccontextmanager
    async def queue(self, account: str, wait: float | None) -> AsyncIterator[Waiter]:
        """A place in ``account``'s queue for ``wait`` seconds, held for the ``with``
        block; the block runs once it is the request's turn. Without ``wait`` the
        request is not queued (its `Waiter.room` re-raises at once).

        Raises:
            QuotaExceeded: the account's queue is full, or the turn did not come in
                time.
        """
        if not wait:
            yield Waiter(None, None, 0.0)
            return
        self._loop = asyncio.get_running_loop()
        q = self._queues.setdefault(account, [])
        if len(q) >= self.per_account:
            raise QuotaExceeded(
                f"the account's admission queue is full ({len(q)} requests wait for room)",
                hint="retry after the time given, or send fewer requests at once",
                limit=self.per_account, used=len(q), retry_after=self.retry_after(len(q)))
        now = self._clock()
        t = _Ticket(account, now)
        q.append(t)
        token = _CURRENT.set(t)
        try:
            waiter = Waiter(self, t, now + wait)
            await self.turn(t, waiter.deadline, None)
            yield waiter
        finally:
            _CURRENT.reset(token)
            q.remove(t)
            if not q:
                del self._queues[account]
            self.wake()

    async def turn(self, t: _Ticket, deadline: float, last: BoxdError | None) -> None:
        """Until every request ahead of ``t`` in its queue has taken its slots."""
        q = self._queues[t.account]
        while any(not o.claimed for o in q[:q.index(t)]):
            if self._clock() >= deadline:
                ahead = q.index(t)
                raise self.timed_out(t, last or QuotaExceeded(
                    f"{ahead} earlier request(s) of the account still wait for room",
                    hint="delete or hibernate machines you no longer need",
                    used=ahead))
            await self.changed(deadline)

    def timed_out(self, t: _Ticket, exc: BoxdError) -> QuotaExceeded:
        """The 429 of a request whose wait ended without room (``exc``: why not)."""
        q = self._queues.get(t.account, [])
        place = q.index(t) if t in q else 0
        waited = self._clock() - t.since
        return QuotaExceeded(
            f"no room after waiting {waited:.1f} s: {exc.message}",
            hint=exc.hint or "retry later", limit=exc.details.get("limit"),
            used=exc.details.get("used"), waited=round(waited, 3),
            retry_after=self.retry_after(place), reason=exc.code)

    def retry_after(self, place: int) -> int:
        """Seconds until room likely comes for the request at ``place`` of its queue
        (from how often room came lately), within `RETRY_AFTER`."""
        lo, hi = RETRY_AFTER
        now = self._clock()
        recent = [f for f in self._frees if now - f <= 300]
        if len(recent) < 2:
            return 5 if not recent else lo
        rate = (len(recent) - 1) / max(recent[-1] - recent[0], 1e-3)  # frees per second
        return int(min(hi, max(lo, math.ceil((place + 1) / rate))))

    # ------------------------------------------------------------- running

    async def run(self, account: str, wait: float | None,
                  attempt: Callable[[], Awaitable[_T]]) -> _T:
        """``attempt()`` until it does not fail for room, or ``wait`` seconds are up.

        Raises:
            QuotaExceeded: no room in time (or the queue is full).
            BoxdError: ``attempt``'s other errors, at once.
        """
        async with self.queue(account, wait) as waiter:
            while True:
                try:
                    return await attempt()
                except ROOM_ERRORS as exc:
                    await waiter.room(exc)

    async def run_items(
        self, account: str, wait: float | None, count: int,
        attempt: Callable[[list[int]], Awaitable[Sequence[_I | Exception]]],
    ) -> list[_I | Exception]:
        """A batch (a fork's children): ``attempt(indices)`` makes those items and
        returns each one or its error; the items that failed for room are tried again
        (the others are done) until none is left or ``wait`` seconds are up, when each
        of them gets the 429. Errors ``attempt`` raises end the batch."""
        out: list[_I | Exception] = [QuotaExceeded("not tried")] * count
        todo = list(range(count))
        async with self.queue(account, wait) as waiter:
            while True:
                got = await attempt(todo)
                for i, item in zip(todo, got, strict=True):
                    out[i] = item
                todo = [i for i in todo if isinstance(out[i], ROOM_ERRORS)]
                if not todo or waiter.admission is None:  # (no wait: each keeps its own)
                    return out
                first = out[todo[0]]
                assert isinstance(first, BoxdError)
                try:
                    await waiter.room(first)
                except QuotaExceeded as exc:
                    for i in todo:
                        out[i] = exc
                    return out

    # ------------------------------------------------------------- reading

    def waiting(self, account: str | None = None) -> models.AdmissionQueue:
        """The queues now (``account``'s only, if given)."""
        now = self._clock()
        queues = [
            models.AccountQueue(account=a, waiting=len(q),
                                oldest_seconds=round(now - min(t.since for t in q), 3))
            for a, q in sorted(self._queues.items()) if account in (None, a)
        ]
        return models.AdmissionQueue(
            waiting=sum(q.waiting for q in queues), accounts=queues,
            per_account=self.per_account)


__all__ = ["POLL", "ROOM_ERRORS", "Admission", "Waiter"]
