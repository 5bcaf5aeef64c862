"""Test envs for boxd.rl, shipped to env servers with ``pickle_by_value``."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class CountEnv(gym.Env[np.int64, np.int64]):
    """Observation = a counter: ``reset(seed=s)`` sets it to ``s`` (0 unseeded), each step
    adds 1; the episode terminates when the counter reaches a multiple of ``ends``
    (truncates instead when ``truncate``). Infos carry every kind of value the vector
    env batches: ints, floats, bools, arrays, strings, nested dicts, and keys that only
    some steps have. ``n_obs`` and ``n_actions`` size its spaces (vectorisers refuse
    sub-envs whose spaces differ)."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, ends: int = 4, truncate: bool = False,
                 render_mode: str | None = None, delay: float = 0.0,
                 n_obs: int = 1000, n_actions: int = 3) -> None:
        self.delay = delay
        self.observation_space = spaces.Discrete(n_obs)
        self.action_space = spaces.Discrete(n_actions)
        self.ends = ends
        self.truncate = truncate
        self.render_mode = render_mode
        self.count = 0
        self.tag = "initial"

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.int64, dict[str, Any]]:
        super().reset(seed=seed)
        self.count = seed if seed is not None else 0
        info: dict[str, Any] = {"reset_count": self.count}
        if options:
            info["options"] = dict(options)
        return np.int64(self.count), info

    def step(self, action: Any) -> tuple[np.int64, float, bool, bool, dict[str, Any]]:
        if self.delay:
            time.sleep(self.delay)
        self.count += 1
        done = self.count % self.ends == 0
        info: dict[str, Any] = {
            "action": int(action), "half": self.count / 2, "even": self.count % 2 == 0,
            "vec": np.full(2, self.count, dtype=np.float32), "name": f"c{self.count}",
            "nested": {"count": self.count},
        }
        if self.count % 3 == 0:
            info["third"] = np.int32(self.count)
        return (np.int64(self.count), float(action), done and not self.truncate,
                done and self.truncate, info)

    def render(self) -> np.ndarray[Any, Any]:
        return np.full((2, 2, 3), self.count % 256, dtype=np.uint8)

    def double(self, x: int) -> int:
        return 2 * x


class BoxEnv(gym.Env[tuple[Any, ...], np.ndarray[Any, Any]]):
    """Tuple/Dict observations with float32 and int8 parts (dtype and container checks);
    with ``tuple_obs=False`` a Dict only (what SB3 supports)."""

    def __init__(self, tuple_obs: bool = True) -> None:
        inner = spaces.Dict({"k": spaces.Discrete(5), "m": spaces.MultiBinary(4)})
        self.tuple_obs = tuple_obs
        self.observation_space: spaces.Space[Any] = (
            spaces.Tuple((spaces.Box(-1.0, 1.0, (3,), dtype=np.float32), inner)) if tuple_obs
            else inner)
        self.action_space = spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        super().reset(seed=seed)
        return self._obs(), {}

    def _obs(self) -> tuple[Any, ...]:
        rng = self.np_random  # seeded by reset(seed=...): deterministic, as checkers demand
        box = rng.uniform(-1, 1, 3).astype(np.float32)
        inner = {"k": np.int64(rng.integers(5)), "m": rng.integers(0, 2, 4).astype(np.int8)}
        return (box, inner) if self.tuple_obs else inner  # type: ignore[return-value]

    def step(self, action: Any) -> tuple[tuple[Any, ...], float, bool, bool, dict[str, Any]]:
        reward = float(np.sum(action))
        return self._obs(), reward, bool(self.np_random.random() < 0.1), False, {}


class ClockEnv(gym.Env[np.ndarray[Any, Any], np.int64]):
    """Deterministic until step ``reads_at``, where it puts the wall clock into its
    observation (what `boxd.rl.verify` must catch and name)."""

    def __init__(self, reads_at: int = 7) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, (1,), dtype=np.float64)
        self.action_space = spaces.Discrete(2)
        self.reads_at = reads_at
        self.t = 0

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray[Any, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1), {}

    def step(self, action: Any) -> tuple[np.ndarray[Any, Any], float, bool, bool, dict[str, Any]]:
        self.t += 1
        value = time.time_ns() % 1_000_003 if self.t == self.reads_at else self.t
        return np.array([float(value)]), 1.0, False, self.t >= 50, {}


class CrashEnv(CountEnv):
    """Raises in ``step`` once the counter reaches ``crash_at``."""

    def __init__(self, crash_at: int = 2) -> None:
        super().__init__(ends=100)
        self.crash_at = crash_at

    def step(self, action: Any) -> tuple[np.int64, float, bool, bool, dict[str, Any]]:
        if self.count + 1 >= self.crash_at:
            raise ValueError(f"crash at {self.count + 1}")
        return super().step(action)


class MarkEnv(CountEnv):
    """A `CountEnv` whose ``step`` appends its counter, one line, to the file ``marks``:
    the host sees when the env server stepped (issue 39: `step_async` sends)."""

    def __init__(self, marks: str, delay: float = 0.0) -> None:
        super().__init__(ends=100, delay=delay)
        self.marks = marks

    def step(self, action: Any) -> tuple[np.int64, float, bool, bool, dict[str, Any]]:
        out = super().step(action)
        with open(self.marks, "a") as f:
            f.write(f"{self.count}\n")
        return out
