"""OpenEnv session start through `boxd.openenv.BoxdProvider` (issue 26) against starting
the env's server fresh in a new machine, in one run.

    python bench/bench_openenv.py        # needs boxd[openenv] on the host

On the daemon's default engine. A machine gets openenv-core (wheels the *host*
downloads: the recipe's ``download_wheels``, examples/openenv/serve_sessions.py) and
``examples/openenv/counter_env.py``; it is saved as a snapshot without a server running
(``cold``); then its server starts and it is saved again (``warm``) and kept running as
a fork source. Each figure is one session's start to its first observation (an unmodified
``CounterClient``'s ``reset`` over the WebSocket), ``BENCH_OPENENV_N`` (5) rounds,
alternating:

- **fork** (`BoxdProvider.start_container(machine)`): a fork of the running machine,
  its server already listening; ``wait_for_ready``; ``reset``;
- **snapshot** (`BoxdProvider.start_container(snapshot)`): a machine started from the
  warm snapshot (the docs' recipe), server already listening; ``wait_for_ready``;
  ``reset``;
- **fresh** (the baseline): a machine started from the cold snapshot, the server
  started in it (``uvicorn counter_env:app``), ``/health`` polled, ``reset``: what
  starting the server in a new machine costs, with the packages already installed.

Each session's machine is deleted after its round (not timed).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Row, row_from, say, standalone

GROUP = "openenv"
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "openenv"
WHEELS = REPO / ".cache" / "wheels-openenv"
N = int(os.environ.get("BENCH_OPENENV_N", "5"))


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ok(b: Any, ref: str, cmd: str) -> None:
    r = b.machines.exec(ref, cmd, timeout=900)
    assert r.exit_code == 0, f"{cmd!r}: {r.stderr[-1500:]}"


def _first_observation(counter: Any, url: str) -> Any:
    async def go() -> Any:
        env = counter.CounterClient(base_url=url)
        try:
            return (await env.reset()).observation
        finally:
            await env.close()

    return asyncio.run(go())


def run(client: Any | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    from boxd import Boxd
    from boxd.openenv import BoxdProvider

    tell = log or say
    b = client or Boxd()
    counter = _load(EXAMPLES / "counter_env.py")
    recipe = _load(EXAMPLES / "serve_sessions.py")  # its wheels, paths and serve command
    provider = BoxdProvider(b)
    stamp = int(time.time())
    cold, warm = f"bench-oe-cold-{stamp}", f"bench-oe-warm-{stamp}"
    tell("bench_openenv: preparing a machine with openenv-core and counter_env")
    src = b.machines.new(f"bench-oe-{stamp}")
    made: list[str] = []
    try:
        b.machines.wait_until_ready(src.id, timeout=600)
        engine = b.machines.get(src.id).engine
        accel = str(next(e.accelerator for e in b.info().engines if e.name == engine) or engine)
        guest = recipe.GUEST_WHEELS
        for whl in recipe.download_wheels(WHEELS):
            b.machines.files.upload(src.id, f"{guest}/{whl.name}", whl.read_bytes())
        _ok(b, src.id, f"pip install -q --no-cache-dir --no-index --no-deps "
                       f"{guest}/*.whl && rm -rf {guest}")
        b.machines.files.upload(src.id, "/home/boxd/counter_env.py",
                                (EXAMPLES / "counter_env.py").read_text())
        b.snapshots.save(src.id, cold)
        made.append(cold)
        _ok(b, src.id, recipe.SERVE)
        src_url = b.machines.get(src.id).url
        assert src_url is not None
        provider.wait_for_ready(src_url, timeout_s=180)
        b.snapshots.save(src.id, warm)
        made.append(warm)
        times: dict[str, list[float]] = {"fork": [], "snapshot": [], "fresh": []}
        for i in range(N):
            tell(f"bench_openenv: round {i + 1}/{N}")
            for kind, image in (("fork", src.name), ("snapshot", warm)):
                t = time.perf_counter()
                url = provider.start_container(image)
                provider.wait_for_ready(url, timeout_s=180)
                _first_observation(counter, url)
                times[kind].append(time.perf_counter() - t)
                provider.stop_container()
            t = time.perf_counter()
            m = b.machines.new(f"bench-oe-fresh-{stamp}-{i}", from_snapshot=cold)
            try:
                b.machines.wait_until_ready(m.id, timeout=600)
                _ok(b, m.id, recipe.SERVE)
                fresh_url = b.machines.get(m.id).url
                assert fresh_url is not None
                provider.wait_for_ready(fresh_url, timeout_s=180)
                _first_observation(counter, fresh_url)
                times["fresh"].append(time.perf_counter() - t)
            finally:
                b.machines.delete(m.id)
    finally:
        b.machines.delete(src.id)
        for name in made:
            b.snapshots.delete(name)
    base = "fresh: new machine, server started"
    return [
        row_from(GROUP, f"{engine}: session start, fork of a running server (BoxdProvider)",
                 times["fork"], accel=accel, baseline=base, baseline_values=times["fresh"],
                 note="start_container(machine) to the first reset's observation"),
        row_from(GROUP, f"{engine}: session start, from a snapshot with its server "
                 "(BoxdProvider)", times["snapshot"], accel=accel, baseline=base,
                 baseline_values=times["fresh"], note="the docs' recipe"),
        row_from(GROUP, f"{engine}: {base}", times["fresh"], accel=accel,
                 note="packages installed; uvicorn started, /health polled"),
    ]


if __name__ == "__main__":
    standalone(run)
