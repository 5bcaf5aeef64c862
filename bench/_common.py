"""Shared helpers for boxd's benchmarks: one ``Row`` type, stats, and table output.

Convention (every ``bench/bench_*.py`` follows it, ``bench/run.py`` relies on it):

- A module exposes ``run(client: Boxd | None = None, log=None) -> list[Row]``. It
  measures against the daemon the environment points at (``BOXD_HOME``/``BOXD_URL``,
  or the embedded local daemon when ``client`` is None), creates only machines it
  deletes again, and reports progress through ``log(str)`` (stderr by default).
- Each figure is one `Row`: a median and, with more than one sample, a p90; the
  accelerator it ran under; and, when a baseline was measured *in the same run*, the
  baseline's name and median and the ratio ``median / baseline``.
- Run standalone, a module calls ``standalone(run)``, which prints the table with the
  host description and date (what ``docs/benchmarks.md`` records).

Units: ``"s"`` (shown as ms/µs when small), ``"B"`` (shown as MiB), ``"x"`` (a ratio),
or any other string, printed as is.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Row",
    "Table",
    "describe_host",
    "fmt_value",
    "measure",
    "median",
    "p90",
    "pss_bytes",
    "qemu_pid",
    "quantile",
    "ratio",
    "row_from",
    "say",
    "standalone",
]


# ---------------------------------------------------------------------------- stats


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("no samples")
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def p90(values: Sequence[float]) -> float:
    return quantile(values, 0.9)


def ratio(value: float | None, baseline: float | None) -> float | None:
    """``value / baseline``, or None when either is missing or the baseline is 0."""
    if value is None or baseline is None or baseline == 0:
        return None
    return value / baseline


def measure(fn: Callable[[], Any], n: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``n`` calls of ``fn`` (after ``warmup`` unmeasured calls)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


# ------------------------------------------------------------------------------ rows


@dataclass
class Row:
    """One measured figure (field order kept compatible with keyword construction)."""

    group: str
    name: str
    median: float | None
    p90: float | None = None
    unit: str = "s"
    n: int = 1
    accel: str = "?"
    note: str = ""
    baseline: str | None = None  # what the ratio compares against (same run)
    baseline_median: float | None = None
    ratio: float | None = None
    samples: list[float] = field(default_factory=list, repr=False)


def row_from(
    group: str, name: str, values: Sequence[float], *, unit: str = "s", accel: str = "?",
    note: str = "", baseline: str | None = None, baseline_values: Sequence[float] | None = None,
) -> Row:
    """A `Row` with median, p90 (n > 1) and the ratio against a baseline's median."""
    med = median(values)
    base = median(baseline_values) if baseline_values else None
    return Row(
        group=group, name=name, median=med, p90=p90(values) if len(values) > 1 else None,
        unit=unit, n=len(values), accel=accel, note=note, baseline=baseline,
        baseline_median=base, ratio=ratio(med, base), samples=list(values),
    )


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        if value >= 1:
            return f"{value:.2f} s"
        if value >= 1e-3:
            return f"{value * 1e3:.2f} ms"
        return f"{value * 1e6:.0f} µs"
    if unit == "B":
        return f"{value / 2**20:.1f} MiB"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:g} {unit}".strip()


@dataclass
class Table:
    """Rows rendered as aligned text (terminal) or Markdown (docs/benchmarks.md)."""

    rows: list[Row]
    title: str = ""

    HEADERS = ("group", "figure", "accel", "n", "median", "p90", "baseline (median)", "ratio",
               "note")

    def _cells(self) -> list[tuple[str, ...]]:
        out = []
        for r in self.rows:
            base = (f"{r.baseline} ({fmt_value(r.baseline_median, r.unit)})"
                    if r.baseline else "-")
            rat = "-" if r.ratio is None else (
                f"{r.ratio:.1f}x" if r.ratio >= 10 else f"{r.ratio:.2f}x")
            out.append((r.group, r.name, r.accel.upper(), str(r.n),
                        fmt_value(r.median, r.unit), fmt_value(r.p90, r.unit), base, rat,
                        r.note))
        return out

    def text(self) -> str:
        cells = [self.HEADERS, *self._cells()]
        widths = [max(len(c[i]) for c in cells) for i in range(len(self.HEADERS))]
        lines = [self.title] if self.title else []
        for j, c in enumerate(cells):
            lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def markdown(self) -> str:
        head = "| " + " | ".join(self.HEADERS) + " |"
        sep = "|" + "|".join("---" for _ in self.HEADERS) + "|"
        body = ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
                for cells in self._cells()]
        lines = [f"**{self.title}**", ""] if self.title else []
        return "\n".join([*lines, head, sep, *body])


# ------------------------------------------------------------------------------ host


def describe_host() -> str:
    """One line: CPU model, cores, memory, kernel, QEMU version, and the date (UTC)."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True,
                              text=True, timeout=10).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        qemu = "QEMU ?"
    date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f"{cpu}, {os.cpu_count()} cores, {mem} RAM, Linux {platform.release()}, "
            f"{qemu}; {date}")


def vm_id(machine_id: str) -> str:
    """The engine's id of a machine's VM process (a claimed standby child keeps its own),
    read from the local daemon's state (``BOXD_HOME``)."""
    import sqlite3

    from boxd.config import Paths

    with sqlite3.connect(f"file:{Paths.default().db}?mode=ro", uri=True) as db:
        row = db.execute("SELECT vm_id FROM machines WHERE id=?", (machine_id,)).fetchone()
    return str(row[0]) if row and row[0] else machine_id


def qemu_pid(machine_id: str) -> int | None:
    """The pid of a machine's QEMU process (its ``-name boxd-<vm id>,...``), if running."""
    out = subprocess.run(["pgrep", "-f", f"boxd-{vm_id(machine_id)},"], capture_output=True,
                         text=True).stdout.split()
    return int(out[0]) if out else None


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process (``/proc/PID/smaps_rollup``), in bytes."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def stop_local_daemon(home: Path, timeout: float = 30.0) -> None:
    """SIGTERM the local daemon of ``home`` (by the pid its health reports); wait for it.

    Machines outlive it; the SDK starts a new daemon (with this process's environment)
    on its next request.
    """
    import contextlib
    import signal

    import httpx

    sock = home / "boxd.sock"
    if not sock.exists():
        return
    pid = None
    with contextlib.suppress(Exception), httpx.Client(
        transport=httpx.HTTPTransport(uds=str(sock)), timeout=5
    ) as c:
        pid = int(c.get("http://boxd/v1/health").json()["pid"])
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def standalone(run: Callable[..., Iterable[Row]], title: str = "") -> None:
    """Entry point of ``python bench/bench_x.py``: run, then print the table."""
    rows = list(run())
    print(Table(rows, title or describe_host()).text())
