"""Lookahead search with `boxd.rl.Env.branch`, against replaying from reset.

    pip install 'boxd[rl]'
    python3 lookahead.py --source rl-base --prefix 100 --decisions 4 --horizon 4

The episode starts with ``--prefix`` steps of a seeded random walk; then, at each
decision, the env is branched once per action; each branch takes its action
and rolls out ``horizon - 1`` more steps; the action of the best rollout is taken in
the original env. The env keeps part of its state outside the simulator: the cells
it has visited are in a file in the machine (``/tmp/lookahead.visited``), and only a
newly visited cell pays. A branch is a fork of the machine, so it has the file as it
was; no env code saves or restores anything.

Without branching, the same search replays each candidate from ``reset`` (whose
reset clears the file): the whole prefix again, for every action at every decision.
Both searches make the same decisions (the env is deterministic); the script prints
both wall times. Steps cost ``--step-seconds`` of simulated work, as a real simulator's
do: replay's cost grows with the square of the episode's length, branching's with its
length (a fork per candidate instead of the prefix).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gymnasium as gym
import numpy as np

import boxd.rl

VISITED = "/tmp/lookahead.visited"


class VisitEnv(gym.Env[np.ndarray, int]):
    """A walk on a line of ``size`` cells between two walls: 0 left, 1 stay, 2 right. A
    new cell pays 1, an old one -0.1; which cells are old is in a file, not in the
    observation."""

    observation_space = gym.spaces.Box(0, 1000, (1,), np.int64)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, size: int = 40, step_seconds: float = 0.05) -> None:
        self.size, self.step_seconds, self.pos = size, step_seconds, 0

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.pos = int(self.np_random.integers(self.size))
        with open(VISITED, "w") as f:
            f.write(f"{self.pos}\n")
        return np.array([self.pos]), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        time.sleep(self.step_seconds)  # the simulator's work
        self.pos = min(self.size - 1, max(0, self.pos + int(action) - 1))
        with open(VISITED) as f:
            seen = {int(x) for x in f.read().split()}
        reward = -0.1 if self.pos in seen else 1.0
        with open(VISITED, "a") as f:
            f.write(f"{self.pos}\n")
        return np.array([self.pos]), reward, False, False, {"pid": os.getpid()}


def rollout(env: Any, first: int, horizon: int) -> float:
    """The return of ``first`` then ``horizon - 1`` repeats of it (a simple default
    policy: keep going)."""
    return sum(float(env.step(first)[1]) for _ in range(horizon))


def search_by_branching(env: Any, prefix: list[int], decisions: int,
                        horizon: int) -> list[int]:
    for a in prefix:
        env.step(a)
    taken: list[int] = []
    with ThreadPoolExecutor(3) as pool:
        for _ in range(decisions):
            branches = env.branch(3)
            scores = list(pool.map(lambda ab: rollout(ab[1], ab[0], horizon),
                                   enumerate(branches)))
            for b in branches:
                pool.submit(b.close)
            best = int(np.argmax(scores))
            env.step(best)
            taken.append(best)
    return taken


def search_by_replay(env: Any, seed: int, prefix: list[int], decisions: int,
                     horizon: int) -> list[int]:
    taken: list[int] = []
    for _ in range(decisions):
        scores = []
        for a in range(3):
            env.reset(seed=seed)
            for prev in prefix + taken:
                env.step(prev)
            scores.append(rollout(env, a, horizon))
        taken.append(int(np.argmax(scores)))
    return taken


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="rl-base")
    p.add_argument("--prefix", type=int, default=100)
    p.add_argument("--decisions", type=int, default=4)
    p.add_argument("--horizon", type=int, default=4)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)

    def make() -> VisitEnv:
        return VisitEnv(step_seconds=args.step_seconds)

    prefix = [int(a) for a in np.random.default_rng(args.seed).integers(0, 3, args.prefix)]
    out: dict[str, Any] = {}
    env = boxd.rl.Env(make, source=args.source)
    try:
        env.reset(seed=args.seed)
        t0 = time.perf_counter()
        out["branch_actions"] = search_by_branching(env, prefix, args.decisions,
                                                    args.horizon)
        out["branch_seconds"] = time.perf_counter() - t0
    finally:
        env.close()
    env = boxd.rl.Env(make, source=args.source)
    try:
        t0 = time.perf_counter()
        out["replay_actions"] = search_by_replay(env, args.seed, prefix, args.decisions,
                                                 args.horizon)
        out["replay_seconds"] = time.perf_counter() - t0
    finally:
        env.close()
    print(f"lookahead after {args.prefix} steps, {args.decisions} decisions x 3 actions "
          f"x {args.horizon} steps ({args.step_seconds * 1e3:.0f} ms a step):")
    print(f"  branching:          {out['branch_seconds']:7.2f} s")
    print(f"  replay from reset:  {out['replay_seconds']:7.2f} s "
          f"({out['replay_seconds'] / out['branch_seconds']:.2f}x)")
    print(f"  same decisions: {out['branch_actions'] == out['replay_actions']}")
    return out


if __name__ == "__main__":
    main()
