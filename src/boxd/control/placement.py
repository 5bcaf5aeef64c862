"""Placement on a cluster: which nodes new machines and fork children go to.

Pure logic over each live node's room (`Room`: free slots under its cap, free memory).
A `Chooser` ranks the nodes; `Placement` fills the ranking up to each node's cap,
honours a hint, and `launch` retries a launch that failed on a node on the next node,
excluding the ones that failed (as e2b-infra's orchestrator places a sandbox). On one
host there is nothing to choose: the control plane asks its node directly.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from boxd.errors import (
    BoxdError,
    HostSetupError,
    InternalError,
    MachineFailed,
    NotFound,
    ResourceExhausted,
)

log = logging.getLogger("boxd.control")

_T = TypeVar("_T")

#: Nodes a launch is tried on before its error is the request's (the first included).
LAUNCH_ATTEMPTS = 3
#: Launch errors that say the node failed, not the request: another node may succeed.
#: (NodeLost is a MachineFailed.) Bad input, quotas and names fail on every node.
NODE_FAULTS: tuple[type[BoxdError], ...] = (
    MachineFailed, HostSetupError, ResourceExhausted, InternalError,
)


@dataclass(frozen=True)
class Room:
    """A live node's room: machines it may still take under its cap, free memory, and
    the cap itself (BOXD_NODE_MAX_MACHINES; for errors)."""

    slots: int
    free_mib: int
    cap: int = 0


class Chooser(Protocol):
    """Ranks nodes for new machines, best first (the caller fills each up to its cap)."""

    def rank(self, room: Mapping[str, Room], prefer: Collection[str]) -> list[str]: ...


class MostFreeMemory:
    """Nodes in ``prefer`` (they hold the template or snapshot) first, then by free
    memory (``MemAvailable``), most first; ties keep the nodes' order."""

    def rank(self, room: Mapping[str, Room], prefer: Collection[str]) -> list[str]:
        return sorted(room, key=lambda n: (n not in prefer, -room[n].free_mib))


class Placement:
    """Where ``count`` machines go, by a `Chooser`, each node up to its cap."""

    def __init__(self, chooser: Chooser | None = None, *,
                 attempts: int = LAUNCH_ATTEMPTS) -> None:
        self.chooser: Chooser = chooser or MostFreeMemory()
        self.attempts = attempts

    def fill(self, room: Mapping[str, Room], order: list[str], count: int) -> list[str]:
        """``order``'s nodes, each repeated up to its free slots, at most ``count``."""
        out: list[str] = []
        for nid in order:
            out += [nid] * min(max(0, room[nid].slots), count - len(out))
        return out

    def choose(
        self, room: Mapping[str, Room], count: int = 1, *, hint: str | None = None,
        prefer: Collection[str] = (), exclude: Collection[str] = (),
    ) -> list[str]:
        """The node ids ``count`` new machines go to: ``hint`` if given (it must be live
        and under its cap), else the chooser's ranking, skipping ``exclude``.

        Raises:
            ResourceExhausted: the nodes have room for fewer than ``count``.
        """
        if hint is not None:
            order = [hint] if hint in room and hint not in exclude else []
        else:
            order = self.chooser.rank({n: r for n, r in room.items() if n not in exclude},
                                      prefer)
        out = self.fill(room, order, count)
        if len(out) < count:
            raise ResourceExhausted(
                f"no node has room for {count - len(out)} more machine(s)"
                + (f" on node {hint}" if hint else ""),
                hint="delete machines, add a node (`ray start --resources '{\"boxd\": 1}'`), "
                "or raise BOXD_NODE_MAX_MACHINES", needed=count, free=len(out),
            )
        return out

    def fork_targets(
        self, room: Mapping[str, Room], source: str, count: int, received: Collection[str]
    ) -> list[str | None]:
        """Where each of ``count`` fork children goes: the source's node while it has
        room (copy-on-write there), then the nodes that received the source's template
        before (copy-on-write there again), then the chooser's ranking; None for a
        child that fits nowhere."""
        here = self.fill(room, [source] if source in room else [], count)
        others = {n: r for n, r in room.items() if n != source}
        more = self.fill(others, self.chooser.rank(others, received), count - len(here))
        out: list[str | None] = [*here, *more]
        return out + [None] * (count - len(out))

    async def launch(
        self, room: Callable[[], Awaitable[Mapping[str, Room]]],
        attempt: Callable[[str], Awaitable[_T]], *, hint: str | None = None,
        prefer: Collection[str] = (),
    ) -> _T:
        """Run ``attempt(node_id)`` on the chosen node; when it fails with a node's fault
        (`NODE_FAULTS`) try the next choice without the nodes that failed, up to
        ``attempts`` nodes. A hinted launch runs on its node only.

        Raises:
            ResourceExhausted: no node has room (before any attempt).
            BoxdError: the last attempt's error, when every node tried failed or no
                other node has room.
        """
        failed: list[str] = []
        last: BoxdError | None = None
        while True:
            try:
                (nid,) = self.choose(await room(), hint=hint, prefer=prefer, exclude=failed)
            except ResourceExhausted:
                if last is None:
                    raise
                raise last from None  # the launch's own error, not "no other node"
            try:
                return await attempt(nid)
            except NODE_FAULTS as exc:
                if hint is not None or len(failed) + 1 >= self.attempts:
                    raise
                failed.append(nid)
                last = exc
                log.warning("node=%s event=launch_failed retry=%d error=%s", nid,
                            len(failed), exc)


#: What to do when fork children fit nowhere.
MORE_ROOM = ("delete machines, fork fewer, add a node (`ray start --resources "
             "'{\"boxd\": 1}'`), or raise BOXD_NODE_MAX_MACHINES")


def no_room(room: Mapping[str, Room], chosen: Sequence[str | None], *,
            only: str | None = None, why: str = "") -> ResourceExhausted:
    """The error of a fork child that fits on no node of ``room``: which nodes it could
    go to and their caps, counting the children ``chosen`` put there. ``only`` names the
    one node it could go to (a hint, or the source's node: ``why``)."""
    def load(n: str) -> str:
        r = room[n]
        return f"{r.cap - r.slots + chosen.count(n)} of {r.cap}"

    if only is not None:
        state = (f"it is at its machine cap ({load(only)}, counting this batch)"
                 if only in room else "it is not alive")
        todo = (f"delete machines on node {only}, fork fewer, or raise its "
                "BOXD_NODE_MAX_MACHINES" + ("" if why else "; or name another node"))
        return ResourceExhausted(
            f"node {only} has no room for this fork child: {state}"
            + (f"; {why}" if why else ""), hint=todo, needed=1, free=0, node=only,
            cap=room[only].cap if only in room else 0)
    nodes = ", ".join(f"{n} {load(n)}" for n in sorted(room)) or "no node is alive"
    return ResourceExhausted(
        f"no node has room for this fork child: every node is at its machine cap "
        f"({nodes}, counting this batch)", hint=MORE_ROOM, needed=1, free=0,
        caps={n: r.cap for n, r in room.items()})


def check_hint(hint: str | None, nodes: Collection[str]) -> None:
    """Raise `NotFound` if a placement hint names no node."""
    if hint is not None and hint not in nodes:
        raise NotFound(f"no node {hint!r}", field="node",
                       hint="`boxd nodes list` shows the nodes")


__all__ = [
    "LAUNCH_ATTEMPTS", "MORE_ROOM", "NODE_FAULTS", "Chooser", "MostFreeMemory", "Placement",
    "Room", "check_hint", "no_room",
]
