"""`Boxd()` inside a machine: an API call over the relayed socket against the same call
from the host (docs/lifecycle.md#in-machine-auth).

Figures: ``machines.list()`` from inside a machine (guest client -> /run/boxd/boxd.sock ->
agent channel -> daemon) against ``machines.list()`` from the host (unix socket), both on
a warm connection; and the first call in a fresh fork child (its socket is served at the
first connection: the relay start is in it).

``BENCH_GUEST_API_ENGINE`` (``qemu`` or ``gvisor``; default: the daemon's) picks the
engine the machine runs on.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from _common import Row, row_from, say, standalone

GROUP = "guest-api"
N = 30

# In the guest: N timed calls on one client after a warm-up, printed as JSON seconds.
INSIDE = """
import json, sys, time
from boxd import Boxd
b = Boxd()
b.machines.list()
out = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter(); b.machines.list(); out.append(time.perf_counter() - t)
print(json.dumps(out))
"""
FIRST = """
import json, time
from boxd import Boxd
t = time.perf_counter(); Boxd().machines.list(); print(json.dumps(time.perf_counter() - t))
"""


def run(client: Any | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    from boxd import Boxd

    tell = log or say
    b = client or Boxd()
    engine = os.environ.get("BENCH_GUEST_API_ENGINE") or None
    tell(f"bench_guest_api: cold boot of one machine ({engine or 'default engine'})")
    m = b.machines.new(f"bench-guest-api-{int(time.time())}", engine=engine)
    made = [m.id]
    try:
        b.machines.wait_until_ready(m.id, timeout=600)
        on = b.machines.get(m.id).engine
        accel = next(e.accelerator for e in b.info().engines if e.name == on) or on
        b.machines.files.upload(m.id, "/root/inside.py", INSIDE)
        b.machines.files.upload(m.id, "/root/first.py", FIRST)
        r = b.machines.exec(m.id, f"python3 /root/inside.py {N}", timeout=600)
        assert r.exit_code == 0, r.stderr
        inside = json.loads(r.stdout)
        b.machines.list()
        host = []
        for _ in range(N):
            t = time.perf_counter()
            b.machines.list()
            host.append(time.perf_counter() - t)
        firsts = []
        for _ in range(5):
            child = b.machines.fork(m.id)
            made.append(child.id)
            r = b.machines.exec(child.id, "python3 /root/first.py", timeout=600)
            assert r.exit_code == 0, r.stderr
            firsts.append(float(json.loads(r.stdout)))
            b.machines.delete(child.id)
            made.remove(child.id)
        return [
            row_from(GROUP, "machines.list() from inside (relayed socket)", inside,
                     accel=accel, note=f"guest client on {on}, warm connection",
                     baseline="machines.list() from the host", baseline_values=host),
            row_from(GROUP, "machines.list() from the host", host, accel=accel,
                     note="unix socket, warm connection"),
            row_from(GROUP, "first call in a fresh fork child", firsts, accel=accel,
                     note="client created in the call; the socket is served at first use"),
        ]
    finally:
        for mid in made:
            b.machines.delete(mid)


if __name__ == "__main__":
    standalone(run)
