"""Admission (issue 42, item 4): forks per second this host sustains at an account's
quota with ``wait=``, and what the queue costs a request.

Figures, on gVisor (the engine whose forks are cheapest here):

- ``fork → exec → delete, 1 client (no queue)``: one client, sequentially,
  ``BENCH_ADM_SOLO`` times (default 20): the baseline, measured in the same run.
- ``fork → exec → delete, N clients at quota Q (wait=)``: ``BENCH_ADM_CLIENTS``
  clients (default 40), ``BENCH_ADM_ROUNDS`` requests each (default 5), on an account
  whose quota leaves Q-1 children (default Q = 6); each figure is one request's
  time, its wait in the queue included. Its ratio against the baseline is what
  queueing at the quota costs a request.
- ``queue delay``: each request's time minus the baseline's median: the wait for a
  slot (a lower bound of the wait, as the work itself slows under load).
- ``forks/s sustained``: requests done over the wall time of the contended run.

Published 2026 figures for sandbox creation rate: E2B 5 creates/s per key (Pro tier),
Modal 30/s. Run ``python bench/bench_admission.py`` as the daemon's user (its key makes
the bench account; the operator's key is needed).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from _common import Row, row_from, say, standalone

GROUP = "admission"


def run(client: Any | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    from boxd import Boxd

    tell = log or say
    b = client or Boxd()
    solo_n = int(os.environ.get("BENCH_ADM_SOLO", "20"))
    clients = int(os.environ.get("BENCH_ADM_CLIENTS", "40"))
    rounds = int(os.environ.get("BENCH_ADM_ROUNDS", "5"))
    quota = int(os.environ.get("BENCH_ADM_QUOTA", "6"))
    account = f"bench-adm-{uuid.uuid4().hex[:6]}"
    key = b.keys.create("bench-admission", account=account).secret
    b.accounts.update(account, max_machines=quota)
    accel = next((e.accelerator for e in b.info().engines if e.name == "gvisor"), None)
    with Boxd(api_key=key) as a:
        base = a.machines.new("bench-adm-base", engine="gvisor")
        a.machines.wait_until_ready(base.id, timeout=300)
        try:
            def once(c: Any, name: str) -> float:
                t = time.perf_counter()
                m = c.machines.fork(base.id, name, wait=600)
                c.machines.exec(m.id, "true")
                c.machines.delete(m.id)
                return time.perf_counter() - t

            tell(f"bench_admission: {solo_n} forks from one client")
            solo = [once(a, f"solo-{i}") for i in range(solo_n)]
            tell(f"bench_admission: {clients} clients x {rounds} forks at quota {quota}")
            took: list[float] = []
            lock = threading.Lock()

            def loop(i: int) -> None:
                with Boxd(api_key=key) as c:
                    for j in range(rounds):
                        t = once(c, f"adm-{i}-{j}")
                        with lock:
                            took.append(t)

            threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
        finally:
            for m in a.machines.list():
                a.machines.delete(m.id)
    base_med = sorted(solo)[len(solo) // 2]
    return [
        row_from(GROUP, "fork → exec → delete, 1 client (no queue)", solo, accel=accel or "?"),
        row_from(GROUP, f"fork → exec → delete, {clients} clients at quota {quota} (wait=)",
                 took, accel=accel or "?", baseline="1 client (no queue)",
                 baseline_values=solo, note=f"{len(took)} requests, {quota - 1} at a time"),
        row_from(GROUP, "queue delay (request - solo median)",
                 [max(0.0, t - base_med) for t in took], accel=accel or "?"),
        row_from(GROUP, "forks/s sustained at the quota", [len(took) / wall], unit="/s",
                 accel=accel or "?", note=f"wall {wall:.1f} s"),
    ]


if __name__ == "__main__":
    standalone(run)
