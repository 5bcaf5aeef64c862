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
from typing import Any

from boxd import errors
from boxd.rl._channel import Home, MakeRequest, Rpc, Slot
from boxd.rl._env import ResetMode
from boxd.rl._errors import EnvServerLost, EnvTimeout

#: Failures a slot can recover from by being replaced (the env's own exceptions are
#: bugs to report, not to paper over).
RECOVERABLE = (EnvServerLost, EnvTimeout)
MAX_PARALLEL_OPEN = 8

Request = tuple[Any, ...] | None  # (op, *args) or None: skip this slot


class Pool:
    """N slots of one home. Not thread-safe: one caller at a time, like any env."""

    def __init__(
        self, home: Home, makes: Sequence[MakeRequest], *, reset_mode: ResetMode,
        step_timeout: float | None,
    ) -> None:
        self.home = home
        self.makes = list(makes)
        self.reset_mode = reset_mode
        self.step_timeout = step_timeout
        self.n = len(self.makes)
        self.pristine = [True] * self.n
        self.broken: list[BaseException | None] = [None] * self.n
        self.slots: list[Slot] = self._open_all(range(self.n))
        self.rpcs = [Rpc(s, i) for i, s in enumerate(self.slots)]

    def _open(self, i: int) -> Slot:
        msg = self.makes[i].message()
        shared = (self.reset_mode == "refork"
                  or sum(1 for m in self.makes if m.message() == msg) > 1)
        return self.home.open(self.makes[i], rewindable=self.reset_mode == "rewind", index=i,
                              shared=shared)

    def _open_all(self, indices: Sequence[int] | range) -> list[Slot]:
        indices = list(indices)
        with ThreadPoolExecutor(max_workers=max(1, min(len(indices), MAX_PARALLEL_OPEN))) as ex:
            futures = [ex.submit(self._open, i) for i in indices]
        opened: list[Slot] = []
        first: BaseException | None = None
        for i, fut in zip(indices, futures, strict=True):
            exc = fut.exception()
            if exc is None:
                opened.append(fut.result())
            elif first is None:
                first = exc
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
        return [s.machine for s in self.slots]

    # ------------------------------------------------------------------ requests

    def broadcast(
        self, requests: Sequence[Request], timeout: float | None = None
    ) -> list[Any]:
        """Send each slot its request, then collect every reply.

        Returns per slot the reply's value, an exception (the slot's failure), or None
        when its request was None. A slot that failed to answer in time or lost its
        server is marked broken: later requests fail at once until it is replaced.
        """
        timeout = self.step_timeout if timeout is None else timeout
        out: list[Any] = [None] * self.n
        sent: list[int] = []
        for i, req in enumerate(requests):
            if req is None:
                continue
            if self.broken[i] is not None:
                out[i] = self.broken[i]
                continue
            try:
                self.rpcs[i].send(*req)
                sent.append(i)
            except errors.BoxdError as exc:
                out[i] = self._mark(i, exc)
        deadline = None if timeout is None else time.monotonic() + timeout
        for i in sent:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out[i] = self.rpcs[i].reply(left)
            except errors.BoxdError as exc:
                out[i] = self._mark(i, exc)
        return out

    def _mark(self, i: int, exc: errors.BoxdError) -> errors.BoxdError:
        if isinstance(exc, RECOVERABLE):
            self.broken[i] = exc
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
        """Per ``reset_mode``, rewind or refork the given slots (concurrently) unless
        they are as built; per slot None or the failure."""
        todo = [i for i in indices if not self.pristine[i] and self.broken[i] is None]
        out: list[Any] = [None] * self.n
        if self.reset_mode == "env" or not todo:
            return out

        def prep(i: int) -> None:
            slot = self.slots[i]
            if self.reset_mode == "rewind":
                slot.rewind()
            else:
                slot.refork()

        with ThreadPoolExecutor(max_workers=max(1, min(len(todo), MAX_PARALLEL_OPEN))) as ex:
            futures = {i: ex.submit(prep, i) for i in todo}
        for i, fut in futures.items():
            exc = fut.exception()
            if exc is not None:
                lost = EnvServerLost(f"sub-env {i}: {self.reset_mode} failed: {exc}", index=i,
                                     machine=self.slots[i].machine)
                self.broken[i] = lost
                out[i] = lost
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
        self, actions: Sequence[Any], *, skip: Sequence[bool] | None = None,
        autoreset: Callable[[int], tuple[int | None, Any]] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Step the slots not in ``skip``. With ``autoreset`` a finished episode is
        reset in the same step (SAME_STEP), with ``autoreset(i)`` giving ``(seed,
        options)``: inside the server's round trip in reset mode "env", else by a
        rewind or refork and a reset right after. Per slot ``(obs, reward, terminated,
        truncated, info, final)`` (``final`` is ``(obs, info)`` of the finished
        episode, or None), an exception, or None for skipped slots."""
        in_server = autoreset is not None and self.reset_mode == "env"
        reqs: list[Request] = [None] * self.n
        for i in range(self.n):
            if skip is not None and skip[i]:
                continue
            reqs[i] = ("step", actions[i], autoreset(i) if in_server and autoreset else None)
            self.pristine[i] = False
        results = self.broadcast(reqs, timeout)
        if autoreset is None or in_server:
            return results
        done = [i for i, r in enumerate(results)
                if isinstance(r, tuple) and (r[2] or r[3])]
        if not done:
            return results
        args = {i: autoreset(i) for i in done}
        seeds = [args[i][0] if i in args else None for i in range(self.n)]
        options = [args[i][1] if i in args else None for i in range(self.n)]
        resets = self.reset(done, seeds, options)
        for i in done:
            r = resets[i]
            if isinstance(r, BaseException):
                results[i] = r
            else:
                obs, reward, terminated, truncated, info, _ = results[i]
                results[i] = (r[0], reward, terminated, truncated, r[1], (obs, info))
        return results

    # ------------------------------------------------------------------ recovery

    def replace(self, i: int) -> None:
        """Rebuild slot ``i`` from the source (a new fork, the env built anew).

        Raises:
            BoxdError: the new slot could not be made.
        """
        old = self.slots[i]
        with contextlib.suppress(Exception):
            old.close()
        (slot,) = self._open_all([i])
        self.slots[i] = slot
        self.rpcs[i] = Rpc(slot, i)
        self.broken[i] = None
        self.pristine[i] = True

    def close(self) -> None:
        """Close every env and delete every machine (errors are ignored: best effort)."""
        live = [i for i in range(self.n) if self.broken[i] is None]
        with contextlib.suppress(Exception):
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
