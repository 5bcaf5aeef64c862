"""A/B of two checkouts of boxd on this host, measured interleaved in one run.

    python bench/compare_commits.py OLD_SRC NEW_SRC [-n 10]

OLD_SRC and NEW_SRC are the ``src`` folders of two checkouts (e.g. a ``git worktree``
of an older commit). Each gets its own daemon (started with that ``src`` first on
``PYTHONPATH``, on a fresh data directory) and its own cold-booted machine; then every
figure is measured on A and B in turn (A B A B ...), so host load drifts hit both.
Prints a table: median and p90 of each, and the ratio B/A pair by pair (median). The
channel figure is a 100-byte frame through a spawned echo process (the step channel).
The client is this checkout's SDK against both daemons (the HTTP API is the same).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _common import p90  # noqa: E402
from bench_rl import ECHO  # noqa: E402  (the framed echo the rl bench measures)
from boxd import Boxd  # noqa: E402


def start(src: Path) -> tuple[Path, subprocess.Popen[bytes]]:
    home = Path(tempfile.mkdtemp(prefix="boxd-ab-", dir="/tmp"))
    env = {**os.environ, "BOXD_HOME": str(home), "PYTHONPATH": str(src),
           "BOXD_SUSPEND_AFTER": "0", "BOXD_HIBERNATE_AFTER": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "boxd", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not (home / "local.key").exists() or not (home / "boxd.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"daemon of {src} did not start")
        time.sleep(0.1)
    return home, proc


def client(home: Path) -> Boxd:
    old = os.environ.get("BOXD_HOME")
    os.environ["BOXD_HOME"] = str(home)
    try:
        return Boxd()
    finally:
        if old is None:
            os.environ.pop("BOXD_HOME", None)
        else:
            os.environ["BOXD_HOME"] = old


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("-n", type=int, default=10)
    args = ap.parse_args()
    daemons = [start(args.old.resolve()), start(args.new.resolve())]
    clients = [client(h) for h, _ in daemons]
    rows: list[tuple[str, list[float], list[float]]] = []
    handles: list[Any] = []
    try:
        boots: list[list[float]] = [[], []]
        srcs = []
        for i, c in enumerate(clients):
            t = time.perf_counter()
            m = c.machines.new("ab-src")
            c.machines.wait_until_ready(m.id, timeout=600)
            boots[i].append(time.perf_counter() - t)
            c.machines.exec(m.id, "true")
            srcs.append(m.id)
        rows.append(("cold boot → ready", boots[0], boots[1]))

        def fork_ready(i: int) -> float:
            c = clients[i]
            t = time.perf_counter()
            child = c.machines.fork(srcs[i])
            c.machines.wait_until_ready(child.id, timeout=600)
            c.machines.exec(child.id, "true")
            took = time.perf_counter() - t
            c.machines.delete(child.id)
            return took

        for i in (0, 1):  # the first fork makes the template; spares fill after it
            fork_ready(i)
        time.sleep(5)
        for i, c in enumerate(clients):  # a framed echo: the step channel's round trip
            c.machines.files.upload(srcs[i], "/home/boxd/echo.py", ECHO)
            h = c.machines.spawn(srcs[i], ["python3", "-u", "/home/boxd/echo.py"])
            for _ in range(50):
                h.send(b"x" * 100)
                h.recv(timeout=60)
            handles.append(h)

        def channel(i: int) -> float:
            t = time.perf_counter()
            handles[i].send(b"x" * 100)
            handles[i].recv(timeout=60)
            return time.perf_counter() - t

        forks: list[list[float]] = [[], []]
        execs: list[list[float]] = [[], []]
        chans: list[list[float]] = [[], []]
        ck_save: list[list[float]] = [[], []]
        ck_restore: list[list[float]] = [[], []]
        for r in range(args.n):
            for i in (0, 1):
                forks[i].append(fork_ready(i))
                time.sleep(1.5)  # let the spare pool refill, as between rollouts
            for i in (0, 1):
                c = clients[i]
                execs[i].extend(timed(lambda c=c, i=i: c.machines.exec(srcs[i], "true"))
                                for _ in range(3))
            for _ in range(4):  # blocks of 25, alternating
                for i in (0, 1):
                    chans[i].extend(channel(i) for _ in range(25))
            for i in (0, 1):
                c = clients[i]
                name = f"ab-{r}"
                ck_save[i].append(timed(lambda c=c, i=i, name=name:
                                        c.machines.checkpoints.save(srcs[i], name)))
                ck_restore[i].append(timed(lambda c=c, i=i, name=name:
                                           c.machines.checkpoints.restore(srcs[i], name)))
                c.machines.checkpoints.delete(srcs[i], name)
        rows += [
            ("fork → exec-ready (template reused, spare)", forks[0], forks[1]),
            ("exec true round trip", execs[0], execs[1]),
            ("channel round trip, 100 B (spawn, framed echo)", chans[0], chans[1]),
            ("checkpoint save", ck_save[0], ck_save[1]),
            ("checkpoint restore", ck_restore[0], ck_restore[1]),
        ]
    finally:
        for h in handles:
            h.close()
        for c in clients:
            c.close()
        for home, proc in daemons:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            from boxd.config import Paths
            from boxd.engine.gvisor import _net

            shm = Paths(home).shm
            for where in (home, shm):  # its QEMUs, its gVisor sandboxes
                subprocess.run(["pkill", "-9", "-f", str(where)], check=False)
            _net.end_recorded(shm / "machines")  # their pasta, named nowhere
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)
    print(f"| figure | n | A {args.old} median | A p90 | B {args.new} median | B p90 | B/A |")
    print("|---|---|---|---|---|---|---|")
    for name, a, b in rows:
        pairs = [y / x for x, y in zip(a, b, strict=False) if x > 0]
        ratio = statistics.median(pairs) if pairs else float("nan")
        pa = f"{p90(a) * 1e3:.1f} ms" if len(a) > 1 else "-"
        pb = f"{p90(b) * 1e3:.1f} ms" if len(b) > 1 else "-"
        print(f"| {name} | {len(a)} | {statistics.median(a) * 1e3:.1f} ms | {pa} | "
              f"{statistics.median(b) * 1e3:.1f} ms | {pb} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
