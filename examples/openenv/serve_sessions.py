"""Serve N concurrent OpenEnv sessions, each in its own fork of one warm snapshot.

The recipe of docs/openenv.md, end to end:

1. a machine gets openenv-core and ``counter_env.py`` (this folder's example env);
2. its server starts on port 8080 and answers ``/health``;
3. the machine is saved as a snapshot (memory included: the server is running in it);
4. N unmodified ``CounterClient`` sessions start at once, each through
   ``BoxdProvider`` (``from_docker_image(snapshot)``): each gets a machine of its own
   started from the snapshot, with the server already listening;
5. every session's first observation is the same (the server's nonce, drawn when it
   started, is in the snapshot's memory), and each then sees only its own steps.

    python examples/openenv/serve_sessions.py --sessions 4
    python examples/openenv/serve_sessions.py --wheels DIR   # a guest with no index

``--wheels DIR`` uploads the wheels in DIR and installs them without an index or a
dependency resolution (DIR must hold openenv-core and everything its server imports:
fastapi, uvicorn, pydantic, websockets, fastmcp, requests and their dependencies; gradio, openai
and huggingface_hub the server does not need), instead of letting the guest run ``pip
install openenv-core`` itself: for a guest with no route to a package index.
``--engine qemu|gvisor`` picks the baseline's engine (the daemon's default otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import subprocess
import sys
from pathlib import Path
from typing import Any

from boxd import Boxd, errors
from boxd.openenv import BoxdProvider

HERE = Path(__file__).resolve().parent
GUEST_WHEELS = "/tmp/openenv-wheels"
SERVE = ("cd /home/boxd && nohup setsid python3 -m uvicorn counter_env:app --host 0.0.0.0 "
         "--port 8080 >/tmp/counter_env.server.log 2>&1 </dev/null &")
#: What openenv-core's server and client import (besides the standard library).
SERVER_DEPS = ["fastapi", "uvicorn", "pydantic", "websockets", "fastmcp", "requests"]
OPENENV = "openenv-core==0.3.0"


def download_wheels(dest: Path) -> list[Path]:
    """``--wheels``' folder, made on the host: openenv-core (no dependencies) and
    ``SERVER_DEPS`` as wheels for the guest (CPython 3.11, x86-64 glibc, like the host),
    downloaded once (``dest/.complete``).

    Raises:
        subprocess.CalledProcessError: pip could not download them (its stderr kept).
    """
    done = dest / ".complete"
    if not done.exists():
        dest.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
               "-d", str(dest)]
        for args in (["--no-deps", OPENENV], SERVER_DEPS):
            subprocess.run(pip + args, check=True, capture_output=True, text=True,
                           timeout=600)
        done.touch()
    return sorted(dest.glob("*.whl"))


def _run(client: Boxd, machine: str, cmd: str, timeout: float = 900) -> None:
    r = client.machines.exec(machine, cmd, timeout=timeout)
    if r.exit_code != 0:
        raise SystemExit(f"{cmd!r} failed in {machine} ({r.exit_code}): {r.stderr[-2000:]}")


def prepare(client: Boxd, snapshot: str, wheels: Path | None = None,
            engine: str | None = None) -> None:
    """Steps 1-3: a machine with the env's server listening, saved as ``snapshot``."""
    m = client.machines.new(f"{snapshot}-prep", engine=engine)
    try:
        client.machines.wait_until_ready(m.id)
        if wheels is None:
            _run(client, m.id, "pip install -q openenv-core")
        else:
            for whl in sorted(wheels.glob("*.whl")):
                client.machines.files.upload(m.id, f"{GUEST_WHEELS}/{whl.name}",
                                             whl.read_bytes())
            _run(client, m.id, f"pip install -q --no-cache-dir --no-index --no-deps "
                               f"{GUEST_WHEELS}/*.whl && rm -rf {GUEST_WHEELS}")
        client.machines.files.upload(m.id, "/home/boxd/counter_env.py",
                                     (HERE / "counter_env.py").read_text())
        _run(client, m.id, SERVE)
        url = client.machines.wait_until_ready(m.id).url
        assert url is not None
        try:
            BoxdProvider(client).wait_for_ready(url, timeout_s=120)
        except TimeoutError as exc:
            log = client.machines.exec(m.id, "tail -c 3000 /tmp/counter_env.server.log").stdout
            raise SystemExit(f"{exc}\nthe server's log:\n{log}") from exc
        client.snapshots.save(m.id, snapshot, new_version=True)
    finally:
        client.machines.delete(m.id)


def session(client: Boxd, counter: Any, snapshot: str, i: int) -> tuple[Any, list[int]]:
    """Step 4 for one client: its own machine, three steps of ``delta = i + 1``."""

    async def go() -> tuple[Any, list[int]]:
        provider = BoxdProvider(client)
        env = await counter.CounterClient.from_docker_image(snapshot, provider=provider)
        try:
            first = (await env.reset()).observation
            counts = [(await env.step(counter.CounterAction(delta=i + 1))).observation.count
                      for _ in range(3)]
            return first, counts
        finally:
            await env.close()  # stop_container: the session's machine is deleted

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--snapshot", default="openenv-counter")
    ap.add_argument("--wheels", type=Path, default=None)
    ap.add_argument("--engine", choices=("qemu", "gvisor"), default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import counter_env as counter  # the client half needs openenv-core on the host too

    with Boxd() as client:
        try:
            prepare(client, args.snapshot, args.wheels, args.engine)
        except errors.BoxdError as exc:
            raise SystemExit(f"preparing the snapshot failed: {exc}") from exc
        with concurrent.futures.ThreadPoolExecutor(args.sessions) as pool:
            results = list(pool.map(lambda i: session(client, counter, args.snapshot, i),
                                    range(args.sessions)))
    firsts = [first for first, _ in results]
    for i, (first, counts) in enumerate(results):
        print(f"session {i}: first observation nonce={first.nonce:.12f} count={first.count}"
              f", counts after 3 steps of {i + 1}: {counts}")
    same = all(f == firsts[0] for f in firsts)
    print(f"same first observation in all {len(results)} sessions: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
