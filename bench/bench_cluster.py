"""boxd on Ray: forks within and across nodes, snapshots across nodes, placement cost.

Starts its own control plane on a Ray cluster of three boxd nodes on this machine, in
a network namespace with only ``lo`` (`_cluster.local_cluster`; needs root and Ray),
each node capped at ``BENCH_CLUSTER_CAP`` machines. Measures:

- fork of one child to the source's node (copy-on-write there: the baseline) against
  one to another node, the first (the template streams node to node) and later ones
  (the receiving node keeps it): p50/p90;
- bytes sent and throughput of a cross-node template transfer (the receiving node's
  ``event=received`` log);
- a snapshot started on a node that lacks its blobs (they are fetched by digest)
  against one on the node that holds them;
- ``exec true`` through the control plane (HTTP, placement lookup, a Ray actor call)
  against the same call made straight to the node's actor by a Ray driver;
- 12 children over 3 nodes in one batch: wall time, and per child.

Under TCG the guest-side costs dominate; ratios within this run are what to compare.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import Row, row_from, say, standalone

GROUP = "cluster"
N = int(os.environ.get("BENCH_CLUSTER_N", "5"))
CAP = int(os.environ.get("BENCH_CLUSTER_CAP", "5"))
EXEC_N = int(os.environ.get("BENCH_CLUSTER_EXEC_N", "30"))

_DIRECT = r"""
import json, sys, time
import ray
from boxd import models
ray.init(address=sys.argv[1], namespace="boxd", logging_level="ERROR", log_to_driver=False)
actor = ray.get_actor("boxd-node-" + sys.argv[2])
req = models.ExecRequest(command="true")
out = []
for i in range(int(sys.argv[4]) + 3):
    t = time.perf_counter()
    ray.get(actor.call.remote("exec", sys.argv[3], req))
    out.append(time.perf_counter() - t)
