"""E2B's SDK on boxd (issue 40): create → first command, cold and from a warm template,
against boxd's own SDK doing the same work in the same run; fork(count=8) → 8 commands.

Figures, on the daemon's default engine:

- ``e2b create → first command (cold)``: ``Sandbox.create()`` of ``base`` (a machine
  boots) and ``commands.run("true")``; ``BENCH_E2B_COLD`` iterations (default 5).
- ``e2b create → first command (warm template)``: the same after ``boxd e2b warm base
  --forks 8`` (a create is a fork of the warm machine claiming a standby fork);
  ``BENCH_E2B_N`` iterations (default 100). Baseline: ``boxd fork → first exec`` —
  boxd's own SDK forking the same warm machine and running the same command the way
  E2B runs it (``/bin/bash -l -c true``: a login shell, tens of ms of the figure on
  gVisor), alternated with the E2B iterations (A B B A) so both see the same host.
  The issue's targets: p50 ≤ 0.1 s on gVisor, ratio ≤ 1.2x. Published 2026 figures
  for time to interactive: Daytona 0.11 s, E2B 0.44 s.
- ``e2b create → first command (warm template, 1 s apart)``: the same, one create a
  second (``BENCH_E2B_PACED`` iterations, default 30; ``BENCH_E2B_PACE`` seconds apart):
  time to interactive when a standby fork is ready, where the back-to-back loop above
  claims faster than the pool refills (its figure is then a fork's cost).
- ``e2b fork(count=8) → 8 commands`` against ``boxd fork(count=8) → 8 execs`` of the
  same source (``BENCH_E2B_FORKS`` rounds, default 5).

The sandboxes are killed between iterations (not timed). Needs the dev extra's ``e2b``
package; run ``python bench/bench_e2b.py`` as the daemon's user (it reads the local key).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import Row, row_from, say, standalone

GROUP = "e2b"
#: ``commands.run("true")`` as E2B's envd (and boxd's shim) runs it.
SAME = ["/bin/bash", "-l", "-c", "true"]


def _cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "boxd", *args], check=True,
                          capture_output=True, text=True, env=dict(os.environ)).stdout


def run(client: Any | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    import e2b

    from boxd import Boxd

    tell = log or say
    b = client or Boxd()
    b.machines.list()  # starts the local daemon if need be
    for line in _cli("e2b", "env").splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        os.environ[key] = value
    engine = b.info().engine
    accel = next(e.accelerator for e in b.info().engines if e.name == engine) or engine
    n_cold = int(os.environ.get("BENCH_E2B_COLD", "5"))
    n = int(os.environ.get("BENCH_E2B_N", "100"))
    rounds = int(os.environ.get("BENCH_E2B_FORKS", "5"))
    n_paced = int(os.environ.get("BENCH_E2B_PACED", "30"))
    pace = float(os.environ.get("BENCH_E2B_PACE", "1.0"))

    def e2b_first_command() -> tuple[float, Any]:
        t = time.perf_counter()
        s = e2b.Sandbox.create(timeout=300)
        s.commands.run("true")
        return time.perf_counter() - t, s

    tell(f"bench_e2b: {n_cold} cold creates ({engine})")
    cold = []
    for _ in range(n_cold):
        took, s = e2b_first_command()
        cold.append(took)
        s.kill()

    tell("bench_e2b: boxd e2b warm base --forks 8")
    src = json.loads(_cli("e2b", "warm", "base", "--forks", "8", "--json"))["machine"]
    try:
        warm: list[float] = []
        own: list[float] = []

        def e2b_warm() -> None:
            took, s = e2b_first_command()
            warm.append(took)
            s.kill()

        def own_warm() -> None:
            t = time.perf_counter()
            child = b.machines.fork(src)
            b.machines.exec(child.id, SAME)
            own.append(time.perf_counter() - t)
            b.machines.delete(child.id)

        for i in range(n):  # A B B A: neither always claims the spare refilled last
            for step in ((e2b_warm, own_warm) if i % 2 == 0 else (own_warm, e2b_warm)):
                step()
            if (i + 1) % 20 == 0:
                tell(f"bench_e2b: {i + 1}/{n} warm creates")

        tell(f"bench_e2b: {n_paced} warm creates, {pace:g} s apart")
        paced: list[float] = []
        for _ in range(n_paced):  # the standby forks refill between creates
            time.sleep(pace)
            took, s = e2b_first_command()
            paced.append(took)
            s.kill()

        tell(f"bench_e2b: {rounds} rounds of fork(count=8) → 8 commands")
        e2b_fork: list[float] = []
        own_fork: list[float] = []
        parent = e2b.Sandbox.create(timeout=600)
        try:
            for _ in range(rounds):
                t = time.perf_counter()
                kids = parent.fork(count=8)
                for k in kids:
                    k.commands.run("true")
                e2b_fork.append(time.perf_counter() - t)
                for k in kids:
                    k.kill()
                t = time.perf_counter()
                made = b.machines.fork(parent.sandbox_id, count=8)
                for m in made:
                    assert not isinstance(m, Exception), m
                    b.machines.exec(m.id, SAME)
                own_fork.append(time.perf_counter() - t)
                for m in made:
                    if not isinstance(m, Exception):
                        b.machines.delete(m.id)
        finally:
            parent.kill()
    finally:
        _cli("machine", "delete", "--label", "boxd.e2b/template=base")

    return [
        row_from(GROUP, "e2b create → first command (cold)", cold, accel=accel,
                 note=f"{engine}: Sandbox.create() boots a machine"),
        row_from(GROUP, "e2b create → first command (warm template)", warm, accel=accel,
                 baseline="boxd fork → first exec", baseline_values=own,
                 note="boxd e2b warm base --forks 8; A B B A with the baseline"),
        row_from(GROUP, "boxd fork → first exec (same warm machine)", own, accel=accel),
        row_from(GROUP, f"e2b create → first command (warm template, {pace:g} s apart)",
                 paced, accel=accel, note="a standby fork is ready for each create"),
        row_from(GROUP, "e2b fork(count=8) → 8 commands", e2b_fork, accel=accel,
                 baseline="boxd fork(count=8) → 8 execs", baseline_values=own_fork),
        row_from(GROUP, "boxd fork(count=8) → 8 execs", own_fork, accel=accel),
    ]


if __name__ == "__main__":
    standalone(run)
