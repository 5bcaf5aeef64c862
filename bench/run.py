"""Run every benchmark in bench/ and write docs/benchmarks.md and docs/benchmarks-fork.png.

    python bench/run.py                  # all bench/bench_*.py modules that define run()
    python bench/run.py fork runtime     # only bench_fork.py and bench_runtime.py

Each module's ``run()`` returns rows (``bench/_common.py``'s ``Row``, a dataclass, or a
dict) with at least a name and a median; rows may carry p90, unit, n, accelerator and a
note. Everything is measured in this one run, on a fresh data directory (a temporary
``BOXD_HOME`` unless ``BOXD_HOME`` is set), so every ratio compares figures taken
minutes apart on the same host. The report is generated, never edited by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DOCS = REPO / "docs"
RAW = REPO / ".cache" / "benchmarks.json"  # every row with its samples, for --report-only
sys.path.insert(0, str(BENCH))

from _common import Row, Table, describe_host, fmt_value, stop_local_daemon  # noqa: E402


def host_info() -> dict[str, str]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError, IndexError, ValueError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.1f} GiB"
    info = {"uname": " ".join(platform.uname()), "cpu": cpu, "cores": str(os.cpu_count()),
            "memory": mem, "python": platform.python_version(), "describe": describe_host()}
    with contextlib.suppress(Exception):
        from boxd import Boxd

        with Boxd() as b:
            h = b.info()
        info["accelerator"] = str(h.accelerator).upper()
        info["accelerator_reason"] = getattr(h, "accelerator_reason", "")
        for key in ("qemu_version", "engine"):
            if getattr(h, key, None):
                info[key] = str(getattr(h, key))
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["load"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return info


def discover(only: list[str]) -> list[str]:
    names = sorted(p.stem for p in BENCH.glob("bench_*.py"))
    if only:
        names = [n for n in names if n.removeprefix("bench_") in only or n in only]
    return names


CHART_SERIES = [  # (label, bench_fork row name, multiplier, kind)
    ("fork → ready\n(single)", "fork → exec-ready, single (template reused)", "fork"),
    ("fork → ready\n(no spare)", "fork → exec-ready, single (template reused, no spare)",
     "fork"),
    ("fork → ready\n(new template)",
     "fork → exec-ready, single (source changed: new template)", "fork"),
    ("fork → ready\n(8 concurrent)", "fork → exec-ready, 8 concurrent (per child)", "fork"),
    ("1 rollout\nwith a fork", "1 rollout with a fork (fork, exec, delete)", "fork"),
    ("8 rollouts\nwith forks", "8 rollouts with forks, 8 threads (wall)", "fork"),
    ("1 rollout by\nrebuilding", "1 rollout by rebuilding", "rebuild"),
    ("8 rollouts by\nrebuilding*", "8 rollouts by rebuilding, sequential", "rebuild"),
]


def chart(rows: list[Row], path: Path, accel: str) -> bool:
    """Bar chart (log scale) of fork figures against the rebuild baseline, from the
    samples of ``bench_fork``'s rows."""
    by_name = {r.name: r for r in rows}
    series = [(label, by_name[name], kind) for label, name, kind in CHART_SERIES
              if name in by_name and by_name[name].median is not None]
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    med = [float(r.median) for _, r, _ in series]  # type: ignore[arg-type]
    hi = [max(0.0, (r.p90 if r.p90 is not None else m) - m)
          for (_, r, _), m in zip(series, med, strict=True)]
    colors = ["#2b7bba" if kind == "fork" else "#c0392b" for *_, kind in series]
    bars = ax.bar([s[0] for s in series], med, yerr=[[0] * len(med), hi], color=colors,
                  capsize=4)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (median; whisker to p90; log scale)")
    ax.set_title(f"boxd: fork vs rebuild, accelerator {accel} "
                 f"({dt.datetime.now(dt.UTC).date().isoformat()})")
    for bar, m in zip(bars, med, strict=True):
        ax.annotate(f"{m * 1000:.0f} ms" if m < 1 else f"{m:.1f} s",
                    (bar.get_x() + bar.get_width() / 2, m), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.text(0.99, 0.02, "* 8 x each measured per-rollout rebuild (sequential)",
            transform=ax.transAxes, ha="right", fontsize=7)
    plt.xticks(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def save(path: Path, host: dict[str, str], started: dt.datetime,
         results: list[tuple[str, list[Row], float, str | None]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(
        {"host": host, "started": started.isoformat(),
         "results": [(n, [dataclasses.asdict(x) for x in r], t, e) for n, r, t, e in results]},
        indent=1, default=str))


def load(path: Path) -> tuple[dict[str, str], dt.datetime,
                              list[tuple[str, list[Row], float, str | None]]]:
    data = json.loads(path.read_text())
    results = [(n, [Row(**x) for x in r], t, e) for n, r, t, e in data["results"]]
    return data["host"], dt.datetime.fromisoformat(data["started"]), results


TARGETS = [  # (bench_fork row, what is compared, limit, "max"/"min", unit) from issue 4
    ("fork → exec-ready, single (template reused)", "median", 0.150, "max", "s"),
    # shown for honesty: the same fork without a standby child ready
    ("fork → exec-ready, single (template reused, no spare)", "median", 0.150, "max", "s"),
    ("idle child host memory (PSS)", "median", 40 * 2**20, "max", "B"),
    ("idle child disk (allocated qcow2 layer)", "median", 2**20, "max", "B"),
    ("8 rollouts by rebuilding, sequential", "ratio", 30.0, "min", "x"),
    ("8 rollouts by rebuilding, spread over", "ratio", 30.0, "min", "x"),  # N cores
]


def targets(results: list[tuple[str, list[Row], float, str | None]]) -> list[str]:
    by_name = {r.name: r for n, rows, *_ in results if n == "bench_fork" for r in rows}
    lines = ["## Targets (issue 4, these TCG hosts)", "",
             "| figure | target | measured | met |", "|---|---:|---:|---|"]
    for name, attr, limit, kind, unit in TARGETS:
        row = by_name.get(name) or next(
            (r for n, r in by_name.items() if n.startswith(name)), None)
        name = row.name if row else name
        value = getattr(row, attr, None) if row else None
        if value is None:
            continue
        ok = value <= limit if kind == "max" else value >= limit
        sign = "≤" if kind == "max" else "≥"
        lines.append(f"| {name} ({attr}) | {sign} {fmt_value(limit, unit)} | "
                     f"{fmt_value(value, unit)} | {'yes' if ok else '**no**'} |")
    return [*lines, ""] if len(lines) > 4 else []


def markdown(host: dict[str, str], results: list[tuple[str, list[Row], float, str | None]],
             has_chart: bool) -> str:
    accel = host.get("accelerator", "?")
    out = [
        "# Benchmarks",
        "",
        "Generated by `python bench/run.py`; do not edit by hand. Every figure was measured "
        "in the same run, on a fresh data directory, and every ratio compares two figures "
        "of this run (`ratio = median / baseline median`). The accelerator column says "
        "what each figure ran under.",
        "",
        f"- host: {host['describe']}",
        f"- uname: `{host['uname']}`",
        f"- accelerator: **{accel}**" + (f" ({host['accelerator_reason']})"
                                          if host.get("accelerator_reason") else ""),
    ]
    if host.get("load"):
        out.append(f"- load average at start: {host['load']} (other engineers' VMs share "
                   "this host, so figures are noisy)")
    out.append("")
    out += targets(results)
    for name, rows, took, error in results:
        out += [f"## {name.removeprefix('bench_')}", ""]
        if error:
            out += [f"**Failed** after {took:.0f} s: `{error}`", ""]
        if rows:
            out += [Table(rows).markdown(), ""]
        out += [f"(`{name}` took {took:.0f} s.)", ""]
        doc = ""
        with contextlib.suppress(Exception):
            doc = (importlib.import_module(name).__doc__ or "").strip()
        if doc:
            out += ["<details><summary>what is measured</summary>", "", doc, "", "</details>",
                    ""]
        if name == "bench_fork" and has_chart:
            out += ["![fork latency against the rebuild baseline](benchmarks-fork.png)", ""]
    return "\n".join(out) + "\n"


def write_report(host: dict[str, str], results: list[tuple[str, list[Row], float, str | None]],
                 con: Any) -> None:
    png = DOCS / "benchmarks-fork.png"
    fork_rows = [r for n, rows, *_ in results if n == "bench_fork" for r in rows]
    has_chart = False
    try:
        has_chart = chart(fork_rows, png, host.get("accelerator", "?"))
    except Exception as exc:  # the table is still worth writing
        con.print(f"[yellow]chart not written: {type(exc).__name__}: {exc}[/]")
    DOCS.mkdir(exist_ok=True)
    (DOCS / "benchmarks.md").write_text(markdown(host, results, has_chart))
    con.print(f"wrote {DOCS / 'benchmarks.md'}" + (f" and {png}" if has_chart else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run boxd's benchmarks.")
    parser.add_argument("only", nargs="*", help="module names (fork, runtime, ...)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--report-only", action="store_true",
                        help=f"rewrite the report from the last run's {RAW.name}, measuring "
                        "nothing")
    args = parser.parse_args(argv)

    from rich.console import Console

    con = Console(stderr=True)
    if args.report_only:
        host, _started, results = load(RAW)
        write_report(host, results, con)
        return 0

    own_home = "BOXD_HOME" not in os.environ
    if own_home:
        os.environ["BOXD_HOME"] = tempfile.mkdtemp(prefix="boxd-bench-")
    cache = REPO / ".cache" / "images"
    if "BOXD_IMAGE_CACHE" not in os.environ and cache.exists():
        os.environ["BOXD_IMAGE_CACHE"] = str(cache)
    home = Path(os.environ["BOXD_HOME"])

    started = dt.datetime.now(dt.UTC)
    results: list[tuple[str, list[Row], float, str | None]] = []
    try:
        with con.status("host info (starts the daemon; first probe of the accelerator)"):
            host = host_info()
        con.print(f"host: {host['cpu']} x{host['cores']}, accelerator "
                  f"{host.get('accelerator', '?')}, BOXD_HOME={home}")
        for name in discover(args.only):
            con.rule(name)
            t0 = time.monotonic()
            try:
                mod = importlib.import_module(name)
                if not callable(getattr(mod, "run", None)):
                    continue
                rows = list(mod.run())
                error = None
            except Exception as exc:
                traceback.print_exc()
                rows, error = [], f"{type(exc).__name__}: {exc}"
            results.append((name, rows, time.monotonic() - t0, error))
            if not args.no_write:
                save(RAW, host, started, results)  # a later failure loses nothing
    finally:
        if own_home:
            stop_local_daemon(home)

    for name, rows, took, error in results:
        title = f"{name} ({took:.0f} s)" + (f" FAILED: {error}" if error else "")
        print(Table(rows, title).text() + "\n")
    if not args.no_write:
        write_report(host, results, con)
    return 1 if any(e for *_, e in results) else 0


if __name__ == "__main__":
    sys.exit(main())
