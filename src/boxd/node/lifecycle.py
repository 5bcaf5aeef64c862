"""The machine lifecycle: states, the transition table, `require`, leases.

Every change of a machine's state goes through `Lifecycle.move`, which checks the
transition table and writes with one compare-and-set (``UPDATE … WHERE state IN …``),
so two operations racing on one machine cannot both win and a read never writes.

::

    starting ──agent answered──▶ running ◀──────────────┐
       │                   idle / │  │ first fork of a   │
       │          suspend() ┌─────┘  └─ fork child ──▶ swapping
       │                    ▼   ▲ wake (resume)        │
       │               suspended│        checkpoint restore ──▶ restoring
       │                    │   │
       │     idle/hibernate()▼   │
       │              hibernating ──▶ hibernated ──wake──▶ waking ──▶ running
       ▼                               any state ─────▶ failed (process exit, failed op)
    failed ──checkpoint restore──▶ restoring            failed/any ──▶ deleting ──▶ gone
                                   any state ──its cluster node died──▶ lost ──▶ deleting

A `Lease` serialises the operations that change a machine's process, disk chain or
memory (fork template, checkpoint save/restore, snapshot capture, RAM swap, collapse,
delete) and lets those that replace the VM process close the machine to agent users
first, so no request ever talks to a half-swapped handle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from boxd.errors import MachineNotFound, StateError
from boxd.models import MachineState
from boxd.state import MachineRecord
from boxd.state.repos import Machines

S = MachineState

# From each state, where a machine may go. DELETING is terminal (the record goes).
TRANSITIONS: dict[MachineState, frozenset[MachineState]] = {
    S.STARTING: frozenset({S.RUNNING, S.FAILED, S.DELETING}),
    S.RUNNING: frozenset({S.SUSPENDED, S.HIBERNATING, S.SWAPPING, S.RESTORING, S.FAILED,
                          S.DELETING}),
    S.SUSPENDED: frozenset({S.RUNNING, S.HIBERNATING, S.FAILED, S.DELETING}),
    S.HIBERNATING: frozenset({S.HIBERNATED, S.RUNNING, S.SUSPENDED, S.FAILED}),
    S.HIBERNATED: frozenset({S.WAKING, S.FAILED, S.DELETING}),
    S.WAKING: frozenset({S.RUNNING, S.HIBERNATED, S.FAILED}),
    S.SWAPPING: frozenset({S.RUNNING, S.FAILED, S.DELETING}),
    S.RESTORING: frozenset({S.RUNNING, S.FAILED, S.DELETING}),
    S.FAILED: frozenset({S.RESTORING, S.DELETING}),
    # The control plane's copy only: the machine's cluster node is gone.
    S.LOST: frozenset({S.DELETING}),
    S.DELETING: frozenset(),
}
# Any state but these may become LOST (its node died).
for _st in S:
    if _st not in (S.LOST, S.DELETING):
        TRANSITIONS[_st] = TRANSITIONS[_st] | {S.LOST}

# States in which the VM process may be talked to (exec, files, capture).
LIVE = (S.STARTING, S.RUNNING)
# States an operation holds the machine in: requests wait for the operation's lease.
TRANSIENT = (S.SWAPPING, S.RESTORING, S.HIBERNATING, S.WAKING)
# States a request wakes the machine from.
ASLEEP = (S.SUSPENDED, S.HIBERNATED)
# States that have a VM process (after a restart: re-attach it).
HAS_VM = (S.STARTING, S.RUNNING, S.SUSPENDED, S.SWAPPING, S.RESTORING, S.HIBERNATING,
          S.WAKING)


def allowed(src: MachineState, dst: MachineState) -> bool:
    return dst in TRANSITIONS[src]


def require(machine: MachineRecord, *states: MachineState) -> MachineRecord:
    """Return ``machine`` if it is in one of ``states``.

    Raises:
        StateError: it is not; the error names its state and the required ones.
    """
    if machine.state not in states:
        raise StateError(
            f"machine {machine.name!r} is {machine.state.value}; this needs it "
            + " or ".join(s.value for s in states),
            machine=machine.name, state=machine.state.value,
            required=[s.value for s in states],
            hint=_hint(machine),
        )
    return machine


def _hint(machine: MachineRecord) -> str:
    if machine.state == S.FAILED:
        return (f"restore a checkpoint, or delete it (`boxd machine delete {machine.name}`) "
                "and create it again")
    if machine.state in TRANSIENT:
        return "retry when the operation in progress finishes"
    return "`boxd machine info` shows its state"


class Lifecycle:
    """The one writer of machine states.

    It also remembers which machines it last saw ``running`` (its own moves, and records
    read while nothing can move them), so the hot path of a process's stream can skip
    reading the database for every frame: `is_running`.
    """

    def __init__(self, machines: Machines) -> None:
        self._machines = machines
        self._running: set[str] = set()

    def is_running(self, machine_id: str) -> bool:
        """True when this node's last word on the machine's state is ``running``."""
        return machine_id in self._running

    def saw(self, machine: MachineRecord) -> None:
        """``machine`` was just read (no move can have come between the read and now)."""
        if machine.state == S.RUNNING:
            self._running.add(machine.id)
        else:
            self._running.discard(machine.id)

    def move(
        self, machine_id: str, dst: MachineState, *, expect: tuple[MachineState, ...] | None = None,
        error: str | None = None, quota: tuple[str, int] | None = None,
    ) -> bool:
        """Move a machine to ``dst`` from any state that allows it (or from ``expect``).

        Returns False when the machine was not in such a state (someone else moved it,
        or it is gone); the record is unchanged then.

        Raises:
            StateError: ``expect`` names a state from which ``dst`` is illegal.
        """
        sources = expect if expect is not None else tuple(
            s for s, targets in TRANSITIONS.items() if dst in targets
        )
        for src in sources:
            if not allowed(src, dst):
                raise StateError(
                    f"illegal transition {src.value} -> {dst.value}", machine=machine_id,
                    state=src.value, required=[s.value for s in TRANSITIONS if allowed(s, dst)],
                )
        moved = self._machines.compare_and_set(machine_id, sources, dst, error, quota=quota)
        if moved and dst == S.RUNNING:
            self._running.add(machine_id)
        else:  # moved elsewhere, or not moved: in a state this call did not see
            self._running.discard(machine_id)
        return moved

    def fail(self, machine_id: str, reason: str) -> bool:
        """Mark a machine failed (from any non-terminal state) with the reason."""
        return self.move(machine_id, S.FAILED, error=reason)

    def begin(
        self, machine: MachineRecord, dst: MachineState, *required: MachineState
    ) -> MachineRecord:
        """Enter a transient state from one of ``required``, or raise `StateError`.

        Raises:
            StateError: the machine is not in a required state (it may have moved since).
        """
        require(machine, *required)
        if not self.move(machine.id, dst, expect=(machine.state,)):
            fresh = self._machines.get(machine.id)
            if fresh is None:
                raise MachineNotFound(f"no machine named {machine.name!r}", machine=machine.name)
            require(fresh, *required)  # it moved: raise with its current state
            return self.begin(fresh, dst, *required)
        fresh = self._machines.get(machine.id)
        assert fresh is not None
        return fresh

    # A cluster keeps two copies of a machine's record: the node's (its truth, moved by
    # the node's Lifecycle) and the control plane's mirror. Besides `move`, these three
    # named operations are the only writers of a state there. LOST is a state of the
    # control plane's copy only (a dead node cannot write its own).

    def adopt(self, machine: MachineRecord, quota: int) -> None:
        """On a cluster node: record a machine the control plane claimed, in the state
        its claim gave it (``starting``); the node's moves start from there. ``quota`` is
        the account's machine quota (the node applies it to wakes)."""
        self._machines.adopt(machine, quota)
        self._running.discard(machine.id)

    def mirror(self, machine: MachineRecord) -> bool:
        """On the control plane: copy a node's record (the truth: its own Lifecycle
        checked every move) over this table's copy. Not a move: the copy takes whatever
        state the node reached, except that a copy ``lost`` (its node died) or
        ``deleting`` (on its way out) stays so. False if the copy is gone or kept."""
        self._running.discard(machine.id)
        return self._machines.mirror(machine, keep=(S.LOST, S.DELETING))

    def mark_lost(self, node_id: str, reason: str) -> list[str]:
        """On the control plane: every machine of a dead node becomes ``lost`` (from any
        state the table lets reach it), with ``reason``; returns their ids."""
        sources = tuple(s for s, targets in TRANSITIONS.items() if S.LOST in targets)
        lost = self._machines.compare_and_set_node(node_id, sources, S.LOST, reason)
        self._running.difference_update(lost)
        return lost


