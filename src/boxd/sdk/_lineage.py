"""Fork and snapshot lineage, built on the client from the two list endpoints.

No I/O here: ``build(machines, snapshots, ref)`` turns what ``machines.list()`` and
``snapshots.list()`` return into trees. A machine's ``parent_id`` says which machine it
was forked from, its ``snapshot`` which snapshot it (or its first ancestor) started
from; a snapshot's ``source_machine`` names the machine it was saved from.

Names are matched as they are now: a snapshot whose source machine was deleted (or
whose name now belongs to a newer machine) is listed by name only, and a fork whose
parent was deleted becomes a root of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from boxd import models

__all__ = ["Lineage", "MachineNode", "SnapshotNode", "build", "digest_key"]


@dataclass(frozen=True)
class MachineNode:
    """One machine in the fork tree.

    Attributes:
        machine: the machine.
        from_snapshot: the snapshot it started from, when it (not an ancestor in this
            tree) was made from one; a digest the daemon no longer lists leaves it None.
        snapshots: the snapshot versions saved from this machine, oldest first.
        children: the machines forked from it, oldest first.
    """

    machine: models.Machine
    from_snapshot: models.Snapshot | None
    snapshots: tuple[models.Snapshot, ...]
    children: tuple[MachineNode, ...]

    def walk(self) -> list[MachineNode]:
        """This node and every descendant, depth first."""
        out = [self]
        for c in self.children:
            out += c.walk()
        return out


@dataclass(frozen=True)
class SnapshotNode:
    """One snapshot version and what came of it.

    Attributes:
        snapshot: the snapshot version.
        source: the machine it was saved from, if that machine still exists.
        machines: the fork trees of the machines started from this version.
    """

    snapshot: models.Snapshot
    source: models.Machine | None
    machines: tuple[MachineNode, ...]


@dataclass(frozen=True)
class Lineage:
    """Fork trees and snapshot lineage of an account (or of one machine's subtree).

    Attributes:
        machines: root machines (no living parent; or the machine asked for), oldest first.
        snapshots: snapshot versions by name then version; with a machine asked for, only
            those saved from its subtree or that its subtree started from.
    """

    machines: tuple[MachineNode, ...]
    snapshots: tuple[SnapshotNode, ...]


def digest_key(digest: str | None) -> str:
    """A digest without its ``sha256:`` prefix (machines record the bare hex)."""
    return (digest or "").removeprefix("sha256:")


def build(
    machines: Sequence[models.Machine],
    snapshots: Sequence[models.Snapshot],
    ref: str | None = None,
) -> Lineage:
    """The lineage of ``machines`` and ``snapshots``; of machine ``ref`` (id) only if given.

    Raises:
        KeyError: ``ref`` is not the id of one of ``machines``.
    """
    by_id = {m.id: m for m in machines}
    by_name = {m.name: m for m in machines}
    by_digest = {digest_key(s.digest): s for s in snapshots}
    kids: dict[str, list[models.Machine]] = {}
    for m in machines:
        if m.parent_id is not None and m.parent_id in by_id:
            kids.setdefault(m.parent_id, []).append(m)
    saved: dict[str, list[models.Snapshot]] = {}
    source_of: dict[str, models.Machine] = {}
    for s in snapshots:
        src = by_name.get(s.source_machine or "")
        if src is not None and src.created_at <= s.created_at:  # not a newer namesake
            saved.setdefault(src.id, []).append(s)
            source_of[s.id] = src

    def node(m: models.Machine) -> MachineNode:
        parent = by_id.get(m.parent_id or "")
        inherited = parent is not None and parent.snapshot == m.snapshot
        return MachineNode(
            machine=m,
            from_snapshot=None if inherited else by_digest.get(digest_key(m.snapshot)),
            snapshots=tuple(sorted(saved.get(m.id, []), key=lambda s: s.created_at)),
            children=tuple(node(c) for c in sorted(kids.get(m.id, []),
                                                   key=lambda c: c.created_at)),
        )

    if ref is not None:
        roots = [node(by_id[ref])]
    else:
        roots = [node(m) for m in sorted(machines, key=lambda m: m.created_at)
                 if m.parent_id is None or m.parent_id not in by_id]
    every = [n for r in roots for n in r.walk()]
    started: dict[str, list[MachineNode]] = {}
    for n in every:
        if n.from_snapshot is not None:
            started.setdefault(digest_key(n.from_snapshot.digest), []).append(n)

    wanted = list(snapshots)
    if ref is not None:
        in_tree = {n.machine.id for n in every}
        wanted = [s for s in snapshots
                  if digest_key(s.digest) in started
                  or (s.id in source_of and source_of[s.id].id in in_tree)]
    snap_nodes = tuple(
        SnapshotNode(snapshot=s, source=source_of.get(s.id),
                     machines=tuple(started.get(digest_key(s.digest), [])))
        for s in sorted(wanted, key=lambda s: (s.name, s.version))
    )
    return Lineage(machines=tuple(roots), snapshots=snap_nodes)
