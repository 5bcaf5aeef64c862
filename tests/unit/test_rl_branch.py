"""Argument errors of `Env.branch`/`save`/`load` and `VectorEnv.branch`/`save`/`load`.

Local env servers (no machines): bad arguments are refused before anything forks, a
local server cannot branch (typed error, with the fix), and a vector env raises
Gymnasium's errors where the user's code touches Gymnasium (after ``close``, during a
pending ``step_async``). Real branching: tests/integration/test_rl_branch.py.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from tests._support import rl_envs as _rl_envs

import boxd.rl as rl
from boxd import errors

Count = functools.partial(_rl_envs.CountEnv)


@pytest.fixture(scope="module")
def env() -> Iterator[rl.Env]:
    e = rl.Env(Count, source=rl.local(), pickle_by_value=[_rl_envs])
    e.reset(seed=0)
    yield e
    e.close()


@pytest.fixture(scope="module")
def envs() -> Iterator[rl.VectorEnv]:
    v = rl.VectorEnv([Count] * 3, source=rl.local(), pickle_by_value=[_rl_envs])
    v.reset(seed=0)
    yield v
    v.close()


@pytest.mark.parametrize("k", [0, -1, 1.5, "2", True, None])
def test_a_bad_k_is_refused(env: rl.Env, envs: rl.VectorEnv, k: Any) -> None:
    for call in (lambda: env.branch(k), lambda: envs.branch(0, k) if k is not None
                 else envs.branch(0, 0)):
        with pytest.raises(errors.InvalidRequest, match="k must be an int >= 1") as info:
            call()
        assert isinstance(info.value, ValueError) and info.value.details["field"] == "k"


@pytest.mark.parametrize("index", [3, -4, 1.0, "0", True, [0, 7], [None]])
def test_a_bad_index_is_an_index_error(envs: rl.VectorEnv, index: Any) -> None:
    calls = [lambda: envs.branch(index), lambda: envs.save(index)]
    if not isinstance(index, list):  # a list with k is refused for k (below)
        calls.append(lambda: envs.branch(index, 2))
    for call in calls:
        with pytest.raises(errors.InvalidRequest, match=r"out of range|must be an int") as info:
            call()
        assert isinstance(info.value, IndexError)


def test_k_with_a_list_of_indices_or_an_empty_list_is_refused(envs: rl.VectorEnv) -> None:
    with pytest.raises(errors.InvalidRequest, match="give k with one index"):
        envs.branch([0, 1], 2)
    with pytest.raises(errors.InvalidRequest, match="at least one index"):
        envs.branch([])


def test_local_servers_cannot_branch_or_save(env: rl.Env, envs: rl.VectorEnv) -> None:
    for call in (lambda: env.branch(2), env.save, lambda: envs.branch(1, 2),
                 lambda: envs.branch([0, 2]), lambda: envs.save(0)):
        with pytest.raises(errors.InvalidRequest, match="need a machine") as info:
            call()
        assert "boxd.rl.local()" in (info.value.hint or "")


def test_load_takes_an_env_state(env: rl.Env) -> None:
    with pytest.raises(errors.InvalidRequest, match="need a machine"):
        env.load("not a state")  # type: ignore[arg-type]


def test_closed_or_pending_vector_env_raises_gymnasiums_errors() -> None:
    v = rl.VectorEnv([Count] * 2, source=rl.local(), pickle_by_value=[_rl_envs])
    v.reset(seed=0)
    v.step_async(np.array([0, 1]))
    with pytest.raises(gym.error.AlreadyPendingCallError, match="Calling `branch` while"):
        v.branch(0, 2)
    with pytest.raises(gym.error.AlreadyPendingCallError, match="Calling `save` while"):
        v.save(0)
    v.step_wait()
    v.close()
    for call in (lambda: v.branch(0, 2), lambda: v.save(0)):
        with pytest.raises(gym.error.ClosedEnvironmentError):
            call()
    e = rl.Env(Count, source=rl.local(), pickle_by_value=[_rl_envs])
    e.close()
    with pytest.raises(errors.StateError, match="closed"):
        e.branch(1)


def test_sub_envs_sharing_a_machine_cannot_branch_or_save() -> None:
    """A machine holds all its sub-envs (envs_per_machine > 1): a branch or checkpoint
    of one would take the others, so it is refused with the fix."""
    v = rl.VectorEnv([Count] * 4, source=rl.local(), envs_per_machine=2,
                     pickle_by_value=[_rl_envs])
    try:
        v.reset(seed=0)
        for call in (lambda: v.branch(1, 2), lambda: v.branch([0, 3]), lambda: v.save(2)):
            with pytest.raises(errors.InvalidRequest, match="envs_per_machine=2") as info:
                call()
            assert "envs_per_machine=1" in (info.value.hint or "")
    finally:
        v.close()
