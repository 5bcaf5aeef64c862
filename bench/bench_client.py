"""Client start-up: what ``from boxd import Boxd`` costs a script (issue 12).

    python bench/bench_client.py        # this module alone (bench/run.py runs them all)

Each sample is one fresh ``python -c ...`` subprocess of this interpreter, timed from
spawn to exit, so it includes the interpreter's own start-up. The statements run
interleaved, round after round, so that load on the shared host hits them alike:

- ``pass``: the interpreter alone;
- ``import httpx, pydantic``: the client's two big dependencies, the baseline;
- ``from boxd import Boxd``: the SDK, against that baseline (target: at most 1.3x);
- ``import boxd.cli``: the CLI (click and rich on top of the SDK), against the baseline.

No daemon is started and no machine is made; the accelerator does not matter here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Row, row_from, say, standalone

GROUP = "client"
N = 30
WARMUP = 3
BASELINE = "import httpx, pydantic"
STATEMENTS = ("pass", BASELINE, "from boxd import Boxd", "import boxd.cli")


def _spawn(statement: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - t


def run(client: object | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    """Time each statement in ``N`` fresh interpreters, interleaved round by round."""
    tell = log or say
    tell(f"bench_client: {len(STATEMENTS)} statements x {N} fresh interpreters")
    samples: dict[str, list[float]] = {s: [] for s in STATEMENTS}
    for i in range(WARMUP + N):
        for statement in STATEMENTS:
            took = _spawn(statement)
            if i >= WARMUP:
                samples[statement].append(took)
    rows = [row_from(GROUP, "python -c 'pass'", samples["pass"], accel="host",
                     note="interpreter start-up alone")]
    base = samples[BASELINE]
    rows.append(row_from(GROUP, f"python -c '{BASELINE}'", base, accel="host",
                         note="the client's dependencies alone"))
    for statement, note in (("from boxd import Boxd", "target: ratio at most 1.3x"),
                            ("import boxd.cli", "the CLI: click and rich as well")):
        rows.append(row_from(GROUP, f"python -c '{statement}'", samples[statement],
                             accel="host", note=note, baseline=BASELINE,
                             baseline_values=base))
    return rows


if __name__ == "__main__":
    standalone(run)
