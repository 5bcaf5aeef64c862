"""What the installed Gymnasium's `SyncVectorEnv` raises for a bad call.

boxd supports ``gymnasium>=1.0``, and Gymnasium changed these errors between versions:
1.3's `SyncVectorEnv` asserts (``AssertionError``, ``options['reset_mask': mask]``
messages) where 1.4 raises ``TypeError``, ``ValueError`` or ``RuntimeError`` with other
messages. Rather than keep a table of versions, `boxd.rl.VectorEnv` checks a call
itself and, when it is bad, replays it against the installed `SyncVectorEnv` over
stand-in envs (in process: no machine, no I/O) and raises what that raised. Only bad
calls pay for the replay.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv


class _StandIn(gym.Env[Any, Any]):
    """An env with the given spaces that accepts every call."""

    def __init__(self, observation_space: gym.Space[Any], action_space: gym.Space[Any]) -> None:
        self.observation_space = observation_space
        self.action_space = action_space

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        return self.observation_space.sample(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        return self.observation_space.sample(), 0.0, False, False, {}


def _raised(call: Any) -> BaseException | None:
    try:
        call()
    except Exception as exc:  # what Gymnasium raised, without its stand-in frames
        return exc.with_traceback(None)
    return None


def spaces_error(sub_spaces: Sequence[tuple[gym.Space[Any], gym.Space[Any]]]
                 ) -> BaseException | None:
    """What `SyncVectorEnv` raises for sub-envs with these (observation, action)
    spaces; None if it accepts them."""

    def build() -> None:
        SyncVectorEnv([functools.partial(_StandIn, o, a) for o, a in sub_spaces]).close()

    return _raised(build)


def reset_error(num_envs: int, seed: Any, options: Any) -> BaseException | None:
    """What ``SyncVectorEnv(...).reset(seed=seed, options=options)`` raises with
    ``num_envs`` sub-envs; None if it accepts the call. ``options`` is not changed."""
    one = spaces.Discrete(1)
    env = SyncVectorEnv([functools.partial(_StandIn, one, one)] * num_envs)
    try:
        copied = dict(options) if isinstance(options, dict) else options
        return _raised(lambda: env.reset(seed=seed, options=copied))
    finally:
        env.close()


__all__ = ["reset_error", "spaces_error"]
