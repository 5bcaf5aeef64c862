"""The reproducibility verifier's own throughput (issue 28): pairs per minute.

    python bench/bench_verify.py
    BOXD_HOME=/tmp/bv-qemu BOXD_ENGINE=qemu python bench/bench_verify.py   # the other engine

On the daemon's default engine, against one warm source (gymnasium, numpy, cloudpickle
from the host's wheels, as bench_rl.py makes it): ``boxd.rl.verify(source,
"CartPole-v1", seeds=..., steps=BENCH_VERIFY_STEPS (200), jobs=BENCH_VERIFY_JOBS (4))``
over ``BENCH_VERIFY_PAIRS`` (12) seeds, rounds alternating:

- **fresh build** (the baseline): the default, each run builds the env in its own fork;
- **template**: ``template=True``, each run forks one template in which the env was
  built once.

``BENCH_VERIFY_N`` (3) rounds of each; a row's value is the seconds per pair of one
round (wall time / pairs), so its ratio is the template's share of the fresh build's
time; the note gives the median pairs per minute. Every round must be identical.
Figures in docs/benchmarks.md ("verifier throughput").
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Row, median, row_from, say, standalone
from bench_rl import _accel, _prepare_source

GROUP = "verify"
N = int(os.environ.get("BENCH_VERIFY_N", "3"))
PAIRS = int(os.environ.get("BENCH_VERIFY_PAIRS", "12"))
STEPS = int(os.environ.get("BENCH_VERIFY_STEPS", "200"))
JOBS = int(os.environ.get("BENCH_VERIFY_JOBS", "4"))


def run(client: Any | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    from boxd import Boxd

    tell = log or say
    own = client is None
    c = client if client is not None else Boxd()
    source, made = _prepare_source(c, tell)
    try:
        return _rounds(c, source, tell)
    finally:
        if made:
            with contextlib.suppress(Exception):
                c.machines.delete(source)
        if own:
            c.close()


def _rounds(client: Any, source: str, tell: Callable[[str], None]) -> list[Row]:
    import boxd.rl as rl

    accel = _accel(client, source)
    per_pair: dict[bool, list[float]] = {False: [], True: []}
    for r in range(N):
        for template in (False, True):
            tell(f"bench_verify: round {r + 1}/{N}, {'template' if template else 'fresh'}")
            report = rl.verify(source, "CartPole-v1", seeds=range(r * PAIRS, (r + 1) * PAIRS),
                               steps=STEPS, jobs=JOBS, boxd=client, template=template)
            assert report.identical and report.distinct == PAIRS, report.rows()
            per_pair[template].append(report.wall_s / PAIRS)
    fresh, tpl = per_pair[False], per_pair[True]
    what = f"{PAIRS} CartPole pairs x {STEPS} steps, jobs={JOBS}"
    return [
        row_from(GROUP, f"verify, template=True: s per pair ({what})", tpl, accel=accel,
                 baseline="fresh build per run", baseline_values=fresh,
                 note=f"{60 / median(tpl):.0f} pairs/min"),
        row_from(GROUP, f"verify, fresh build per run: s per pair ({what})", fresh,
                 accel=accel, note=f"{60 / median(fresh):.0f} pairs/min; the default"),
    ]


if __name__ == "__main__":
    standalone(run)
