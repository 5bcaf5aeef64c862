"""Fork benchmarks: latency, source downtime, idle child cost, and fork vs rebuild.

    python bench/bench_fork.py          # this module alone (bench/run.py runs them all)

Measures, on the daemon the environment points at (``BOXD_HOME``):

- fork latency, from the API call to the child being exec-ready (``fork`` +
  ``wait_until_ready``): one at a time from an unchanged source (its template is
  reused and a standby child is claimed), the same with standby children turned off
  (the daemon restarted with ``BOXD_FORK_SPARES=0``; machines outlive it), one at a
  time from a source changed since its last fork (a new template is captured), and 8
  at once (the spec's 8 threads);
- the first ``exec true`` in a fresh child;
- source downtime per fork, from the daemon's ``event=captured downtime=`` log lines;
- an idle child's host memory (PSS of its QEMU process, ``/proc/PID/smaps_rollup``) and
  disk (allocated bytes of its own qcow2 layer);
- the spec's 8 rollouts (fork, wait, ``python3 rollout.py --seed N``, delete; 8 threads),
  wall time;
- the *rebuild* baseline, done honestly: a fresh machine that boots, runs
  ``pip install gymnasium numpy`` through the guest network (as the spec does), runs
  ``warm_up.py`` and then its episode. Under TCG one rebuild takes minutes, so only
  ``BENCH_REBUILDS`` (default 2) are run, one after another; the warm source itself is
  built exactly this way and is the first sample. The cost of 8 rollouts by rebuilding is
  extrapolated from the per-rollout median, and the ratio is reported both against
  sequential rebuilds and against rebuilds spread perfectly over the host's cores.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Row, pss_bytes, qemu_pid, row_from, say, standalone, stop_local_daemon
from boxd import Boxd
from boxd.config import Paths

GROUP = "fork"
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "rl"
GUEST_HOME = "/home/boxd"
SOURCE = "bench-fork-src"
FORK_SINGLE_N = int(os.environ.get("BENCH_FORK_N", "10"))
FORK_FRESH_N = int(os.environ.get("BENCH_FORK_FRESH_N", "5"))
FORK_CONCURRENT_ROUNDS = int(os.environ.get("BENCH_FORK_ROUNDS", "2"))
ROLLOUT_ROUNDS = int(os.environ.get("BENCH_ROLLOUT_ROUNDS", "2"))
REBUILDS = int(os.environ.get("BENCH_REBUILDS", "2"))
IDLE_CHILDREN = 3
PIP_TIMEOUT = 1800.0

# Filled by run() for bench/run.py's chart.
CHART: dict[str, Any] = {}


def _ok(client: Boxd, ref: str, cmd: str, timeout: float | None = None) -> str:
    r = client.machines.exec(ref, cmd, timeout=timeout)
    if r.exit_code != 0:
        raise RuntimeError(f"{cmd!r} exited {r.exit_code}: {r.stderr.strip()[-400:]}")
    return r.stdout


def _timed(fn: Callable[[], Any]) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def child_layer(pid: int, disks: Path) -> Path | None:
    """The writable qcow2 layer on the QEMU command line of ``pid``."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    found = re.findall(re.escape(str(disks)) + r"/[\w.-]+\.qcow2", " ".join(args))
    return Path(found[-1]) if found else None


def downtimes_since(log: Path, offset: int) -> list[float]:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    return [float(x) for x in re.findall(r"event=captured downtime=([0-9.]+)", text)]


def rebuild_once(client: Boxd, name: str, keep: bool = False) -> dict[str, float]:
    """Fresh machine → pip install → warm_up → one episode. Returns each phase's time."""
    t: dict[str, float] = {}
    start = time.monotonic()
    m = client.machines.new(name)
    try:
        client.machines.wait_until_ready(m.id, timeout=900)
        t["boot"] = time.monotonic() - start
        t["install"] = _timed(lambda: _ok(client, m.id, "pip install gymnasium numpy",
                                          timeout=PIP_TIMEOUT))

        def warm() -> None:
            client.machines.files.upload(m.id, f"{GUEST_HOME}/warm_up.py",
                                         (EXAMPLES / "warm_up.py").read_text())
            _ok(client, m.id, "python3 warm_up.py", timeout=600)

        t["warm_up"] = _timed(warm)

        def episode() -> None:
            client.machines.files.upload(m.id, f"{GUEST_HOME}/rollout.py",
                                         (EXAMPLES / "rollout.py").read_text())
            _ok(client, m.id, f"python3 {GUEST_HOME}/rollout.py --seed 0")

        t["episode"] = _timed(episode)
        t["total"] = time.monotonic() - start
    except BaseException:
        client.machines.delete(m.id)
        raise
    if not keep:
        client.machines.delete(m.id)
    return t


