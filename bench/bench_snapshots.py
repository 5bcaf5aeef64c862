"""Checkpoint and snapshot benchmarks (issue 5).

    python bench/bench_snapshots.py     # this module alone (bench/run.py runs them all)

Measures, on the daemon the environment points at:

- checkpoint save and restore latency (API call to done; restore includes the machine
  answering again), on a machine with ``WORKSET_MIB`` of guest memory in use;
- snapshot save time, and its stored size against the guest's memory and disk use
  (``free`` / ``df`` inside the guest at save time);
- new machine from a snapshot → exec-ready, against a cold boot of the same image
  measured in the same run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Row, row_from, say, standalone
from boxd import Boxd

GROUP = "snapshots"
N_CHECKPOINT = 5
N_SNAPSHOT_START = 3
WORKSET_MIB = 64
READY_TIMEOUT = 600.0


def _guest_usage(boxd: Boxd, machine: str) -> tuple[float, float]:
    """(memory in use, disk in use) inside the guest, in bytes."""
    out = boxd.machines.exec(
        machine, "free -b | awk '/^Mem:/ {print $3}'; df -B1 / | awk 'NR==2 {print $3}'"
    ).stdout.split()
    return float(out[0]), float(out[1])


def run(client: Boxd | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    """Measure checkpoint save/restore, snapshot save/size and start-from-snapshot."""
    tell = log or say
    own = client is None
    boxd = client or Boxd()
    stamp = f"{int(time.time()) % 100000}"
    made: list[str] = []
    snaps: list[str] = []
    try:
        accel = boxd.info().accelerator
        tell("bench_snapshots: cold boot of the source")
        t = time.perf_counter()
        src = boxd.machines.new(f"bench-snap-{stamp}")
        made.append(src.id)
        boxd.machines.wait_until_ready(src.id, timeout=READY_TIMEOUT)
        boot = [time.perf_counter() - t]
        # a working set in guest memory (tmpfs) and on disk, so captures are not trivial
        boxd.machines.exec(
            src.id,
            f"head -c {WORKSET_MIB << 20} /dev/urandom > /dev/shm/workset;"
            f" head -c {WORKSET_MIB << 20} /dev/urandom > /root/disk-workset; sync",
        )
        saves: list[float] = []
        restores: list[float] = []
        for i in range(N_CHECKPOINT):
            tell(f"bench_snapshots: checkpoint {i + 1}/{N_CHECKPOINT}")
            t = time.perf_counter()
            boxd.machines.checkpoints.save(src.id, f"c{i}")
            saves.append(time.perf_counter() - t)
            boxd.machines.exec(src.id, f"echo {i} > /root/after")
            t = time.perf_counter()
            boxd.machines.checkpoints.restore(src.id, f"c{i}")
            boxd.machines.exec(src.id, "true")
            restores.append(time.perf_counter() - t)
        for i in range(N_CHECKPOINT):
            boxd.machines.checkpoints.delete(src.id, f"c{i}")

        mem_used, disk_used = _guest_usage(boxd, src.id)
        tell("bench_snapshots: snapshot save")
        name = f"bench-snap-{stamp}"
        t = time.perf_counter()
        snap = boxd.snapshots.save(src.id, name)
        snap_save = [time.perf_counter() - t]
        snaps.append(snap.digest)

        starts: list[float] = []
        for i in range(N_SNAPSHOT_START):
            tell(f"bench_snapshots: new machine from snapshot {i + 1}/{N_SNAPSHOT_START}")
            t = time.perf_counter()
            m = boxd.machines.new(f"bench-from-snap-{stamp}-{i}", from_snapshot=snap.digest)
            made.append(m.id)
            boxd.machines.wait_until_ready(m.id, timeout=READY_TIMEOUT)
            boxd.machines.exec(m.id, "true")
            starts.append(time.perf_counter() - t)
    finally:
        for mid in made:
            try:
                boxd.machines.delete(mid)
            except Exception as exc:  # clean-up must go on
                tell(f"bench_snapshots: delete {mid}: {exc}")
        for digest in snaps:
            try:
                boxd.snapshots.delete(digest)
            except Exception as exc:
                tell(f"bench_snapshots: delete snapshot: {exc}")
        if own:
            boxd.close()

    note = f"{WORKSET_MIB} MiB random data in /dev/shm and on disk"
    return [
        row_from(GROUP, "checkpoint save", saves, accel=accel, note=note),
        row_from(GROUP, "checkpoint restore → exec-ready", restores, accel=accel, note=note),
        row_from(GROUP, "snapshot save (capture, flatten disk, hash, store)", snap_save,
                 accel=accel, note=note),
        row_from(GROUP, "snapshot stored size", [float(snap.stored_bytes)], unit="B",
                 accel=accel, baseline="guest memory + disk in use",
                 baseline_values=[mem_used + disk_used],
                 note=f"guest memory in use {mem_used / 2**20:.0f} MiB, "
                 f"disk in use {disk_used / 2**20:.0f} MiB"),
        row_from(GROUP, "snapshot memory image (logical size)", [float(snap.memory_bytes)],
                 unit="B", accel=accel, note="sparse on disk: only pages in use are stored"),
        row_from(GROUP, "new machine from snapshot → exec-ready", starts, accel=accel,
                 baseline="cold boot → ready", baseline_values=boot),
    ]


if __name__ == "__main__":
    standalone(run)
