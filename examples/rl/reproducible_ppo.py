"""Reproducible training, shown: three SB3 PPO runs over boxd machines, two with one
seed and one with another. The two same-seed runs end with bit-identical weights; the
other seed's differ.

    pip install 'boxd[sb3]' torch==2.13.0      # a CPU build of torch
    boxd machine new rl-base
    boxd machine exec rl-base -- 'pip install gymnasium numpy cloudpickle'
    python3 reproducible_ppo.py --source rl-base                  # CartPole-v1
    # MuJoCo: boxd machine exec rl-base -- 'pip install "gymnasium[mujoco]"'
    python3 reproducible_ppo.py --source rl-base --env HalfCheetah-v5 --steps 2048

Each run forks its sub-envs from ``--source``: every environment starts from the same
bytes, is seeded per sub-env (``seed + i``), and PPO itself is seeded (torch on one CPU
thread: its parallel reductions are not bitwise stable across thread counts). Exits 0
when the same seed gave the same weights and another seed other weights, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from typing import Any


def train(source: str, env: str, envs: int, steps: int, seed: int, boxd: Any = None) -> str:
    """One PPO run; the sha256 of its final weights."""
    import torch
    from stable_baselines3 import PPO

    from boxd.rl.sb3 import VecEnv

    torch.set_num_threads(1)
    venv = VecEnv(env, envs, source=source, boxd=boxd)
    try:
        model = PPO("MlpPolicy", venv, n_steps=max(8, min(256, steps // envs)), batch_size=64,
                    n_epochs=2, seed=seed, device="cpu", policy_kwargs={"net_arch": [32]})
        model.learn(total_timesteps=steps)
        state = model.policy.state_dict()
        return hashlib.sha256(b"".join(state[k].cpu().numpy().tobytes()
                                       for k in sorted(state))).hexdigest()
    finally:
        venv.close()


def main(argv: list[str] | None = None, boxd: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="rl-base", help="the warm baseline machine")
    p.add_argument("--env", default="CartPole-v1")
    p.add_argument("--envs", type=int, default=2)
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--other-seed", type=int, default=1)
    args = p.parse_args(argv)

    digests = []
    for run, seed in enumerate((args.seed, args.seed, args.other_seed), 1):
        t0 = time.perf_counter()
        digests.append(train(args.source, args.env, args.envs, args.steps, seed, boxd))
        print(f"run {run}: seed {seed}, {args.steps} steps of {args.env} in "
              f"{time.perf_counter() - t0:.1f} s, weights sha256 {digests[-1][:16]}")
    same, other = digests[0] == digests[1], digests[0] != digests[2]
    print(f"same seed, same weights: {'yes' if same else 'NO'}; "
          f"another seed, other weights: {'yes' if other else 'NO'}")
    return 0 if same and other else 1


if __name__ == "__main__":
    sys.exit(main())