@contextlib.contextmanager
def daemon_env(home: Path, **env: str) -> Iterator[None]:
    """Run the block against a daemon started with ``env`` set; restart it after."""
    old = {k: os.environ.get(k) for k in env}
    stop_local_daemon(home)
    os.environ.update(env)
    try:
        yield
    finally:
        stop_local_daemon(home)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fork_ready(client: Boxd, src: str, name: str) -> tuple[str, float]:
    t = time.monotonic()
    child = client.machines.fork(src, name)
    client.machines.wait_until_ready(child.id)
    return child.id, time.monotonic() - t


def run(client: Boxd | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    """Run every fork measurement; return the rows (also fills ``CHART``)."""
    say_ = log or say
    own = client is None
    boxd = client or Boxd()
    paths = Paths.default()
    accel = str(getattr(boxd.info(), "accelerator", None) or "?").upper()
    rows: list[Row] = []

    def row(name: str, values: list[float], unit: str = "s", note: str = "",
            baseline: str | None = None, baseline_values: list[float] | None = None) -> None:
        rows.append(row_from(GROUP, name, values, unit=unit, accel=accel, note=note,
                             baseline=baseline, baseline_values=baseline_values))

    try:
        # --- The warm source, built exactly like one rebuild (rebuild sample #1). -----
        say_(f"bench_fork: building the warm source {SOURCE} (boot, pip install, warm-up)")
        with _suppress():
            boxd.machines.delete(SOURCE)
        rebuilds = [rebuild_once(boxd, SOURCE, keep=True)]
        say_(f"bench_fork: source ready in {rebuilds[0]['total']:.1f}s {rebuilds[0]}")

        # --- Fork latency, one at a time. ------------------------------------------
        cid, _ = fork_ready(boxd, SOURCE, "bench-fork-first")  # makes the template
        boxd.machines.delete(cid)
        single: list[float] = []
        first_exec: list[float] = []
        for i in range(FORK_SINGLE_N):
            cid, dt = fork_ready(boxd, SOURCE, f"bench-fork-{i}")
            single.append(dt)
            first_exec.append(_timed(lambda cid=cid: _ok(boxd, cid, "true")))
            boxd.machines.delete(cid)
        row("fork → exec-ready, single (template reused)", single,
            baseline="cold boot → ready", baseline_values=[rebuilds[0]["boot"]],
            note="source unchanged since the last fork: its template is reused and a "
                 "standby child (spare) prepared after the previous fork is claimed")
        row("first `exec true` in a child", first_exec)
        say_(f"bench_fork: single fork p50 {statistics.median(single)*1000:.0f} ms")

        # --- The same without standby children: the daemon restarted with
        # BOXD_FORK_SPARES=0 (machines outlive a daemon), then restored.
        nospare: list[float] = []
        with daemon_env(paths.home, BOXD_FORK_SPARES="0"):
            cid, _ = fork_ready(boxd, SOURCE, "bench-fork-ns-warm")  # starts the daemon
            boxd.machines.delete(cid)
            for i in range(FORK_SINGLE_N):
                cid, dt = fork_ready(boxd, SOURCE, f"bench-fork-ns-{i}")
                nospare.append(dt)
                _ok(boxd, cid, "true")
                boxd.machines.delete(cid)
        row("fork → exec-ready, single (template reused, no spare)", nospare,
            baseline="fork → exec-ready, single (template reused)", baseline_values=single,
            note="BOXD_FORK_SPARES=0: overlay, QEMU start and state load on the fork's path")

        # --- Forks of a source that changed since the last fork: a fresh template each,
        # so each pauses the source; the daemon logs that pause as downtime.
        log_offset = paths.log.stat().st_size if paths.log.exists() else 0
        fresh: list[float] = []
        for i in range(FORK_FRESH_N):
            _ok(boxd, SOURCE, "true")  # any exec makes the source "changed"
            cid, dt = fork_ready(boxd, SOURCE, f"bench-fork-new-{i}")
            fresh.append(dt)
            boxd.machines.delete(cid)
        downtime = downtimes_since(paths.log, log_offset)
        row("fork → exec-ready, single (source changed: new template)", fresh,
            baseline="cold boot → ready", baseline_values=[rebuilds[0]["boot"]])
        if downtime:
            row("source downtime per fork", downtime,
                note="pause → resume of the source, from the daemon's event=captured log")

        # --- 8 concurrent forks. ---------------------------------------------------
        conc: list[float] = []
        conc_wall: list[float] = []
        for r in range(FORK_CONCURRENT_ROUNDS):
            t0 = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda i, r=r: fork_ready(boxd, SOURCE, f"bench-c{r}-{i}"),
                                    range(8)))
            conc_wall.append(time.monotonic() - t0)
            conc += [dt for _, dt in got]
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda g: boxd.machines.delete(g[0]), got))
        row("fork → exec-ready, 8 concurrent (per child)", conc)
        row("8 concurrent forks, all ready (wall)", conc_wall)
        say_(f"bench_fork: 8 concurrent p50 {statistics.median(conc)*1000:.0f} ms")

        # --- Idle child: host memory and disk. -------------------------------------
        kids = [fork_ready(boxd, SOURCE, f"bench-idle-{i}")[0] for i in range(IDLE_CHILDREN)]
        time.sleep(5)  # let the children settle into idle
        pss: list[float] = []
        disk: list[float] = []
        for cid in kids:
            pid = qemu_pid(cid)
            if pid is None:
                continue
            pss.append(float(pss_bytes(pid)))
            layer = child_layer(pid, paths.disks)
            if layer is not None and layer.exists():
                disk.append(float(layer.stat().st_blocks * 512))
        src_pid = qemu_pid(boxd.machines.get(SOURCE).id)
        src_pss = pss_bytes(src_pid) if src_pid else None
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(boxd.machines.delete, kids))
        if pss:
            row("idle child host memory (PSS)", pss, unit="B",
                note=f"{IDLE_CHILDREN} idle children + source alive",
                baseline="source (warm, booted)" if src_pss else None,
                baseline_values=[float(src_pss)] if src_pss else None)
        if disk:
            row("idle child disk (allocated qcow2 layer)", disk, unit="B",
                note="st_blocks of the child's own overlay; its backing layers are shared")

        # --- The spec's 8 rollouts with forks. -------------------------------------
        boxd.machines.files.upload(SOURCE, f"{GUEST_HOME}/rollout.py",
                                   (EXAMPLES / "rollout.py").read_text())

        def rollout(name: str, seed: int) -> str:
            fork = boxd.machines.fork(SOURCE, name)
            boxd.machines.wait_until_ready(fork.id)
            result = boxd.machines.exec(fork.id, f"python3 {GUEST_HOME}/rollout.py --seed {seed}")
            boxd.machines.delete(fork.id)
            if result.exit_code != 0:
                raise RuntimeError(f"rollout exited {result.exit_code}: {result.stderr[-300:]}")
            return result.stdout.strip()

        walls: list[float] = []
        per_rollout_seq: list[float] = []
        for r in range(ROLLOUT_ROUNDS):
            t0 = time.monotonic()
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(lambda s, r=r: rollout(f"bench-r{r}-{s}", s), range(8)))
            walls.append(time.monotonic() - t0)
        for s in range(3):
            per_rollout_seq.append(_timed(lambda s=s: rollout(f"bench-seq-{s}", s)))
        row("8 rollouts with forks, 8 threads (wall)", walls)
        row("1 rollout with a fork (fork, exec, delete)", per_rollout_seq)
        say_(f"bench_fork: 8 rollouts with forks {statistics.median(walls):.2f}s")

        # --- Rebuild baseline. ------------------------------------------------------
        boxd.machines.delete(SOURCE)
        for i in range(1, REBUILDS):
            say_(f"bench_fork: rebuild {i + 1}/{REBUILDS} (fresh machine, pip install, "
                "warm-up, episode)")
            rebuilds.append(rebuild_once(boxd, f"bench-rebuild-{i}"))
        for phase in ("boot", "install", "warm_up", "episode"):
            row(f"rebuild phase: {phase}", [rb[phase] for rb in rebuilds])
        totals = [rb["total"] for rb in rebuilds]
        n = len(rebuilds)
        row("1 rollout by rebuilding", totals, note=f"measured, {n} rebuild(s)",
            baseline="1 rollout with a fork", baseline_values=per_rollout_seq)
        row("8 rollouts by rebuilding, sequential", [8 * t for t in totals],
            note=f"extrapolated: 8 x each of {n} measured rebuilds",
            baseline="8 rollouts with forks", baseline_values=walls)
        cores = min(os.cpu_count() or 1, 8)
        row(f"8 rollouts by rebuilding, spread over {cores} cores", [8 * t / cores for t in totals],
            note="extrapolated, optimistic for rebuild (perfect parallelism)",
            baseline="8 rollouts with forks", baseline_values=walls)
        CHART.update(single=single, concurrent=conc, rollout_fork=per_rollout_seq,
                     rollouts8_fork=walls, rebuild=[rb["total"] for rb in rebuilds],
                     rebuild_phases=rebuilds, accel=accel)
        return rows
    finally:
        _cleanup(boxd)
        if own:
            boxd.close()


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, *a: object) -> bool:
        return et is not None and issubclass(et, Exception)


def _cleanup(boxd: Boxd) -> None:
    try:
        mine = [m.id for m in boxd.machines.list() if m.name.startswith("bench-")
                and (m.name.startswith("bench-fork") or m.name.startswith("bench-c")
                     or m.name.startswith("bench-idle") or m.name.startswith("bench-r")
                     or m.name.startswith("bench-seq"))]
    except Exception:
        return
    for mid in mine:
        with _suppress():
            boxd.machines.delete(mid)


if __name__ == "__main__":
    standalone(run)
