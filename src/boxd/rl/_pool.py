"""The slots of a vector env: concurrent requests, resets per reset mode, recovery.

Shared by `boxd.rl.VectorEnv` (Gymnasium semantics) and `boxd.rl.sb3.VecEnv` (SB3's):
both send one request to every sub-env first and only then collect the replies, so a
step of N machine-backed envs costs about one round trip, not N.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from boxd import errors
from boxd.rl import _server as W
from boxd.rl._channel import Home, MakeGroup, MakeRequest, Rpc, Slot, raise_reply
from boxd.rl._env import ResetMode
from boxd.rl._errors import EnvServerLost, EnvTimeout

#: Failures a slot can recover from by being replaced (the env's own exceptions are
#: bugs to report, not to paper over).
RECOVERABLE = (EnvServerLost, EnvTimeout)
MAX_PARALLEL_OPEN = 8

Request = tuple[Any, ...] | None  # (op, *args) or None: skip this slot


@dataclass
class Sent:
    """Frames sent and not yet answered: what `Pool.collect` reads."""

    requests: list[Request]
    #: per sub-env: the failure to send, or None until collected
    out: list[Any]
    #: the slots whose reply is still to be read
    slots: list[int]


@dataclass
class PendingStep:
    """A step `Pool.start_step` sent and `Pool.finish_step` collects."""

    sent: Sent
    resets: set[int]
    #: the NEXT_STEP resets already done by a rewind or refork (reset mode not "env")
    prior: list[Any]
    #: SAME_STEP outside the server: the finished episodes are reset after the step
    autoreset: Callable[[int], tuple[int | None, Any]] | None = field(default=None)


class Pool:
    """N sub-envs of one home, ``envs_per_machine`` to a slot (one machine and one env
    server each; the last slot holds the rest). A request to several sub-envs of a slot
    is one ``batch`` frame each way. Not thread-safe: one caller at a time, like any env.
    """

    def __init__(
        self, home: Home, makes: Sequence[MakeRequest], *, reset_mode: ResetMode,
        step_timeout: float | None, envs_per_machine: int = 1,
    ) -> None:
        if (not isinstance(envs_per_machine, int) or isinstance(envs_per_machine, bool)
                or envs_per_machine < 1):
            raise errors.InvalidRequest(
                f"envs_per_machine must be an int >= 1, got {envs_per_machine!r}",
                field="envs_per_machine")
        self.home = home
        self.makes = list(makes)
        self.reset_mode = reset_mode
        self.step_timeout = step_timeout
        self.n = len(self.makes)
        self.envs_per_machine = envs_per_machine
        #: The sub-env indices of each slot, and each sub-env's slot.
        self.groups = [list(range(s, min(s + envs_per_machine, self.n)))
                       for s in range(0, self.n, envs_per_machine)]
        self.group_of = [g for g, members in enumerate(self.groups) for _ in members]
        self.pristine = [True] * self.n
        #: Per slot: the failure that broke it (later requests fail at once), or None.
        self.broken: list[BaseException | None] = [None] * len(self.groups)
        self.infos: list[dict[str, Any]] = [{} for _ in range(self.n)]
        self.slots: list[Slot] = self._open_all(range(len(self.groups)))
        self.rpcs = [Rpc(s, self.groups[g][0]) for g, s in enumerate(self.slots)]

    def _group_make(self, g: int) -> MakeGroup:
        return MakeGroup.of_members([self.makes[i] for i in self.groups[g]])

    def _open(self, g: int) -> Slot:
        make = self._group_make(g)
        msg = make.message()
        shared = (self.reset_mode == "refork"
                  or sum(1 for h in range(len(self.groups))
                         if self._group_make(h).message() == msg) > 1)
        slot = self.home.open(make, rewindable=self.reset_mode == "rewind",
                              index=self.groups[g][0], shared=shared)
        try:
            self._take_infos(g, slot)
        except BaseException:
            with contextlib.suppress(Exception):
                slot.close()
            raise
        return slot

    def _take_infos(self, g: int, slot: Slot) -> None:
        """Each sub-env's ``make`` reply from the slot's ``make_group`` answer.

        Raises:
            EnvError, EnvModuleNotFound: a sub-env could not be built (its index named).
        """
        replies = slot.info["group"]
        for i, reply in zip(self.groups[g], replies, strict=True):
            self.infos[i] = raise_reply(reply, i, slot.machine)

    def _open_all(self, groups: Sequence[int] | range) -> list[Slot]:
        groups = list(groups)
        with ThreadPoolExecutor(max_workers=max(1, min(len(groups), MAX_PARALLEL_OPEN))) as ex:
            futures = [ex.submit(self._open, g) for g in groups]
        opened: list[Slot] = []
        first: BaseException | None = None
        for g, fut in zip(groups, futures, strict=True):
            exc = fut.exception()
            if exc is None:
                opened.append(fut.result())
            elif first is None:
                first = exc
                i = self.groups[g][0]
                if isinstance(exc, errors.BoxdError) and exc.details.get("index") is None:
                    exc.details["index"] = i
                    exc.message = f"sub-env {i}: {exc.message}"
                    exc.args = (exc.message,)
        if first is not None:
            for slot in opened:
                with contextlib.suppress(Exception):
                    slot.close()
            raise first
        return opened

    @property
    def machines(self) -> list[str | None]:
        """Each sub-env's machine (sub-envs of one slot share it)."""
        return [self.slots[g].machine for g in self.group_of]

    # ------------------------------------------------------------------ requests

    def broadcast(
        self, requests: Sequence[Request], timeout: float | None = None
    ) -> list[Any]:
        """Send each sub-env its request (one frame per slot), then collect every reply.

        Returns per sub-env the reply's value, an exception (its failure), or None when
        its request was None. A slot that failed to answer in time or lost its server
        is marked broken (every sub-env of it fails): later requests fail at once until
        it is replaced.
        """
        return self.collect(self.send(requests), timeout)

    def send(self, requests: Sequence[Request]) -> Sent:
        """The first half of `broadcast`: one frame to each slot with a request. A
        failure to send is kept for `collect`, not raised."""
        out: list[Any] = [None] * self.n
        return Sent(list(requests), out, self._send_all(requests, out))

    def collect(self, sent: Sent, timeout: float | None = None) -> list[Any]:
        """The second half of `broadcast`: every reply to ``sent``, waiting at most
        ``timeout`` (default ``step_timeout``) seconds from now."""
        timeout = self.step_timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        for g in sent.slots:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._collect(g, left, sent.requests, sent.out)
        sent.slots = []
        return sent.out

    def _fail(self, g: int, exc: BaseException, requests: Sequence[Request],
              out: list[Any]) -> None:
        """``exc`` is the answer of every sub-env of slot ``g`` that was asked."""
        for i in self.groups[g]:
            if requests[i] is not None:
                out[i] = exc

    def _send_all(self, requests: Sequence[Request], out: list[Any]) -> list[int]:
        """One frame to each slot with a request; the slots sent to (the others'
        failures in ``out``)."""
        sent: list[int] = []
        for g, members in enumerate(self.groups):
            batch = [requests[i] for i in members]
            if all(r is None for r in batch):
                continue
            broken = self.broken[g]
            if broken is not None:
                self._fail(g, broken, requests, out)
                continue
            try:
                self.rpcs[g].send("batch", batch)
                sent.append(g)
            except errors.BoxdError as exc:
                self._fail(g, self._mark(g, exc), requests, out)
            except W.WireError as exc:  # a value the codec cannot carry: nothing sent
                self._fail(g, exc, requests, out)
        return sent

    def _collect(self, g: int, left: float | None, requests: Sequence[Request],
                 out: list[Any]) -> None:
        """Slot ``g``'s reply (waiting at most ``left`` s) into ``out``, per sub-env."""
        try:
            replies = self.rpcs[g].reply(left)
        except errors.BoxdError as exc:
            self._fail(g, self._mark(g, exc), requests, out)
            return
        machine = self.slots[g].machine
        for i, raw in zip(self.groups[g], replies, strict=True):
            if raw is None:
                continue
            try:
                out[i] = raise_reply(W.decode(raw), i, machine)
            except errors.BoxdError as exc:
                out[i] = exc

    def _mark(self, g: int, exc: errors.BoxdError) -> errors.BoxdError:
        if isinstance(exc, RECOVERABLE):
            self.broken[g] = exc
        return exc

    @staticmethod
    def first_error(results: Sequence[Any]) -> BaseException | None:
        return next((r for r in results if isinstance(r, BaseException)), None)

    def values(self, results: Sequence[Any]) -> list[Any]:
        """The results, or the first failure raised (it names its sub-env)."""
        exc = self.first_error(results)
        if exc is not None:
            raise exc
        return list(results)

    # ------------------------------------------------------------------ resets

    def prepare_resets(self, indices: Sequence[int]) -> list[Any]:
        """Per ``reset_mode``, rewind or refork (concurrently) the slots whose sub-envs
        are all in ``indices``, unless they are all as built; per sub-env None or the
        failure. A sub-env reset without the rest of its slot is reset by its env
        (``envs_per_machine`` > 1: one machine rewinds for all its sub-envs or none)."""
        want = set(indices)
        todo = [g for g, members in enumerate(self.groups)
                if want.issuperset(members) and self.broken[g] is None
                and not all(self.pristine[i] for i in members)]
        out: list[Any] = [None] * self.n
        if self.reset_mode == "env" or not todo:
            return out

        def prep(g: int) -> None:
            slot = self.slots[g]
            if self.reset_mode == "rewind":
                slot.rewind()
            else:
                slot.refork()
                self._take_infos(g, slot)

        with ThreadPoolExecutor(max_workers=max(1, min(len(todo), MAX_PARALLEL_OPEN))) as ex:
            futures = {g: ex.submit(prep, g) for g in todo}
        for g, fut in futures.items():
            exc = fut.exception()
            if exc is not None:
                first = self.groups[g][0]
                lost = EnvServerLost(f"sub-env {first}: {self.reset_mode} failed: {exc}",
                                     index=first, machine=self.slots[g].machine)
                self.broken[g] = lost
                for i in self.groups[g]:
                    out[i] = lost
            else:
                for i in self.groups[g]:
                    self.pristine[i] = True
        return out

    def reset(
        self, indices: Sequence[int], seeds: Sequence[int | None], options: Sequence[Any]
    ) -> list[Any]:
        """Reset the given slots (``seeds`` and ``options`` indexed by slot); per slot
        ``(obs, info)``, an exception, or None for slots not reset."""
        prep = self.prepare_resets(indices)
        reqs: list[Request] = [None] * self.n
        for i in indices:
            if prep[i] is None:
                reqs[i] = ("reset", seeds[i], options[i])
            self.pristine[i] = False
        results = self.broadcast(reqs)
        for i in indices:
            if prep[i] is not None:
                results[i] = prep[i]
        return results

    def step(
        self, actions: Sequence[Any], *, resets: Sequence[int] = (),
        autoreset: Callable[[int], tuple[int | None, Any]] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Step the sub-envs, but reset those in ``resets`` (unseeded: NEXT_STEP's
        autoreset; in reset mode "env" in the same frames as the steps, else after a
        rewind or refork first). With ``autoreset`` a finished episode is reset in the
        same step (SAME_STEP), with ``autoreset(i)`` giving ``(seed, options)``: inside
        the server's round trip in reset mode "env", else by a rewind or refork and a
        reset right after. Per sub-env ``(obs, reward, terminated, truncated, info,
        final)`` (``final`` is ``(obs, info)`` of the finished episode, or None), ``(obs,
        info)`` for those in ``resets``, or an exception."""
        return self.finish_step(self.start_step(actions, resets=resets,
                                                autoreset=autoreset), timeout)

    def start_step(
        self, actions: Sequence[Any], *, resets: Sequence[int] = (),
        autoreset: Callable[[int], tuple[int | None, Any]] | None = None,
    ) -> PendingStep:
        """The first half of `step`: the step frames are sent (after the rewinds or
        reforks of NEXT_STEP resets outside reset mode "env", which wait for their
        machines); `finish_step` collects. Failures are kept for `finish_step`."""
        in_server = autoreset is not None and self.reset_mode == "env"
        reqs: list[Request] = [None] * self.n
        reset_set = set(resets)
        prior: list[Any] = [None] * self.n
        if reset_set and self.reset_mode != "env":
            prior = self.reset(sorted(reset_set), [None] * self.n, [None] * self.n)
        for i in range(self.n):
            if i in reset_set:
                if self.reset_mode == "env":
                    reqs[i] = ("reset", None, None)
                continue
            reqs[i] = ("step", actions[i], autoreset(i) if in_server and autoreset else None)
            self.pristine[i] = False
        return PendingStep(self.send(reqs), reset_set, prior,
                           None if in_server else autoreset)

    def finish_step(self, pending: PendingStep, timeout: float | None = None) -> list[Any]:
        """The second half of `step`: the replies to `start_step`'s frames (waiting at
        most ``timeout`` s from now), and SAME_STEP's resets outside the server."""
        results = self.collect(pending.sent, timeout)
        reset_set, prior, autoreset = pending.resets, pending.prior, pending.autoreset
        for i in reset_set:
            self.pristine[i] = False
            if self.reset_mode != "env":
                results[i] = prior[i]
        if autoreset is None:
            return results
        return self._reset_finished(results, reset_set, autoreset)

    def _reset_finished(
        self, results: list[Any], reset_set: set[int],
        autoreset: Callable[[int], tuple[int | None, Any]],
    ) -> list[Any]:
        """SAME_STEP outside the server: reset the sub-envs whose episode just ended
        (a rewind or refork, then a reset) and fold the reset into their step result."""
        done = [i for i, r in enumerate(results)
                if i not in reset_set and isinstance(r, tuple) and (r[2] or r[3])]
        if not done:
            return results
        args = {i: autoreset(i) for i in done}
        seeds = [args[i][0] if i in args else None for i in range(self.n)]
        options = [args[i][1] if i in args else None for i in range(self.n)]
        again = self.reset(done, seeds, options)
        for i in done:
            r = again[i]
            if isinstance(r, BaseException):
                results[i] = r
            else:
                obs, reward, terminated, truncated, info, _ = results[i]
                results[i] = (r[0], reward, terminated, truncated, r[1], (obs, info))
        return results

    # ------------------------------------------------------------------ recovery

    def replace(self, i: int) -> list[int]:
        """Rebuild sub-env ``i``'s slot from the source (a new fork, its envs built
        anew), unless it was already replaced since it broke; the sub-envs it holds
        (all of them start over).

        Raises:
            BoxdError: the new slot could not be made.
        """
        g = self.group_of[i]
        members = list(self.groups[g])
        if self.broken[g] is None:
            return members
        old = self.slots[g]
        with contextlib.suppress(Exception):
            old.close()
        (slot,) = self._open_all([g])
        self.slots[g] = slot
        self.rpcs[g] = Rpc(slot, members[0])
        self.broken[g] = None
        for j in members:
            self.pristine[j] = True
        return members

    def close(self) -> None:
        """Close every env and delete every machine (errors are ignored: best effort;
        the machines and the home's templates go whatever the envs' close did)."""
        with contextlib.suppress(Exception):
            live = [i for i in range(self.n) if self.broken[self.group_of[i]] is None]
            self.broadcast([("close",) if i in live else None for i in range(self.n)],
                           timeout=30.0)

        def close_slot(slot: Slot) -> None:
            with contextlib.suppress(Exception):
                slot.close()

        with ThreadPoolExecutor(max_workers=max(1, min(self.n, MAX_PARALLEL_OPEN))) as ex:
            list(ex.map(close_slot, self.slots))
        with contextlib.suppress(Exception):
            self.home.close()


__all__ = ["Pool"]