class Lease:
    """Per machine: one mutating operation at a time; a gate for agent users.

    ``op()`` serialises operations. ``replace()`` (inside ``op()``) additionally closes
    the gate: new agent users wait, and those in flight are given ``drain`` seconds to
    finish before the VM process is replaced.
    """

    def __init__(self) -> None:
        self._op = asyncio.Lock()
        self._cond = asyncio.Condition()
        self._users = 0
        self._closed = False

    @property
    def busy(self) -> bool:
        return self._op.locked()

    @property
    def users(self) -> int:
        """Agent requests in flight."""
        return self._users

    @contextlib.asynccontextmanager
    async def op(self) -> AsyncIterator[None]:
        async with self._op:
            yield

    @contextlib.asynccontextmanager
    async def replace(self, drain: float = 0.0) -> AsyncIterator[None]:
        """Close the gate to agent users while the VM process is replaced."""
        async with self._cond:
            self._closed = True
            if drain > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._cond.wait_for(lambda: self._users == 0), timeout=drain
                    )
        try:
            yield
        finally:
            async with self._cond:
                self._closed = False
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[None]:
        """Hold the machine's VM process for one agent request."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._closed)
            self._users += 1
        try:
            yield
        finally:
            async with self._cond:
                self._users -= 1
                self._cond.notify_all()


__all__ = [
    "ASLEEP", "HAS_VM", "LIVE", "TRANSIENT", "TRANSITIONS", "Lease", "Lifecycle", "allowed",
    "require",
]
