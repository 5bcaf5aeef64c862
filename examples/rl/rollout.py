"""Run one seeded CartPole episode and print its trajectory record.

    python3 rollout.py --seed 42

stdout is one line of canonical JSON, identical for the same seed on every fork of the
same baseline::

    {"actions":"<sha256 of the actions>","obs":"<sha256 of the observations>",
     "reward":23.0,"seed":42,"steps":23,"sha256":"<sha256 of the fields before it>"}

If ``warm_up.py`` left its worker running (the usual case inside a fork of a warmed
baseline), the episode is handed to that already-warm Python process over a unix
socket, so this script imports only the standard library and the rollout costs the
episode, not ~1.5 s of ``import gymnasium, numpy`` under software emulation. Otherwise
the episode runs in this process. Both paths run the same ``episode()`` below and print
the same bytes; which path ran, and how long it took, goes to stderr.

Only the policy's choices depend on the seed: ``env.reset(seed=seed)`` fixes the start
state and a ``numpy.random.Generator`` seeded with ``seed`` drives exploration. The
policy weights come from a fixed seed (``POLICY_SEED``), standing in for trained weights.
Nothing reads the clock, the network or an unseeded RNG.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from typing import Any

ENV_ID = "CartPole-v1"
POLICY_SEED = 1234  # the "trained weights" (must match warm_up.py)
SOCKET = os.environ.get("RL_WORKER_SOCKET", "/run/rl-worker.sock")
MAX_STEPS = 500


def make_policy(np: Any) -> Any:
    """The policy's weights: a fixed-seed linear map from observation to action logit."""
    return np.random.default_rng(POLICY_SEED).normal(0.0, 1.0, size=4)


def episode(seed: int, env: Any, weights: Any, np: Any) -> dict[str, Any]:
    """One episode from ``env.reset(seed=seed)`` under the seeded stochastic policy.

    ``env``, ``weights`` and ``np`` are passed in so the warm worker can run this with
    the objects it already holds.
    """
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    actions = bytearray()
    observations = hashlib.sha256(np.asarray(obs, dtype=np.float32).tobytes())
    total = 0.0
    steps = 0
    for _ in range(MAX_STEPS):
        p_right = 1.0 / (1.0 + np.exp(-3.0 * float(obs @ weights)))
        action = int(rng.random() < p_right)
        obs, reward, terminated, truncated, _ = env.step(action)
        actions.append(action)
        observations.update(np.asarray(obs, dtype=np.float32).tobytes())
        total += float(reward)
        steps += 1
        if terminated or truncated:
            break
    return {
        "seed": seed,
        "steps": steps,
        "reward": total,
        "actions": hashlib.sha256(bytes(actions)).hexdigest(),
        "obs": observations.hexdigest(),
    }


def format_record(record: dict[str, Any]) -> str:
    """Canonical JSON of the record plus the sha256 of that JSON."""
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(body.encode()).hexdigest()
    return body[:-1] + f',"sha256":"{digest}"}}'


def run_in_process(seed: int) -> dict[str, Any]:
    import gymnasium as gym
    import numpy as np

    env = gym.make(ENV_ID)
    try:
        return episode(seed, env, make_policy(np), np)
    finally:
        env.close()


def run_in_worker(seed: int, timeout: float = 60.0) -> dict[str, Any] | None:
    """Ask the warm worker to run the episode; None if no worker answers."""
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(SOCKET)
    except OSError:
        return None
    with s:
        request = {"op": "episode", "seed": seed, "script": os.path.abspath(__file__)}
        s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data)
    if "error" in reply:
        raise RuntimeError(f"warm worker: {reply['error']}")
    record: dict[str, Any] = reply["record"]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--no-worker", action="store_true", help="always run in this process")
    args = parser.parse_args(argv)
    start = time.monotonic()
    record = None if args.no_worker else run_in_worker(args.seed)
    path = "warm worker"
    if record is None:
        path = "in process"
        record = run_in_process(args.seed)
    print(format_record(record), flush=True)
    print(f"rollout: seed={args.seed} via {path} in {time.monotonic() - start:.3f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
