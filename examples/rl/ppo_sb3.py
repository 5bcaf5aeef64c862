"""Train PPO (Stable-Baselines3) on CartPole whose environments run in boxd machines.

    pip install 'boxd[sb3]' torch==2.13.0      # a CPU build of torch
    boxd machine new rl-base
    boxd machine exec rl-base -- 'pip install gymnasium numpy cloudpickle'
    python3 ppo_sb3.py --source rl-base --envs 4 --steps 4096

Each sub-env is its own fork of ``rl-base``: an env server in the machine builds
``CartPole-v1`` once and answers reset/step over a framed stream; the four forks step
concurrently. Two runs with the same ``--seed`` end with identical weights (the
environments start from the same bytes and are seeded per sub-env).
"""

from __future__ import annotations

import argparse
import hashlib
import time

from stable_baselines3 import PPO

from boxd.rl.sb3 import VecEnv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="rl-base", help="the warm baseline machine")
    p.add_argument("--env", default="CartPole-v1")
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--steps", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    t0 = time.perf_counter()
    venv = VecEnv(args.env, args.envs, source=args.source)
    try:
        print(f"{args.envs} envs in machines {venv.machines} ({time.perf_counter() - t0:.1f} s)")
        model = PPO("MlpPolicy", venv, n_steps=256, batch_size=64, seed=args.seed,
                    device="cpu", verbose=0)
        t1 = time.perf_counter()
        model.learn(total_timesteps=args.steps)
        wall = time.perf_counter() - t1
        digest = hashlib.sha256(b"".join(
            v.cpu().numpy().tobytes() for v in model.policy.state_dict().values())).hexdigest()
        print(f"trained {args.steps} steps in {wall:.1f} s ({args.steps / wall:.0f} steps/s)")
        print(f"weights sha256 {digest[:16]} (same seed, same digest)")
    finally:
        venv.close()


if __name__ == "__main__":
    main()
