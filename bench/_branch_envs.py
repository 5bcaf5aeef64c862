"""The env bench_branch.py branches (shipped into machines by value): CartPole with an
optional fixed cost per step (``step_ms``, a sleep standing in for a simulator's work)."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym


class SlowCartPole(gym.Wrapper[Any, Any, Any, Any]):
    """CartPole-v1 whose every ``step`` costs ``step_ms`` more milliseconds."""

    def __init__(self, step_ms: float = 0.0) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.step_s = step_ms / 1000.0

    def step(self, action: Any) -> Any:
        if self.step_s:
            time.sleep(self.step_s)
        return self.env.step(action)


def make(step_ms: float = 0.0) -> SlowCartPole:
    return SlowCartPole(step_ms)
