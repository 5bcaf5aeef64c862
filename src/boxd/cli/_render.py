"""Rendering for the CLI: rich tables for people, JSON for scripts."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from boxd import models


def console(stderr: bool = False) -> Console:
    # Built per call so that it writes to the current sys.stdout (CliRunner swaps it).
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


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


_STATE_STYLE = {"running": "green", "starting": "yellow", "failed": "red", "deleting": "dim"}


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
        ["NAME", "ID", "STATE", "CPUS", "MEMORY", "DISK", "PORT", "PARENT", "CREATED"],
        (
            [
                m.name,
                m.id,
                _state(m.state),
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


def machine(m: models.Machine) -> None:
    details(
        [
            ("name", m.name),
            ("id", m.id),
            ("state", _state(m.state)),
            ("vcpus", m.vcpus),
            ("memory", f"{m.memory_mib} MiB"),
            ("disk", f"{m.disk_gib} GiB"),
            ("isolated", "yes" if m.isolated else "no"),
            ("port", m.port),
            ("url", m.url),
            ("parent", m.parent_id),
            ("snapshot", m.snapshot),
            ("accelerator", m.accelerator),
            ("error", m.error),
            ("created", ago(m.created_at)),
        ]
    )


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


def host(info: models.HostInfo) -> None:
    details(
        [
            ("version", info.version),
            ("engine", info.engine),
            ("accelerator", f"{info.accelerator} ({info.accelerator_reason})"),
            ("qemu", f"{info.qemu_version} ({info.qemu})"),
            ("cpu model", info.cpu_model),
            ("data dir", info.data_dir),
            ("image", info.image),
        ]
    )
