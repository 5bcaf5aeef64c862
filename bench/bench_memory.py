"""Daemon memory during big transfers: RSS growth while a client downloads a 1 GiB file
and while a command prints 200 MB (buffered exec: cut at BOXD_MAX_EXEC_OUTPUT; streamed
exec: all of it). Target (issue 14): growth of at most 64 MiB.

    python bench/bench_memory.py     # BENCH_MEMORY_MIB=256 for a shorter run
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from _common import Row, say, standalone
from boxd import Boxd
from boxd.config import Paths

MIB = 1 << 20
DOWNLOAD_MIB = int(os.environ.get("BENCH_MEMORY_MIB", "1024"))
EXEC_MB = 200


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _growth(pid: int, fn: Callable[[], None]) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) while ``fn`` runs."""
    start = _rss(pid)
    peak = [start]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], _rss(pid))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    began = time.perf_counter()
    try:
        fn()
    finally:
        stop.set()
        t.join()
    return (peak[0] - start) / MIB, time.perf_counter() - began


def run(client: Boxd | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    """Measure the daemon's RSS growth during a download and a big exec output."""
    tell = log or say
    boxd = client or Boxd()
    paths = Paths.default()
    accel = boxd.info().accelerator  # starts the local daemon if it is not running
    pid = int(paths.lock.read_text().split()[0])
    key = (paths.home / "local.key").read_text().strip()
    m = boxd.machines.new(f"bench-mem-{int(time.time()) % 100000}")
    rows: list[Row] = []
    try:
        boxd.machines.wait_until_ready(m.id, timeout=600)
        boxd.machines.exec(m.id, f"truncate -s {DOWNLOAD_MIB}M /home/boxd/big")
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(paths.socket)),
                            base_url="http://boxd", timeout=600,
                            headers={"Authorization": f"Bearer {key}"})

        def download() -> None:
            with http.stream("GET", f"/v1/machines/{m.id}/files",
                             params={"path": "/home/boxd/big"}) as resp:
                got = sum(len(c) for c in resp.iter_raw(MIB))
            assert got == DOWNLOAD_MIB * MIB, got

        def buffered() -> None:
            boxd.machines.exec(m.id, f"head -c {EXEC_MB}000000 /dev/zero | tr '\\0' a",
                               timeout=3600)

        def streamed() -> None:
            with http.stream("POST", f"/v1/machines/{m.id}/exec/stream",
                             json={"command": f"head -c {EXEC_MB}000000 /dev/zero"}) as resp:
                for _ in resp.iter_lines():
                    pass

        for name, fn in ((f"download {DOWNLOAD_MIB} MiB", download),
                         (f"buffered exec, {EXEC_MB} MB of stdout", buffered),
                         (f"streamed exec, {EXEC_MB} MB of stdout", streamed)):
            tell(f"bench_memory: {name}")
            grown, seconds = _growth(pid, fn)
            rows.append(Row("memory", f"daemon RSS growth: {name}", grown, unit="MiB",
                            accel=accel, note=f"{seconds:.0f} s; target <= 64 MiB"))
        http.close()
    finally:
        boxd.machines.delete(m.id)
    return rows


if __name__ == "__main__":
    standalone(run)