print(json.dumps(out[3:]))
"""


def _received(logs: list[Path]) -> list[tuple[int, float]]:
    out = []
    for log in logs:
        if log.exists():
            for m in re.finditer(r"event=received source=\S+ bytes=(\d+) seconds=([\d.]+)",
                                 log.read_text(errors="replace")):
                out.append((int(m.group(1)), float(m.group(2))))
    return out


def run(client: Any = None, log: Callable[[str], None] | None = None) -> list[Row]:
    tell = log or say
    try:
        import ray  # noqa: F401
    except ImportError:
        tell("bench_cluster: skipped (Ray is not installed: pip install 'boxd[ray]')")
        return []
    if os.geteuid() != 0:
        tell("bench_cluster: skipped (it makes a network namespace: run it as root)")
        return []
    from _cluster import local_cluster

    rows: list[Row] = []
    tell(f"bench_cluster: a Ray cluster of 3 boxd nodes, {CAP} machines each")
    with local_cluster(nodes=3, cap=CAP) as c:
        b = c.client
        accel = str(b.info().accelerator).upper()

        def row(name: str, values: list[float], **kw: Any) -> None:
            rows.append(row_from(GROUP, name, values, accel=accel, **kw))

        src = b.machines.new("bench-src", suspend_after=0, hibernate_after=0)
        src = b.machines.wait_until_ready(src.id, timeout=600)
        b.machines.exec(src.id, "true")
        logs = [c.node_home(n) / "daemon.log" for n in c.node_ids]

        tell(f"bench_cluster: fork to the source's node x{N}")
        same: list[float] = []
        for i in range(N + 1):
            t = time.perf_counter()
            (kid,) = b.machines.fork(src.id, count=1)
            dt = time.perf_counter() - t
            assert not isinstance(kid, Exception) and kid.node == src.node, kid
            if i:  # the first makes the template
                same.append(dt)
            b.machines.delete(kid.id)

        fillers = b.machines.fork(src.id, count=CAP - 1)  # the source's node is full now
        assert all(not isinstance(f, Exception) and f.node == src.node for f in fillers)
        tell(f"bench_cluster: fork to another node x{N} (the first streams the template)")
        first: list[float] = []
        later: list[float] = []
        seen: set[str] = set()
        for _ in range(N + 2):
            t = time.perf_counter()
            (kid,) = b.machines.fork(src.id, count=1)
            dt = time.perf_counter() - t
            assert not isinstance(kid, Exception) and kid.node != src.node, kid
            (later if kid.node in seen else first).append(dt)
            seen.add(kid.node)
            b.machines.delete(kid.id)
        row("fork 1 child, same node (copy-on-write)", same)
        row("fork 1 child, another node, template cached there", later,
            baseline="fork 1 child, same node (copy-on-write)", baseline_values=same)
        row("fork 1 child, another node, first (template streamed)", first,
            baseline="fork 1 child, same node (copy-on-write)", baseline_values=same)
        got = _received(logs)
        if got:
            row("cross-node template transfer: bytes sent", [float(n) for n, _ in got],
                unit="B", note="RAM pages the guest touched, device state, frozen layers")
            row("cross-node template transfer: throughput",
                [n / s / 2**20 for n, s in got if s > 0], unit="MiB/s",
                note="chunks of 8 MiB, 4 in flight, holes skipped; loopback")

        tell("bench_cluster: snapshot start, on a node without its blobs vs with them")
        snap = b.snapshots.save(src.id, "bench-cluster-snap")
        for f in fillers:
            b.machines.delete(f.id)
        here: list[float] = []
        cold: list[float] = []
        warm: list[float] = []
        others = [n for n in c.node_ids if n != src.node]
        for i in range(2):
            for node, out in ((src.node, here), (others[i], cold), (others[i], warm)):
                t = time.perf_counter()
                m = b.machines.new(f"bench-snap-{len(here)}{len(cold)}{len(warm)}",
                                   from_snapshot=snap.name, node=node, suspend_after=0)
                b.machines.wait_until_ready(m.id, timeout=600)
                b.machines.exec(m.id, "true")
                out.append(time.perf_counter() - t)
                b.machines.delete(m.id)
        row("snapshot start → exec, on the node that saved it", here)
        row("snapshot start → exec, node lacking its blobs (fetched)", cold,
            baseline="snapshot start → exec, on the node that saved it", baseline_values=here)
        row("snapshot start → exec, node that fetched them before", warm,
            baseline="snapshot start → exec, on the node that saved it", baseline_values=here)
        b.snapshots.delete(snap.name)

        tell(f"bench_cluster: exec true through the control plane vs the node's actor x{EXEC_N}")
        via: list[float] = []
        for _ in range(EXEC_N + 3):
            t = time.perf_counter()
            b.machines.exec(src.id, "true")
            via.append(time.perf_counter() - t)
        r = c.in_netns(sys.executable, "-c", _DIRECT, c.address, src.node, src.id, str(EXEC_N),
                       timeout=300)
        direct = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else []
        if direct:
            row("exec true, node actor called directly (Ray driver)", direct)
        row("exec true through the control plane (HTTP + placement + Ray)", via[3:],
            baseline="exec true, node actor called directly (Ray driver)" if direct else None,
            baseline_values=direct or None)

        tell("bench_cluster: 12 children over 3 nodes in one batch")
        t = time.perf_counter()
        kids = b.machines.fork(src.id, count=12)
        wall = time.perf_counter() - t
        ok = [k for k in kids if not isinstance(k, Exception)]
        spread = len({k.node for k in ok})
        row("fork 12 children over 3 nodes: wall", [wall],
            note=f"{len(ok)} started on {spread} nodes")
        row("fork 12 children over 3 nodes: per child", [wall / max(1, len(ok))])
        for k in ok:
            b.machines.delete(k.id)
        b.machines.delete(src.id)
    return rows


if __name__ == "__main__":
    standalone(run)
