"""Branching an episode (issue 26): a fork of the env's machine against replaying.

    python bench/bench_branch.py
    BOXD_HOME=/tmp/bh-qemu BOXD_ENGINE=qemu python bench/bench_branch.py   # the other engine

On the daemon's default engine, against one warm source (gymnasium, numpy, cloudpickle
from the host's wheels, as bench_rl.py makes it), for CartPole and for CartPole with a
5 ms step (``_branch_envs.SlowCartPole``, a sleep standing in for a simulator's work):

- **branch**: an env stepped to step ``BENCH_BRANCH_AT`` (100) by a balancing policy;
  ``env.branch(K)`` (8) timed, each round, the branches closed after;
- **replay** (the baseline, same run, alternating): the way to get K envs at that
  moment without branching: a `VectorEnv` of K sub-envs (already open) reset with the
  same seed and stepped ``AT`` times with the same policy;
- ``Env.branch(1)``, ``Env.save()`` and ``Env.load()`` alone, p50/p90.

``BENCH_BRANCH_N`` (5) rounds of each. Figures in docs/benchmarks.md ("branching").
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _branch_envs
from _common import Row, row_from, say, standalone
from bench_rl import _accel, _prepare_source

GROUP = "branch"
N = int(os.environ.get("BENCH_BRANCH_N", "5"))
K = int(os.environ.get("BENCH_BRANCH_K", "8"))
AT = int(os.environ.get("BENCH_BRANCH_AT", "100"))
SEED = 3


def _policy(obs: Any) -> int:
    """Keeps CartPole up for hundreds of steps: push the way the pole falls."""
    return int(obs[2] + obs[3] > 0)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.monotonic()
    out = fn()
    return time.monotonic() - t, out


def _case(client: Any, source: str, step_ms: float, tell: Callable[[str], None]) -> list[Row]:
    import numpy as np

    import boxd.rl as rl

    label = f"CartPole, {step_ms:g} ms step" if step_ms else "CartPole"
    kw = {"step_ms": step_ms}
    env = rl.Env(_branch_envs.make, source=source, boxd=client,
                 pickle_by_value=[_branch_envs], **kw)
    venv = rl.VectorEnv([lambda: _branch_envs.make(step_ms)] * K, source=source,
                        boxd=client, pickle_by_value=[_branch_envs])
    branch_k, replay, branch_1, save, load = [], [], [], [], []
    try:
        accel = _accel(client, str(env.machine))
        for r in range(N):
            tell(f"bench_branch: {label}, round {r + 1}/{N}")
            obs, _ = env.reset(seed=SEED)
            for _ in range(AT):
                obs, _, term, trunc, _ = env.step(_policy(obs))
                assert not (term or trunc), "the policy let the pole fall before AT"
            dt, kids = _timed(lambda: env.branch(K))
            branch_k.append(dt)
            for kid in kids:
                kid.close()

            def replay_once() -> None:
                vobs, _ = venv.reset(seed=SEED)
                for _ in range(AT):
                    vobs, *_ = venv.step(np.array([_policy(o) for o in vobs]))

            replay.append(_timed(replay_once)[0])
            dt, (one,) = _timed(lambda: env.branch(1))
            branch_1.append(dt)
            one.close()
            dt, state = _timed(env.save)
            save.append(dt)
            env.step(0)
            load.append(_timed(lambda s=state: env.load(s))[0])
            state.delete()
    finally:
        with contextlib.suppress(Exception):
            env.close()
        with contextlib.suppress(Exception):
            venv.close()
    return [
        row_from(GROUP, f"{label}: branch({K}) at step {AT}", branch_k, accel=accel,
                 baseline=f"replay {AT} steps in {K} envs", baseline_values=replay,
                 note="K envs at the moment of step AT"),
        row_from(GROUP, f"{label}: replay, reset + {AT} steps of a {K}-env VectorEnv",
                 replay, accel=accel, note="the baseline: envs already open"),
        row_from(GROUP, f"{label}: Env.branch(1)", branch_1, accel=accel),
        row_from(GROUP, f"{label}: Env.save()", save, accel=accel),
        row_from(GROUP, f"{label}: Env.load()", load, accel=accel),
    ]


def run(client: Any | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    from boxd import Boxd

    tell = log or say
    own = client is None
    c = client if client is not None else Boxd()
    source, made = _prepare_source(c, tell)
    try:
        return _case(c, source, 0.0, tell) + _case(c, source, 5.0, tell)
    finally:
        if made:
            with contextlib.suppress(Exception):
                c.machines.delete(source)
        if own:
            c.close()


if __name__ == "__main__":
    standalone(run)
