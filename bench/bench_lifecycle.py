"""Suspend, hibernate and wake: what idle machines cost and how fast they come back.

Measures, on the daemon the environment points at (``BOXD_HOME``):

- wake from suspend, server side: the daemon's ``event=woke`` log (vCPU resume, and the
  guest clock step that follows) per wake;
- ``exec true`` on a suspended machine (wake included) against one on a running
  machine (the baseline, same machine, same run);
- hibernate (memory + device state to disk, VM process ends), and hibernated →
  exec-ready (restore from disk + ``exec true``) against a cold boot → ready;
- a hibernated machine's disk use (its image) and host memory (no VM process: 0);
- 20 idle machines: host CPU of their QEMU processes per second while running
  against while suspended.

Every machine it makes has its idle timers off (``suspend_after=0``), so only the
measured operations change their state.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from _common import Row, qemu_pid, row_from, say, standalone
from boxd import Boxd
from boxd.config import Paths

GROUP = "lifecycle"
WAKE_N = int(os.environ.get("BENCH_WAKE_N", "20"))
HIBERNATE_N = int(os.environ.get("BENCH_HIBERNATE_N", "3"))
IDLE_MACHINES = int(os.environ.get("BENCH_IDLE_MACHINES", "20"))
IDLE_WINDOW = float(os.environ.get("BENCH_IDLE_WINDOW", "5"))
READY_TIMEOUT = 600.0


def _ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


def _cpu_share(pids: list[int], window: float) -> float:
    """Fraction of one core the processes used over ``window`` seconds."""
    hz = os.sysconf("SC_CLK_TCK")
    before, t0 = _ticks(pids), time.monotonic()
    time.sleep(window)
    return (_ticks(pids) - before) / hz / (time.monotonic() - t0)


def _woke(log: Path, since: int) -> list[tuple[float, float]]:
    """(resume_ms, clock_ms) of every ``event=woke from=suspended`` after byte ``since``."""
    out = []
    with open(log, "rb") as f:
        f.seek(since)
        for line in f:
            try:
                msg = str(json.loads(line).get("msg", ""))
            except ValueError:
                continue
            if "event=woke from=suspended" in msg:
                parts = dict(p.split("=", 1) for p in msg.split() if "=" in p)
                out.append((float(parts["resume_ms"]), float(parts["clock_ms"])))
    return out


def _du(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def run(client: Boxd | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    tell = log or say
    own = client is None
    boxd = client or Boxd()
    paths = Paths.default()
    rows: list[Row] = []
    made: list[str] = []
    stamp = f"{os.getpid() % 10000}-{int(time.time()) % 100000}"
    try:
        accel = str(boxd.info().accelerator).upper()

        def row(name: str, values: list[float], **kw: object) -> None:
            rows.append(row_from(GROUP, name, values, accel=accel, **kw))  # type: ignore[arg-type]

        tell("bench_lifecycle: cold boot of the machine under test")
        t = time.perf_counter()
        m = boxd.machines.new(f"bench-lc-{stamp}", suspend_after=0, hibernate_after=0)
        made.append(m.id)
        boxd.machines.wait_until_ready(m.id, timeout=READY_TIMEOUT)
        boot = [time.perf_counter() - t]
        for _ in range(3):
            boxd.machines.exec(m.id, "true")

        tell(f"bench_lifecycle: exec on a running machine x{WAKE_N}")
        running: list[float] = []
        for _ in range(WAKE_N):
            t = time.perf_counter()
            boxd.machines.exec(m.id, "true")
            running.append(time.perf_counter() - t)

        tell(f"bench_lifecycle: suspend, then exec (wakes) x{WAKE_N}")
        since = paths.log.stat().st_size
        suspended: list[float] = []
        for _ in range(WAKE_N):
            boxd.machines.suspend(m.id)
            t = time.perf_counter()
            boxd.machines.exec(m.id, "true")
            suspended.append(time.perf_counter() - t)
        time.sleep(0.5)  # the log line is written after the reply
        woke = _woke(paths.log, since)
        row("wake from suspend, server side: vCPU resume", [r / 1e3 for r, _ in woke],
            note="QMP cont + the state's compare-and-set, from the daemon's event=woke log")
        row("wake from suspend, server side: resume + guest clock step",
            [(r + c) / 1e3 for r, c in woke],
            note="the clock step is one agent round trip, before the request proceeds")
        row("exec true on a running machine", running)
        row("exec true on a suspended machine (wakes it)", suspended,
            baseline="exec true on a running machine", baseline_values=running)

        tell(f"bench_lifecycle: hibernate, then exec (restores) x{HIBERNATE_N}")
        hib: list[float] = []
        wake: list[float] = []
        image: list[float] = []
        for _ in range(HIBERNATE_N):
            t = time.perf_counter()
            boxd.machines.hibernate(m.id)
            hib.append(time.perf_counter() - t)
            assert qemu_pid(m.id) is None, "a hibernated machine kept its QEMU process"
            image.append(float(_du(paths.hibernated / m.id)))
            t = time.perf_counter()
            boxd.machines.exec(m.id, "true")
            wake.append(time.perf_counter() - t)
        row("hibernate (memory + device state to disk, VM ends)", hib)
        row("hibernated → exec-ready (restore from disk + exec true)", wake,
            baseline="cold boot → ready", baseline_values=boot,
            note="target ≤ 1 s on these TCG hosts")
        row("hibernated machine: disk use of its image", image, unit="B",
            note="sparse RAM copy + device state; its host memory is 0 (no VM process)")
        row("cold boot → ready", boot)

        tell(f"bench_lifecycle: {IDLE_MACHINES} idle machines, running vs suspended")
        kids = boxd.machines.fork(m.id, count=IDLE_MACHINES)
        ids = [k.id for k in kids if not isinstance(k, Exception)]
        made.extend(ids)
        for cid in ids:
            boxd.machines.wait_until_ready(cid, timeout=READY_TIMEOUT)
        time.sleep(2)
        pids = [p for p in (qemu_pid(c) for c in ids) if p is not None]
        awake = [_cpu_share(pids, IDLE_WINDOW) for _ in range(3)]
        for cid in ids:
            boxd.machines.suspend(cid)
        asleep = [_cpu_share(pids, IDLE_WINDOW) for _ in range(3)]
        row(f"{len(pids)} idle machines running: host CPU (cores)", awake, unit="x",
            note=f"utime+stime of their QEMU processes over {IDLE_WINDOW:.0f} s windows")
        row(f"{len(pids)} idle machines suspended: host CPU (cores)", asleep, unit="x",
            baseline=f"{len(pids)} idle machines running: host CPU (cores)",
            baseline_values=awake)
    finally:
        for ref in reversed(made):
            try:
                boxd.machines.delete(ref)
            except Exception as exc:  # a benchmark cleans up what it can
                tell(f"bench_lifecycle: could not delete {ref}: {exc}")
        if own:
            boxd.close()
    return rows


if __name__ == "__main__":
    standalone(run, "lifecycle")
