"""Envs that leak: what `boxd.rl.verify` must catch and name (shipped to env servers
with ``pickle_by_value``)."""

from __future__ import annotations

import os
from time import perf_counter_ns as _bound_clock  # bound at import: the trace can't see it
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class UrandomEnv(gym.Env[np.ndarray[Any, Any], np.int64]):
    """Seeded and deterministic, except that step ``reads_at`` puts bytes of
    ``os.urandom`` (the kernel RNG, reseeded at every fork) into its observation."""

    def __init__(self, reads_at: int = 5) -> None:
        self.observation_space = spaces.Box(0, 255, (4,), dtype=np.uint8)
        self.action_space = spaces.Discrete(2)
        self.reads_at = reads_at
        self.t = 0

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray[Any, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return self._seeded(), {}

    def _seeded(self) -> np.ndarray[Any, Any]:
        return self.np_random.integers(0, 256, 4, dtype=np.uint8)

    def step(self, action: Any) -> tuple[np.ndarray[Any, Any], float, bool, bool, dict[str, Any]]:
        self.t += 1
        if self.t == self.reads_at:
            obs = np.frombuffer(os.urandom(4), dtype=np.uint8).copy()
        else:
            obs = self._seeded()
        return obs, float(action), False, self.t >= 50, {}


class ConstantEnv(gym.Env[np.int64, np.int64]):
    """Ignores its seed: every seed gives the one trajectory (reproducible, and
    useless as evidence of it)."""

    observation_space = spaces.Discrete(100)
    action_space = spaces.Discrete(1)

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.int64, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.int64(0), {}

    def step(self, action: Any) -> tuple[np.int64, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return np.int64(self.t), 1.0, self.t >= 10, False, {}


class BoundClockEnv(gym.Env[np.ndarray[Any, Any], np.int64]):
    """Puts a timer into step ``reads_at``'s observation through a function bound at
    import, which the verifier's trace cannot see: its fallback (a rewound replay,
    with machines) has to find the cause."""

    observation_space = spaces.Box(-np.inf, np.inf, (1,), dtype=np.float64)
    action_space = spaces.Discrete(2)

    def __init__(self, reads_at: int = 5) -> None:
        self.reads_at = reads_at
        self.t = 0

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray[Any, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1), {}

    def step(self, action: Any) -> tuple[np.ndarray[Any, Any], float, bool, bool, dict[str, Any]]:
        self.t += 1
        value = _bound_clock() % 1_000_003 if self.t == self.reads_at else self.t
        return np.array([float(value)]), 1.0, False, self.t >= 50, {}
