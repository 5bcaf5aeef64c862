"""A Gymnasium vector env whose sub-envs run in boxd machines, stepped concurrently.

    pip install 'boxd[rl]'
    python3 vector_env.py --source rl-base --envs 4

``boxd.rl.VectorEnv`` takes ``env_fns`` like ``SyncVectorEnv`` (each callable is
shipped to its machine with cloudpickle) or an env id and ``num_envs``, and follows
Gymnasium 1.x exactly: here SAME_STEP autoreset, so a finished sub-env is reset in the
step that ends it and ``infos["final_obs"]`` holds its last observation. Registered as
a vector entry point, ``gym.make_vec`` builds it too.
"""

from __future__ import annotations

import argparse
import functools
import time

import gymnasium as gym
import numpy as np

import boxd.rl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="rl-base")
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()

    gym.register("BoxdCartPole-v1", vector_entry_point=functools.partial(
        boxd.rl.VectorEnv, "CartPole-v1", source=args.source,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP))
    envs = gym.make_vec("BoxdCartPole-v1", num_envs=args.envs)
    try:
        envs.reset(seed=42)
        episodes, t0 = 0, time.perf_counter()
        for _ in range(args.steps):
            *_, infos = envs.step(envs.action_space.sample())
            if "_final_obs" in infos:
                episodes += int(np.sum(infos["_final_obs"]))
        wall = time.perf_counter() - t0
        print(f"{args.steps} vector steps of {args.envs} envs in {wall:.2f} s "
              f"({args.steps * args.envs / wall:.0f} env steps/s), {episodes} episodes ended")
    finally:
        envs.close()


if __name__ == "__main__":
    main()
