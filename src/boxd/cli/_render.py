"""Rendering for the CLI: rich tables for people, JSON for scripts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.tree import Tree

from boxd import models
from boxd.sdk import _lineage


def console(stderr: bool = False) -> Console:
    # Built per call so that it writes to the current sys.stdout (CliRunner swaps it).
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def quiet(as_json: bool = False) -> bool:
    """Progress is for people: none with ``--json`` or when stdout is not a terminal."""
    return as_json or not sys.stdout.isatty()


@contextlib.contextmanager
def activity(text: str, *, as_json: bool = False) -> Iterator[Callable[[str, float | None], None]]:
    """A spinner with elapsed time on stderr while work runs; a bar once a fraction is known.

    Yields ``update(step, fraction_or_None)``, the image builder's progress callback.
    """
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   TaskProgressColumn(), TimeElapsedColumn(), console=console(stderr=True),
                   transient=True, disable=quiet(as_json))
    with bar:
        task = bar.add_task(text, total=None)

        def update(step: str, fraction: float | None = None) -> None:
            if fraction is None:
                bar.update(task, description=f"{text}: {step}")
            else:
                bar.update(task, description=f"{text}: {step}", total=1.0, completed=fraction)

        yield update


@contextlib.contextmanager
def transfer(text: str, *, as_json: bool = False) -> Iterator[Callable[[int, int | None], None]]:
    """A bar with bytes, rate and elapsed time on stderr for a snapshot export or import.

    Yields ``progress(done, total_or_None)``, the SDK's ``TransferProgress`` callback.
    """
    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeElapsedColumn(), console=console(stderr=True),
                   transient=False, disable=quiet(as_json))
    with bar:
        task = bar.add_task(text, total=None)

        def progress(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        yield progress


@contextlib.contextmanager
def progress(text: str, *, total: int, as_json: bool = False) -> Iterator[Callable[[bool], None]]:
    """A bar over ``total`` items on stderr, counting the ones that went wrong.

    Yields ``advance(bad)``; safe to call from worker threads (rich locks its tasks).
    """
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[bad]} diverged"), TimeElapsedColumn(),
                   TimeRemainingColumn(), console=console(stderr=True), transient=False,
                   disable=quiet(as_json))
    with bar:
        task = bar.add_task(text, total=total, bad=0)
        bad_count = 0

        def advance(bad: bool) -> None:
            nonlocal bad_count
            bad_count += bad
            bar.update(task, advance=1, bad=bad_count)

        yield advance


def jsonable(obj: Any) -> Any:
    """Plain JSON data for a model, dataclass, path or a list of them."""
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def print_json(obj: Any) -> None:
    click.echo(json.dumps(jsonable(obj), indent=2))


def ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit} ago"
    return f"{int(s)}s ago"


def size(n: int | None) -> str:
    if not n:
        return "0"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


_STATE_STYLE = {
    "running": "green", "starting": "yellow", "failed": "red", "deleting": "dim",
    "suspended": "cyan", "hibernated": "blue", "hibernating": "blue", "waking": "yellow",
    "swapping": "yellow", "restoring": "yellow",
}


def idle(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _timer(seconds: float | None) -> str:
    if seconds is None:
        return "daemon default"
    return "never" if seconds == 0 else idle(seconds)


def _state(state: models.MachineState | str) -> str:
    value = state.value if isinstance(state, models.MachineState) else str(state)
    style = _STATE_STYLE.get(value, "")
    return f"[{style}]{value}[/]" if style else value


def table(columns: Sequence[str], rows: Iterable[Sequence[str]], empty: str) -> None:
    rows = list(rows)
    out = console()
    if not rows:
        out.print(f"[dim]{empty}[/]")
        return
    t = Table(box=None, header_style="bold", pad_edge=False)
    for c in columns:
        t.add_column(c, no_wrap=True)
    for r in rows:
        t.add_row(*r)
    if not out.is_terminal:
        # Piped (`boxd machine list | grep`): never cut a column to a guessed width of
        # 80; the table is as wide as its widest row.
        wide = Console(width=1 << 16, highlight=False, soft_wrap=False)
        out = Console(highlight=False, soft_wrap=False, width=wide.measure(t).maximum)
    out.print(t)


def details(pairs: Iterable[tuple[str, object]]) -> None:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    for k, v in pairs:
        t.add_row(k, "-" if v is None or v == "" else str(v))
    console().print(t)


def machines(items: Sequence[models.Machine]) -> None:
    table(
        ["NAME", "ID", "STATE", "IDLE", "CPUS", "MEMORY", "DISK", "PORT", "PARENT", "CREATED"],
        (
            [
                m.name,
                m.id,
                _state(m.state),
                idle(m.idle_seconds),
                str(m.vcpus),
                f"{m.memory_mib} MiB",
                f"{m.disk_gib} GiB",
                str(m.port or "-"),
                m.parent_id or "-",
                ago(m.created_at),
            ]
            for m in items
        ),
        "no machines",
    )


def _exit(e: models.ExecSummary) -> str:
    if e.running:
        return "running"
    if e.error is not None:
        return f"error: {e.error.code}"
    if e.timed_out:
        return "timed out"
    return str(e.exit_code) if e.signal is None else f"signal {e.signal}"


def execs(items: Sequence[models.ExecSummary]) -> None:
    table(
        ["ID", "EXIT", "STARTED", "DURATION", "COMMAND"],
        ([e.exec_id, _exit(e), ago(e.started_at),
          "-" if e.duration is None else f"{e.duration:.2f} s", e.command[:80]]
         for e in items),
        "no execs kept",
    )


def metrics(m: models.MachineMetrics) -> None:
    table(
        ["TIME", "CPUS", "CPU", "MEMORY", "CACHE", "DISK"],
        ([ago(s.timestamp), str(s.cpu_count), f"{s.cpu_used_pct:.1f}%",
          f"{size(s.mem_used)} / {size(s.mem_total)}", size(s.mem_cache),
          f"{size(s.disk_used)} / {size(s.disk_total)}"] for s in m.samples),
        f"no samples kept (the machine is {m.state}: only a running machine is sampled)",
    )


def machine(m: models.Machine) -> None:
    details(
        [
            ("name", m.name),
            ("id", m.id),
            ("state", _state(m.state)),
            ("idle", idle(m.idle_seconds)),
            ("suspend after", _timer(m.suspend_after)),
            ("hibernate after", _timer(m.hibernate_after)),
            ("engine", m.engine),
            ("vcpus", m.vcpus),
            ("memory", f"{m.memory_mib} MiB"),
            ("disk", f"{m.disk_gib} GiB"),
            ("isolated", "yes" if m.isolated else "no"),
            ("host ports", ", ".join(f"host.boxd.internal:{p}" for p in m.expose_host)
             or None),
            ("egress", None if m.egress is None else ", ".join(m.egress) or "none"),
            ("engine", m.engine),
            ("port", m.port),
            ("url", m.url),
            ("parent", m.parent_id),
            ("snapshot", m.snapshot),
            ("image", f"{m.image.name} ({short_digest(m.image.digest)})" if m.image else None),
            ("accelerator", m.accelerator),
            ("error", m.error),
            ("labels", ", ".join(f"{k}={v}" for k, v in sorted(m.labels.items())) or None),
            ("ends", _end(m)),
            ("created", ago(m.created_at)),
        ]
    )


def _end(m: models.Machine) -> str | None:
    """``in 4m 10s (delete, 2026-12-05 14:02:11 UTC)``; None without a lifetime."""
    if m.end_at is None:
        return None
    left = m.end_at.timestamp() - time.time()
    when = m.end_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"{'in ' + _span(left) if left > 0 else 'now'} ({m.on_timeout}, {when})"


def _span(seconds: float) -> str:
    s = int(seconds)
    parts = [(s // 86400, "d"), (s % 86400 // 3600, "h"), (s % 3600 // 60, "m"), (s % 60, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n][:2]
    return " ".join(shown) or "0s"


def standby(s: models.Standby) -> None:
    details([("machine", s.machine_id), ("standby forks", s.forks), ("engine", s.engine),
             ("host memory", size(s.memory_bytes))])


def checkpoints(items: Sequence[models.Checkpoint]) -> None:
    table(
        ["NAME", "ID", "CREATED"],
        ([c.name, c.id, ago(c.created_at)] for c in items),
        "no checkpoints",
    )


def snapshots(items: Sequence[models.Snapshot]) -> None:
    table(
        ["NAME", "VERSION", "DIGEST", "SOURCE", "STORED", "CREATED"],
        (
            [
                s.name,
                str(s.version),
                s.digest[:19],
                s.source_machine or "-",
                size(s.stored_bytes),
                ago(s.created_at),
            ]
            for s in items
        ),
        "no snapshots",
    )


def oci_images(items: Sequence[models.Image]) -> None:
    table(
        ["NAME", "DIGEST", "LAYERS", "SIZE", "PLATFORM", "CREATED"],
        ([i.name, i.digest[:19], str(len(i.layers)), size(i.size), f"{i.os}/{i.architecture}",
          i.created or "-"] for i in items),
        "no images (import one: `boxd image import SOURCE NAME`)",
    )


def oci_image(i: models.Image) -> None:
    c = i.config
    details([
        ("name", i.name), ("digest", i.digest), ("platform", f"{i.os}/{i.architecture}"),
        ("size", size(i.size)), ("created", i.created),
        ("layers", "\n".join(f"{d.digest[:19]}  {size(d.size)}" for d in i.layers)),
        ("entrypoint", " ".join(c.entrypoint)), ("cmd", " ".join(c.cmd)),
        ("env", "\n".join(c.env)), ("workdir", c.working_dir), ("user", c.user),
        ("exposed", " ".join(c.exposed_ports)), ("healthcheck", " ".join(c.healthcheck)),
        ("labels", "\n".join(f"{k}={v}" for k, v in sorted(c.labels.items()))),
    ])


def snapshot(s: models.Snapshot) -> None:
    details(
        [
            ("name", f"{s.name}@{s.version}"),
            ("id", s.id),
            ("digest", s.digest),
            ("source machine", s.source_machine),
            ("memory", size(s.memory_bytes)),
            ("disk", size(s.disk_bytes)),
            ("stored", size(s.stored_bytes)),
            ("engine", s.engine),
            ("cpu model", s.cpu_model),
            ("image", s.image),
            ("created", ago(s.created_at)),
        ]
    )


def keys(items: Sequence[models.ApiKey]) -> None:
    table(
        ["ID", "NAME", "PREFIX", "CREATED", "REVOKED"],
        (
            [k.id, k.name, k.prefix, ago(k.created_at), ago(k.revoked_at) if k.revoked_at else "-"]
            for k in items
        ),
        "no keys",
    )


def accounts(items: Sequence[models.Account]) -> None:
    table(
        ["NAME", "ID", "MACHINES", "MAX", "CREATED"],
        ([a.name, a.id, str(a.machines), str(a.max_machines), ago(a.created_at)] for a in items),
        "no accounts",
    )


def nodes(items: Sequence[models.NodeInfo]) -> None:
    table(
        ["ID", "ADDRESS", "HEALTH", "MACHINES", "MAX", "FREE MEM", "ENGINE"],
        ([n.id, n.address, n.health + (f" ({n.error})" if n.error else ""), str(n.machines),
          str(n.max_machines), f"{n.memory_free_mib} MiB", n.engine or "-"] for n in items),
        "no nodes",
    )


def _queue(q: models.AdmissionQueue | None) -> str | None:
    """Your creates and forks waiting for room, and how long the first has waited."""
    if q is None:
        return None
    if not q.waiting:
        return f"none waiting (at most {q.per_account})"
    oldest = max(a.oldest_seconds for a in q.accounts)
    return f"{q.waiting} waiting for room, the first for {oldest:.0f} s"


def host(info: models.HostInfo) -> None:
    details(
        [
            ("version", info.version),
            ("engine", info.engine + (f" ({info.engine_reason})" if info.engine_reason else "")),
            ("accelerator", f"{info.accelerator} ({info.accelerator_reason})"),
            (info.engine, f"{info.qemu_version} ({info.qemu})"),
            ("cpu model", info.cpu_model),
            ("data dir", info.data_dir),
            ("image", info.image),
            ("limits", info.limits),
            ("standby forks", f"{info.standby_forks} ({size(info.standby_memory_bytes)} "
             "host memory)"),
            ("queue", _queue(info.queue)),
        ]
    )
    if info.engines:
        table(
            ["ENGINE", "STATUS", "ACCEL", "WHY"],
            ([e.name + (" *" if e.default else ""), e.status, e.accelerator or "-", e.reason]
             for e in info.engines),
            "no engines",
        )


# --- lineage -------------------------------------------------------------------------


def short_digest(digest: str) -> str:
    """``sha256:`` and the first 12 hex digits: enough to tell versions apart."""
    return "sha256:" + _lineage.digest_key(digest)[:12]


def _snap_label(s: models.Snapshot) -> str:
    return f"[cyan]{s.name}@{s.version}[/] [dim]{short_digest(s.digest)}[/]"


def _machine_label(m: models.Machine) -> str:
    return f"[bold]{m.name}[/] [dim]{m.id}[/] {_state(m.state)}"


def _node_label(node: _lineage.MachineNode, root: bool) -> str:
    label = _machine_label(node.machine)
    if node.from_snapshot is not None:
        label += f"  from snapshot {_snap_label(node.from_snapshot)}"
    elif root and node.machine.snapshot:  # its snapshot was deleted since
        label += f"  from snapshot [dim]{short_digest(node.machine.snapshot)} (deleted)[/]"
    return label


def _fill(branch: Tree, node: _lineage.MachineNode) -> None:
    for s in node.snapshots:
        branch.add(f"snapshot {_snap_label(s)}")
    for child in node.children:
        _fill(branch.add(_node_label(child, root=False)), child)


def machine_tree(lineage: _lineage.Lineage) -> None:
    """The fork trees: machine -> snapshots saved from it and machines forked from it."""
    if not lineage.machines:
        console().print("[dim]no machines[/]")
        return
    out = console()
    for root in lineage.machines:
        tree = Tree(_node_label(root, root=True), guide_style="dim")
        _fill(tree, root)
        out.print(tree)


def snapshot_tree(lineage: _lineage.Lineage) -> None:
    """Snapshot names -> versions (digest, source machine) -> machines started from each."""
    if not lineage.snapshots:
        console().print("[dim]no snapshots[/]")
        return
    out = console()
    names: dict[str, Tree] = {}
    for sn in lineage.snapshots:
        s = sn.snapshot
        tree = names.get(s.name)
        if tree is None:
            tree = names[s.name] = Tree(f"[cyan bold]{s.name}[/]", guide_style="dim")
        if sn.source is not None:
            source = f"saved from [bold]{sn.source.name}[/] [dim]{sn.source.id}[/]"
        elif s.source_machine:
            source = f"saved from {s.source_machine} [dim](gone)[/]"
        else:
            source = "imported"
        version = tree.add(f"[cyan]@{s.version}[/] [dim]{short_digest(s.digest)}[/]  {source}")
        for node in sn.machines:
            _fill(version.add(_machine_label(node.machine)), node)
    for tree in names.values():
        out.print(tree)
