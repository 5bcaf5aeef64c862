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

# Only what the warm-worker path needs is imported at the top: under software
# emulation every module costs milliseconds (argparse alone ~150 ms), and the point of
# the warm worker is that a rollout pays for its episode, not for imports.
import os
import sys
import time

TYPE_CHECKING = False  # typing costs ~50 ms to import under emulation
if TYPE_CHECKING:
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
    import hashlib

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
    import hashlib
    import json

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


def run_in_worker(seed: int, timeout: float = 60.0) -> str | None:
    """Ask the warm worker to run the episode: its formatted record, or None if no
    worker answers.

    The protocol is one line each way: ``episode SEED SCRIPT`` and then ``ok RECORD``
    or ``error MESSAGE``. ``_socket`` rather than ``socket`` saves the enum import.
    """
    import _socket

    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(SOCKET)
    except OSError:
        s.close()
        return None
    try:
        s.sendall(f"episode {seed} {os.path.abspath(__file__)}\n".encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    status, _, rest = data.decode().rstrip("\n").partition(" ")
    if status != "ok":
        raise RuntimeError(f"warm worker: {rest or 'no answer'}")
    return rest


def parse_args(argv: list[str]) -> tuple[int, bool]:
    """``--seed N`` (or ``--seed=N``) and ``--no-worker``, without argparse's import."""
    seed: int | None = None
    no_worker = False
    it = iter(argv)
    for arg in it:
        if arg == "--seed":
            seed = int(next(it, ""))
        elif arg.startswith("--seed="):
            seed = int(arg.split("=", 1)[1])
        elif arg == "--no-worker":
            no_worker = True
        else:
            sys.exit(f"usage: rollout.py --seed N [--no-worker]  (unknown argument {arg!r})")
    if seed is None:
        sys.exit("usage: rollout.py --seed N [--no-worker]")
    return seed, no_worker


def main(argv: list[str] | None = None) -> int:
    seed, no_worker = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    line = None if no_worker else run_in_worker(seed)
    path = "warm worker"
    if line is None:
        path = "in process"
        line = format_record(run_in_process(seed))
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    print(f"rollout: seed={seed} via {path} in {time.monotonic() - start:.3f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
