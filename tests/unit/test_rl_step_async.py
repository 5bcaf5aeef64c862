"""`step_async` sends, `step_wait` collects (boxd.rl.VectorEnv and boxd.rl.sb3.VecEnv,
on local env servers): the sub-envs step while the learner works between the two, as
in Gymnasium's `AsyncVectorEnv` and SB3's `SubprocVecEnv` (issue 39)."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from tests._support import rl_envs as _rl_envs

import boxd.rl as rl


def _stepped(marks: Path, lines: int, within: float = 20.0) -> list[str]:
    """The marks once ``lines`` steps were written (waiting up to ``within`` s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = marks.read_text().split() if marks.exists() else []
        if len(got) >= lines:
            return got
        time.sleep(0.02)
    return marks.read_text().split() if marks.exists() else []


def _vector(kind: str, fns: list[Any], **kw: Any) -> Any:
    if kind == "gymnasium":
        return rl.VectorEnv(fns, source=rl.local(), pickle_by_value=[_rl_envs], **kw)
    from boxd.rl.sb3 import VecEnv

    return VecEnv(fns, source=rl.local(), pickle_by_value=[_rl_envs], **kw)


@pytest.mark.parametrize(("kind", "envs_per_machine"), [
    ("gymnasium", 1), ("gymnasium", 2), ("sb3", 1)])
def test_step_async_sends_the_step_before_step_wait(tmp_path: Path, kind: str,
                                                   envs_per_machine: int) -> None:
    marks = tmp_path / "marks"
    env = _vector(kind, [functools.partial(_rl_envs.MarkEnv, str(marks))] * 3,
                  envs_per_machine=envs_per_machine)
    try:
        env.reset()
        env.step_async(np.zeros(3, dtype=np.int64))
        # every env server stepped while no step_wait was called
        assert _stepped(marks, 3) == ["1", "1", "1"]
        obs = env.step_wait()[0]
        assert obs.tolist() == [1, 1, 1]
        env.step_async(np.zeros(3, dtype=np.int64))
        assert _stepped(marks, 6)[3:] == ["2", "2", "2"]
        assert env.step_wait()[0].tolist() == [2, 2, 2]
    finally:
        env.close()


@pytest.mark.parametrize("kind", ["gymnasium", "sb3"])
def test_a_sub_env_failure_surfaces_at_step_wait(kind: str) -> None:
    env = _vector(kind, [functools.partial(_rl_envs.CrashEnv, 1)] * 2)
    try:
        env.reset()
        env.step_async(np.zeros(2, dtype=np.int64))  # sent: the failure is not known yet
        with pytest.raises(rl.EnvError, match="crash at 1") as got:
            env.step_wait()
        assert isinstance(got.value, ValueError) and got.value.details["index"] == 0
        # nothing is pending after it: the next step_wait has no step to collect
        with pytest.raises(gym.error.NoAsyncCallError):
            env.step_wait()
    finally:
        env.close()


def test_sb3_refuses_calls_while_a_step_is_pending_and_close_collects_it(
        tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    env = _vector("sb3", [functools.partial(_rl_envs.MarkEnv, str(marks), delay=0.2)] * 2)
    with pytest.raises(gym.error.NoAsyncCallError, match="without any prior call"):
        env.step_wait()
    env.reset()
    env.step_async(np.zeros(2, dtype=np.int64))
    for call in (lambda: env.step_async(np.zeros(2, dtype=np.int64)), env.reset,
                 lambda: env.env_method("double", 2), lambda: env.get_attr("count")):
        with pytest.raises(gym.error.AlreadyPendingCallError, match="pending call to `step`"):
            call()
    env.close()  # reads the pending step's replies, then closes every env
    assert marks.read_text().split() == ["1", "1"]


def test_vector_close_with_a_step_pending_collects_it(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    env = _vector("gymnasium",
                  [functools.partial(_rl_envs.MarkEnv, str(marks), delay=0.2)] * 2)
    env.reset()
    env.step_async(np.zeros(2, dtype=np.int64))
    env.close()
    assert env.closed and marks.read_text().split() == ["1", "1"]
