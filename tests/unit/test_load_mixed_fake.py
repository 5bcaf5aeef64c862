"""Mixed load through the HTTP API on the fake engine (the unit tier's version of
tests/integration/test_load_mixed.py).

Many concurrent clients exec on, read, list, fork and delete machines while the source
itself is changed, deleted and made again; every engine step yields for a random
moment so that launches, deletes and collections interleave. Every response is a typed
answer: a 2xx, or a 4xx with the error body (``{"error": {"code", ...}}``), never a
500; and once everything is deleted no record, layer, template or file is left.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from pathlib import Path

import httpx
import pytest
from tests._support.api_fakes import host_info
from tests._support.fake_world import ACCOUNT, leftovers, make_world

from boxd.api import create_app
from boxd.api.services.keys import KeyService
from boxd.engine.fake import FakeEngine

pytestmark = pytest.mark.timeout(120)

CLIENTS = 100
SECONDS = 3.0
MIN_DONE = 8  # answered creates/forks (201) and deletes (204) before the load stops


def test_mixed_load_gets_a_typed_answer_for_every_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_world(tmp_path, monkeypatch, spares=2)
    w.node.spares.settle = 0.0
    rng = random.Random(1234)
    real_step = FakeEngine._step

    async def jittery(self: FakeEngine, step: str) -> None:
        await asyncio.sleep(rng.uniform(0, 0.004))  # launches and deletes interleave
        await real_step(self, step)

    monkeypatch.setattr(FakeEngine, "_step", jittery)
    keys = KeyService(w.repos.db)
    secret = keys.create(ACCOUNT, "load").secret
    app = create_app(machines=w.machines, snapshots=w.snapshots, keys=keys,
                     host_info=host_info, upload_dir=tmp_path / "uploads",
                     private_dirs=(w.paths.home, w.paths.shm))
    statuses: collections.Counter[int] = collections.Counter()
    bad: list[str] = []

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://boxd",
                                     headers={"Authorization": f"Bearer {secret}"},
                                     timeout=60) as c:
            async def call(method: str, url: str, **kw: object) -> httpx.Response:
                r = await c.request(method, url, **kw)  # type: ignore[arg-type]
                statuses[r.status_code] += 1
                if r.status_code >= 500:
                    bad.append(f"{method} {url}: {r.status_code} {r.text[:300]}")
                elif r.status_code >= 400:
                    err = r.json().get("error", {})
                    if not err.get("code"):
                        bad.append(f"{method} {url}: untyped {r.status_code} {r.text[:300]}")
                return r

            r = await call("POST", "/v1/machines", json={"name": "src"})
            assert r.status_code == 201, r.text
            await call("POST", "/v1/machines/src/wait", json={"timeout": 5})
            deadline = time.monotonic() + SECONDS
            give_up = time.monotonic() + 60  # the timeout's margin

            def running() -> bool:
                # At least SECONDS of load, and until forks and deletes both happened
                # enough (a loaded host may fit few in SECONDS); bounded by give_up.
                if time.monotonic() >= give_up:
                    return False
                return (time.monotonic() < deadline or statuses[201] < MIN_DONE
                        or statuses[204] < MIN_DONE)

            async def client(i: int) -> None:
                mine = random.Random(i)
                while running():
                    op = mine.choices(
                        ["exec", "change", "get", "list", "fork", "delete_child"],
                        weights=[25, 5, 20, 15, 25, 10])[0]
                    if i == 0:  # one client deletes the source now and then
                        op = "resrc"
                        await asyncio.sleep(0.3)
                    if op == "exec":
                        await call("POST", "/v1/machines/src/exec", json={"command": "echo hi"})
                    elif op == "change":  # the template goes stale
                        await call("POST", "/v1/machines/src/exec",
                                   json={"command": f"write /root/x {i}"})
                    elif op == "get":
                        await call("GET", "/v1/machines/src")
                    elif op == "list":
                        await call("GET", "/v1/machines")
                    elif op == "fork":
                        r = await call("POST", "/v1/machines/src/fork", json={})
                        if r.status_code == 201:
                            child = r.json()["id"]
                            await call("POST", f"/v1/machines/{child}/exec",
                                       json={"command": "echo child"})
                            await call("DELETE", f"/v1/machines/{child}")
                    elif op == "delete_child":
                        r = await call("GET", "/v1/machines")
                        kids = [m["id"] for m in r.json().get("machines", [])
                                if m["name"] != "src"]
                        if kids:
                            await call("DELETE", f"/v1/machines/{mine.choice(kids)}")
                    else:  # the source deleted under the forks in flight, and made again
                        r = await call("DELETE", "/v1/machines/src")
                        if r.status_code == 204:
                            await call("POST", "/v1/machines", json={"name": "src"})

            await asyncio.gather(*(client(i) for i in range(CLIENTS)))
            if (await c.get("/v1/machines/src")).status_code == 404:
                await call("POST", "/v1/machines", json={"name": "src"})
            for m in (await c.get("/v1/machines")).json()["machines"]:
                r = await call("DELETE", f"/v1/machines/{m['id']}")
                assert r.status_code in (204, 404), r.text
        while w.node.spares._tasks:
            await asyncio.gather(*list(w.node.spares._tasks), return_exceptions=True)
        await w.node.spares.close()

    try:
        asyncio.run(main())
        assert not bad, "\n".join(bad[:20])
        assert statuses[201] >= MIN_DONE and statuses[204] >= MIN_DONE, statuses
        assert w.repos.machines.list(ACCOUNT) == []
        assert w.repos.layers.ids() == set()
        assert w.repos.layers.template_dirs() == set()
        assert leftovers(w) == {"disks": [], "run": [], "templates": [], "checkpoints": []}
    finally:
        w.repos.db.close()
