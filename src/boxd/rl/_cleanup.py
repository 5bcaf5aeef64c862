"""Machines that `boxd.rl` makes carry labels naming what made them (docs/rl.md,
"Cleanup after a crash"), so that they are found and removed by those labels whatever
happened to the answers that named them.

``boxd.rl/run=<id>`` is one `MachineHome` (an `Env`, a `VectorEnv`, or one `verify`
call, with every fork, template and branch made through it); ``boxd.rl/owner`` says
which of ``env`` and ``verify`` made it; ``boxd.rl/branch=<id>`` marks one
``branch`` call's forks. Forks inherit their source's labels, so a branch of an env's
machine carries the env's run. Closing a home deletes its run by label; `delete_on_signals`
does the same when SIGTERM or SIGINT stops a process (``boxd rl verify``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import TYPE_CHECKING

from boxd import errors

if TYPE_CHECKING:
    from boxd.sdk._sync import Boxd

log = logging.getLogger("boxd.rl")

RUN_LABEL = "boxd.rl/run"
OWNER_LABEL = "boxd.rl/owner"
BRANCH_LABEL = "boxd.rl/branch"
#: Seconds a signalled process waits for the creations it has in flight to answer
#: before it deletes by label (a machine claimed after the delete would be left).
DRAIN_TIMEOUT = 120.0


def new_id(prefix: str = "r") -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


def run_labels(owner: str, run: str | None = None) -> dict[str, str]:
    """The labels of a new run: ``boxd.rl/run`` (new unless given) and ``boxd.rl/owner``."""
    return {RUN_LABEL: run or new_id(), OWNER_LABEL: owner}


class Creations:
    """The process's machine creations in flight, and a gate that stops new ones.

    `delete_on_signals` closes the gate, waits for the creations in flight to answer
    (their machines exist then, labelled), and only then deletes by label: no fork
    request can be claimed after the delete.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inflight: dict[int, int] = {}  # thread id -> creations it has in flight
        self.stopping = False

    def own(self) -> bool:
        """True if the calling thread has a creation in flight (a signal interrupted it)."""
        with self._cond:
            return bool(self._inflight.get(threading.get_ident()))

    @contextlib.contextmanager
    def creating(self) -> Iterator[None]:
        """Around one request that makes machines.

        Raises:
            Conflict: the process is stopping (a signal arrived): nothing is made.
        """
        with self._cond:
            if self.stopping:
                raise errors.Conflict("this process is stopping: no new machine is made",
                                      hint="it was signalled; its machines are being deleted")
            me = threading.get_ident()
            self._inflight[me] = self._inflight.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight[me] -= 1
                if not self._inflight[me]:
                    del self._inflight[me]
                self._cond.notify_all()

    def stop(self, timeout: float = DRAIN_TIMEOUT) -> bool:
        """Close the gate and wait for the creations other threads have in flight (the
        caller's own, a signal handler's interrupted thread, cannot go on meanwhile);
        False on a timeout."""
        me = threading.get_ident()
        with self._cond:
            self.stopping = True
            return self._cond.wait_for(
                lambda: not any(n for t, n in self._inflight.items() if t != me), timeout)


CREATIONS = Creations()


def delete_labelled(boxd: Boxd, labels: Mapping[str, str]) -> int:
    """Delete every machine carrying ``labels``, best effort; how many were deleted.

    A failure is logged, never raised: this runs on close and on the way out. No
    labels select nothing (an empty selector would be every machine).
    """
    if not labels:
        return 0
    try:
        result = boxd.machines.delete_many(labels)
    except errors.BoxdError as exc:
        log.warning("could not delete the machines labelled %s: %s", labels, exc)
        return 0
    for item in result.errors:
        log.warning("could not delete %s (%s): %s", item.machine.name, item.machine.id,
                    item.error.message)
    return len(result.deleted)


@contextlib.contextmanager
def delete_on_signals(boxd: Boxd, labels: Mapping[str, str]) -> Iterator[None]:
    """While inside: SIGTERM or SIGINT stops new machines, waits for the creations in
    flight, deletes every machine labelled ``labels`` and ends the process (status
    128 + the signal's number). Only from the main thread (elsewhere: nothing is
    installed, and the caller's own close paths apply)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        drained = CREATIONS.stop() and not CREATIONS.own()
        deleted = delete_labelled(boxd, labels)
        if not drained:  # a creation still hangs: one more pass for what it made
            time.sleep(1.0)
            deleted += delete_labelled(boxd, labels)
        sel = ",".join(f"{k}={v}" for k, v in labels.items())
        sys.stderr.write(f"stopped by {name}: deleted {deleted} machines labelled {sel}\n")
        sys.stderr.flush()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(128 + signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


__all__ = ["BRANCH_LABEL", "CREATIONS", "OWNER_LABEL", "RUN_LABEL", "delete_labelled",
           "delete_on_signals", "new_id", "run_labels"]
