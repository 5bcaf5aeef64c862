"""Mixed load on a real daemon (issue: races under load).

Many concurrent HTTP clients exec on, read, list, fork and delete machines for a bounded
time, while a second source is forked and deleted with forks of it in flight (the
template collected under them, before the fix) and the first source now and then
changes (its template goes stale). The host has 2 cores and runs QEMU under TCG: forks
are few at a time and every child is deleted again.

Every request gets a typed answer: a 2xx, or an error with its body
(``{"error": {"code", ...}}``) at a status below 500 — or 503 ``machine_failed``, the
documented answer for a VM that died — and no connection is reset or refused. The
fake-engine variant (many more requests, in the unit tier) is
tests/unit/test_load_mixed_fake.py.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1200)]

CLIENTS = 300  # the round-3 probe's count
SECONDS = 45.0
FORKS_AT_ONCE = 2  # children alive at a time (the host has 2 cores)


def test_mixed_load_every_request_gets_a_typed_answer(daemon, client, base) -> None:  # type: ignore[no-untyped-def]
    secret = (daemon.home / "local.key").read_text().strip()
    log_start = daemon.log.stat().st_size if daemon.log.exists() else 0
    src = client.machines.fork(base.id, "load-src")
    client.machines.wait_until_ready(src.id, timeout=300)
    statuses: collections.Counter[tuple[str, int]] = collections.Counter()
    bad: list[str] = []
    latencies: list[float] = []

    async def main() -> None:
        transport = httpx.AsyncHTTPTransport(uds=str(daemon.socket), retries=0)
        limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://boxd", limits=limits, timeout=300,
            headers={"Authorization": f"Bearer {secret}"},
        ) as c:
            forks = asyncio.Semaphore(FORKS_AT_ONCE)

            async def call(op: str, method: str, url: str, **kw: Any) -> httpx.Response | None:
                t0 = time.monotonic()
                try:
                    r = await c.request(method, url, **kw)
                except httpx.TransportError as exc:  # a reset, refused or cut connection
                    bad.append(f"{op} {method} {url}: {type(exc).__name__}: {exc}")
                    return None
                latencies.append(time.monotonic() - t0)
                statuses[(op, r.status_code)] += 1
                code = None
                if r.status_code >= 400:
                    try:
                        code = r.json()["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        bad.append(f"{op} {method} {url}: untyped {r.status_code} {r.text[:200]}")
                        return r
                if r.status_code >= 500 and not (r.status_code == 503
                                                 and code == "machine_failed"):
                    bad.append(f"{op} {method} {url}: {r.status_code} {r.text[:300]}")
                return r

            async def fork_and_drop(source: str) -> None:
                async with forks:
                    r = await call("fork", "POST", f"/v1/machines/{source}/fork", json={})
                    if r is not None and r.status_code == 201:
                        child = r.json()["id"]
                        await call("child-exec", "POST", f"/v1/machines/{child}/exec",
                                   json={"command": "echo child"})
                        await call("child-delete", "DELETE", f"/v1/machines/{child}")

            deadline = time.monotonic() + SECONDS

            async def worker(i: int) -> None:
                rng = random.Random(i)
                while time.monotonic() < deadline:
                    op = rng.choices(["exec", "change", "get", "list", "fork", "delete"],
                                     weights=[30, 1, 30, 25, 6, 8])[0]
                    if op == "exec":
                        await call(op, "POST", "/v1/machines/load-src/exec",
                                   json={"command": ["echo", str(i)]})
                    elif op == "change":  # the template goes stale
                        await call(op, "POST", "/v1/machines/load-src/exec",
                                   json={"command": ["touch", f"/tmp/x{i}"]})
                    elif op == "get":
                        await call(op, "GET", "/v1/machines/load-src")
                    elif op == "list":
                        await call(op, "GET", "/v1/machines")
                    elif op == "fork":
                        await fork_and_drop("load-src")
                    else:  # somebody's child, maybe one still being started
                        r = await call("list", "GET", "/v1/machines")
                        kids = [m["id"] for m in (r.json()["machines"] if r is not None
                                                  and r.status_code == 200 else [])
                                if m["parent_id"] == src.id]
                        if kids:
                            await call(op, "DELETE", f"/v1/machines/{rng.choice(kids)}")

            async def victim() -> None:
                """A source deleted while forks of it are in flight."""
                n = 0
                while time.monotonic() < deadline - 10:
                    n += 1
                    name = f"load-victim-{n}"
                    r = await call("victim", "POST", f"/v1/machines/{base.id}/fork",
                                   json={"name": name})
                    if r is None or r.status_code != 201:
                        await asyncio.sleep(1)
                        continue
                    inflight = asyncio.create_task(fork_and_drop(name))
                    await asyncio.sleep(random.uniform(0.05, 1.0))
                    await call("victim-delete", "DELETE", f"/v1/machines/{name}")
                    await inflight

            await asyncio.gather(victim(), *(worker(i) for i in range(CLIENTS)))

    try:
        asyncio.run(main())
    finally:
        for m in client.machines.list():
            if m.parent_id == src.id or m.name.startswith("load-"):
                client.machines.delete(m.id)
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)] if latencies else 0.0
    print(f"\n{len(latencies)} answers in {SECONDS:.0f} s; p50 "
          f"{latencies[len(latencies) // 2]:.2f} s, p99 {p99:.2f} s, max {latencies[-1]:.2f} s")
    print(dict(sorted(statuses.items())))
    with open(daemon.log, errors="replace") as f:  # what the daemon said meanwhile
        f.seek(log_start)
        errors_logged = [line.strip()[:300] for line in f
                         if "unhandled error" in line or "IntegrityError" in line
                         or ("No such file" in line and "template" in line)]
    assert not bad, f"{len(bad)} untyped answers or broken connections:\n" + "\n".join(bad[:30])
    assert not errors_logged, "\n".join(errors_logged[:20])
    assert sum(n for (op, st), n in statuses.items() if op == "exec" and st == 200) > 50
    assert statuses[("fork", 201)] >= 3, statuses
