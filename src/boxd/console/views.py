"""What the console's pages show, built from the services' models: pure functions.

A machine row (the table's columns), the fork tree around one machine as graph elements
(cytoscape.js's ``{"data": ...}`` shape) and as a nested list (the same tree, readable
without the canvas: screen readers, keyboards), and what a machine's page follows live:
its state, its recent execs, its processes.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from boxd import models
from boxd import process_models as pm

__all__ = ["ACTIONS", "exec_row", "graph_elements", "machine_live", "machine_row",
           "process_row", "snapshot_row", "tree_list"]

#: The actions a row offers, in the order of its buttons.
ACTIONS = ("suspend", "resume", "hibernate", "fork", "checkpoint", "snapshot", "delete")


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{int(seconds)}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 86400)}d"


def snapshot_label(digest: str | None, snapshots: Mapping[str, models.Snapshot]) -> str:
    """``name@version`` of the snapshot with ``digest``, its short digest, or "image"."""
    if digest is None:
        return "image"
    snap = snapshots.get(digest)
    return f"{snap.name}@{snap.version}" if snap else digest.removeprefix("sha256:")[:12]


def machine_row(m: models.Machine, names: Mapping[str, str],
                snapshots: Mapping[str, models.Snapshot], now: float | None = None,
                ) -> dict[str, Any]:
    """One row of the machines table (JSON: the page renders it, the live stream sends it).

    Args:
        m: the machine.
        names: machine id -> name, for the parent's name.
        snapshots: digest -> snapshot, for the image or snapshot it started from.
        now: wall-clock seconds (default: now).
    """
    now = time.time() if now is None else now
    return {
        "id": m.id,
        "name": m.name,
        "state": m.state.value,
        "engine": m.engine or "",
        "source": snapshot_label(m.snapshot, snapshots),
        "labels": dict(sorted(m.labels.items())),
        "parent": names.get(m.parent_id, m.parent_id) if m.parent_id else "",
        "parent_id": m.parent_id or "",
        "age": _age(now - m.created_at),
        "idle": _age(m.idle_seconds) if m.idle_seconds is not None else "",
        "memory": f"{m.memory_mib} MiB",
    }


def clock(t: float) -> str:
    """A moment as the pages show it: the daemon's local time."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def machine_live(m: models.Machine) -> dict[str, Any]:
    """What a machine's page follows of the machine itself (nothing that changes by the
    second, so an event means a change)."""
    return {"id": m.id, "name": m.name, "state": m.state.value, "error": m.error or ""}


def exec_row(e: models.ExecSummary) -> dict[str, Any]:
    """One row of a machine's recent execs: ``exit`` says how it ended in words, ``ok``
    whether that was a zero exit."""
    if e.running:
        ended = "running"
    elif e.error is not None:
        ended = f"failed: {e.error.message}"
    elif e.timed_out:
        ended = f"timed out ({e.exit_code})"
    elif e.signal is not None:
        ended = f"{e.exit_code} (signal {e.signal})"
    else:
        ended = str(e.exit_code)
    return {
        "exec_id": e.exec_id, "command": e.command, "exit": ended,
        "ok": e.exit_code == 0 and not e.running and e.error is None,
        "started": clock(e.started_at),
        "duration": f"{e.duration:.2f} s" if e.duration is not None else "",
    }


#: Characters of a process's command its page shows (in a list to pick from).
PROCESS_COMMAND_SHOWN = 80


def process_row(p: pm.Process) -> dict[str, Any]:
    """One of a machine's processes, as its page lists it (and offers its output)."""
    state = p.state if p.exit_code is None else f"{p.state} ({p.exit_code})"
    command = shlex.join(p.argv)
    if len(command) > PROCESS_COMMAND_SHOWN:
        command = command[: PROCESS_COMMAND_SHOWN - 1] + "…"
    return {"id": p.id, "command": command, "state": state,
            "running": p.state != "exited", "started": clock(p.started_at)}


