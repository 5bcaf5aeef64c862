"""Serve N concurrent OpenEnv sessions from an environment's Dockerfile.

The image recipe of docs/openenv.md, end to end:

1. this folder (``Dockerfile``, ``counter_env.py`` and ``wheels/``: openenv-core and
   what its server imports) is built with ``boxd image build`` into a boxd image whose
   CMD serves the env on port 8000 (as OpenEnv's images do);
2. N unmodified ``CounterClient`` sessions call ``from_docker_image(IMAGE,
   provider=BoxdProvider())`` at once: the first starts the image as a baseline
   machine (the others wait for it), and every session is a fork of it;
3. every session's first observation is the same (the server's nonce, drawn when it
   started in the baseline, is in every fork's memory), and each sees only its steps.

    python examples/openenv/serve_image.py --sessions 4 [--engine gvisor]
    python examples/openenv/serve_image.py --wheels-only    # just fill wheels/

The Dockerfile's FROM is ``python:3.11-slim`` from boxd's store (``boxd image import``
it once). The baseline stays after the sessions (the next run forks it again):
``boxd machine delete openenv-<12 hex of the image digest>`` removes it.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import shutil
import sys
from pathlib import Path
from typing import Any

from boxd import Boxd, errors, models
from boxd.openenv import BoxdProvider

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve_sessions import download_wheels  # noqa: E402 - this folder's recipe

#: What the build context holds besides ``wheels/``.
CONTEXT_FILES = ("Dockerfile", ".dockerignore", "counter_env.py")


def build_context(dest: Path, wheels: Path) -> Path:
    """A build context at ``dest``: this folder's Dockerfile and env, and the wheels in
    ``wheels`` (``download_wheels``) under ``wheels/``."""
    (dest / "wheels").mkdir(parents=True, exist_ok=True)
    for name in CONTEXT_FILES:
        shutil.copy2(HERE / name, dest / name)
    for whl in sorted(wheels.glob("*.whl")):
        shutil.copy2(whl, dest / "wheels" / whl.name)
    return dest


def build(client: Boxd, image: str, context: Path) -> models.Image:
    """Step 1: ``boxd image build -t IMAGE CONTEXT``."""
    return client.images.build(context, image)


def session(client: Boxd, counter: Any, image: str, i: int,
            engine: str | None = None) -> tuple[Any, list[int], str | None]:
    """Step 2 for one client: a fork of the image's baseline, three steps of
    ``delta = i + 1``; its first observation, its counts and the baseline's id."""

    async def go() -> tuple[Any, list[int], str | None]:
        provider = BoxdProvider(client, engine=engine)
        env = await counter.CounterClient.from_docker_image(image, provider=provider)
        try:
            first = (await env.reset()).observation
            counts = [(await env.step(counter.CounterAction(delta=i + 1))).observation.count
                      for _ in range(3)]
            return first, counts, provider.baseline
        finally:
            await env.close()  # stop_container: the session's fork is deleted

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--image", default="openenv-counter:v1")
    ap.add_argument("--engine", choices=("qemu", "gvisor"), default=None)
    ap.add_argument("--wheels-only", action="store_true")
    args = ap.parse_args(argv)
    download_wheels(HERE / "wheels")
    if args.wheels_only:
        return 0
    import counter_env as counter  # the client half needs openenv-core on the host too

    with Boxd() as client:
        try:
            build(client, args.image, HERE)
        except errors.BoxdError as exc:
            raise SystemExit(f"building the image failed: {exc}") from exc
        with concurrent.futures.ThreadPoolExecutor(args.sessions) as pool:
            results = list(pool.map(
                lambda i: session(client, counter, args.image, i, args.engine),
                range(args.sessions)))
    firsts = [first for first, _, _ in results]
    for i, (first, counts, _) in enumerate(results):
        print(f"session {i}: first observation nonce={first.nonce:.12f} count={first.count}"
              f", counts after 3 steps of {i + 1}: {counts}")
    print(f"baseline machine: {results[0][2]}")
    same = all(f == firsts[0] for f in firsts)
    print(f"same first observation in all {len(results)} sessions: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