def snapshot_row(s: models.Snapshot, names: Mapping[str, str]) -> dict[str, Any]:
    """One row of the snapshots table."""
    return {
        "name": s.name,
        "version": s.version,
        "digest": s.digest,
        "size": _size(s.stored_bytes or s.memory_bytes + s.disk_bytes),
        "machine": names.get(s.source_machine or "", s.source_machine or ""),
        "image": s.image or "",
        "engine": s.engine or "",
        "age": _age(time.time() - s.created_at),
    }


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _lineage(focus: models.Machine, machines: Sequence[models.Machine],
             ) -> list[models.Machine]:
    """``focus``'s ancestors (oldest first), itself, then all its descendants."""
    by_id = {m.id: m for m in machines}
    ancestors: list[models.Machine] = []
    seen = {focus.id}
    parent = by_id.get(focus.parent_id or "")
    while parent is not None and parent.id not in seen:
        seen.add(parent.id)
        ancestors.insert(0, parent)
        parent = by_id.get(parent.parent_id or "")
    children: dict[str, list[models.Machine]] = {}
    for m in machines:
        if m.parent_id:
            children.setdefault(m.parent_id, []).append(m)
    out = [*ancestors, focus]
    queue = [focus.id]
    while queue:
        for child in children.get(queue.pop(0), []):
            if child.id not in seen:
                seen.add(child.id)
                out.append(child)
                queue.append(child.id)
    return out


def graph_elements(
    focus: models.Machine,
    machines: Sequence[models.Machine],
    snapshots: Iterable[models.Snapshot] = (),
    checkpoints: Iterable[models.Checkpoint] = (),
) -> list[dict[str, Any]]:
    """The fork tree around ``focus`` as cytoscape.js elements.

    Machine nodes (``kind: machine``, ``href`` to their page; ``focus`` marks the page's
    own), a node per snapshot one of them started from or was saved from (``kind:
    snapshot``), a node per checkpoint of ``focus`` (``kind: checkpoint``), and edges
    from each parent to what came of it.
    """
    tree = _lineage(focus, machines)
    ids = {m.id for m in tree}
    snaps = list(snapshots)
    by_digest = {s.digest: s for s in snaps}
    nodes: list[dict[str, Any]] = []
    edges: list[dict[str, Any]] = []
    for m in tree:
        nodes.append({"data": {"id": m.id, "label": m.name, "kind": "machine",
                               "state": m.state.value, "href": f"/machines/{m.id}",
                               "focus": m.id == focus.id}})
        if m.parent_id in ids:
            edges.append({"data": {"id": f"{m.parent_id}>{m.id}", "source": m.parent_id,
                                   "target": m.id}})
        elif m.snapshot:  # a root of this tree that started from a snapshot
            snap_id = f"snapshot:{m.snapshot}"
            if not any(n["data"]["id"] == snap_id for n in nodes):
                label = snapshot_label(m.snapshot, by_digest)
                nodes.insert(0, {"data": {"id": snap_id, "label": label, "kind": "snapshot",
                                          "href": "/snapshots"}})
            edges.append({"data": {"id": f"{snap_id}>{m.id}", "source": snap_id,
                                   "target": m.id}})
    by_name = {m.name: m.id for m in tree}  # a snapshot names its machine by id or name
    for s in snaps:
        source = by_name.get(s.source_machine or "", s.source_machine)
        if source in ids:
            snap_id = f"snapshot:{s.digest}"
            if not any(n["data"]["id"] == snap_id for n in nodes):
                nodes.append({"data": {"id": snap_id, "label": f"{s.name}@{s.version}",
                                       "kind": "snapshot", "href": "/snapshots"}})
            edges.append({"data": {"id": f"{source}>{snap_id}", "source": source,
                                   "target": snap_id}})
    for c in checkpoints:
        cp_id = f"checkpoint:{c.id}"
        nodes.append({"data": {"id": cp_id, "label": c.name, "kind": "checkpoint",
                               "href": f"/machines/{focus.id}#checkpoints"}})
        edges.append({"data": {"id": f"{focus.id}>{cp_id}", "source": focus.id,
                               "target": cp_id}})
    return nodes + edges


def tree_list(focus: models.Machine, machines: Sequence[models.Machine],
              ) -> list[dict[str, Any]]:
    """The machines of ``focus``'s fork tree as nested items ``{machine, children}``,
    from its oldest ancestor (the graph, as a list)."""
    tree = _lineage(focus, machines)
    items: dict[str, dict[str, Any]] = {m.id: {"machine": m, "children": []} for m in tree}
    roots: list[dict[str, Any]] = []
    for m in tree:
        parent = items.get(m.parent_id or "")
        (parent["children"] if parent else roots).append(items[m.id])
    return roots
