"""boxd.rl.Env, the codec and the verifier with local env servers (no machines).

The same checks on real machines: tests/integration/test_rl_machines.py.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env, data_equivalence
from gymnasium.utils.env_match import check_environments_match
from tests._support import rl_envs as _rl_envs

import boxd.rl as rl
from boxd import errors
from boxd.rl import _server as W
from boxd.rl import _verify


@pytest.mark.parametrize("value", [
    None, True, False, 0, -1, 2**63 - 1, 2**70, -(2**70), 1.5, float("inf"), "", "héllo",
    b"\x00\xff", (), (1, (2.0, "x")), [1, [2]], {"a": 1, 2: (3,), (1, 2): None},
    np.float32(1.5), np.int8(-3), np.bool_(True), np.uint64(2**64 - 1),
    np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((0, 4), dtype=np.int16),
    np.array([True, False]), np.array(3.0), np.asfortranarray(np.eye(3)),
    {"obs": (np.ones(2, dtype=np.float32), {"k": np.int64(4)})},
], ids=repr)
def test_codec_round_trip_keeps_types_and_dtypes(value: Any) -> None:
    back = W.decode(W.encode(value))
    assert type(back) is type(value)
    assert data_equivalence(back, value, exact=True)


def test_codec_refuses_what_it_cannot_carry_and_never_unpickles() -> None:
    with pytest.raises(W.WireError, match=r"value\[1\]\['f'\] is a builtins\."):
        W.encode((1, {"f": print}))
    with pytest.raises(W.WireError, match="dtype object"):
        W.encode(np.array([object()]))
    import pickle

    with pytest.raises(W.WireError):
        W.decode(pickle.dumps({"a": 1}))
    with pytest.raises(W.WireError, match="trailing"):
        W.decode(W.encode(1) + b"N")
    with pytest.raises(W.WireError, match="truncated"):
        W.decode(W.encode(b"abcdef")[:-2])
    big = W.encode(2**100)  # its digits are text: a letter among them is malformed
    with pytest.raises(W.WireError, match="malformed message: invalid literal"):
        W.decode(big[:8] + b"x" + big[9:])
    arr = W.encode(np.zeros(2, np.float32))
    at = arr.index(b"<f4")
    with pytest.raises(W.WireError, match="dtype '<04'"):  # numpy raises SyntaxError here
        W.decode(arr[:at] + b"<04" + arr[at + 3:])
    with pytest.raises(W.WireError, match="unknown tag"):  # not wrapped twice
        W.decode(b"\xfe")


def test_spaces_travel_without_pickle() -> None:
    from gymnasium import spaces

    space = spaces.Dict({
        "box": spaces.Box(-1, 1, (2, 3), dtype=np.float32),
        "d": spaces.Discrete(5, start=2), "md": spaces.MultiDiscrete([3, 4]),
        "mb": spaces.MultiBinary(6), "t": spaces.Tuple((spaces.Discrete(2),)),
        "text": spaces.Text(8),
    })
    assert W.space_from_wire(W.decode(W.encode(W.space_to_wire(space)))) == space
    with pytest.raises(W.WireError, match="Graph"):
        W.space_to_wire(spaces.Graph(spaces.Box(0, 1, (1,)), None))


def test_check_env_with_warnings_as_errors() -> None:
    env = rl.Env(_rl_envs.BoxEnv, source=rl.local(), pickle_by_value=[_rl_envs])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(env, skip_render_check=True)
        obs, _ = env.reset(seed=3)
        assert isinstance(obs, tuple) and obs[0].dtype == np.float32
        assert data_equivalence(obs, _rl_envs.BoxEnv().reset(seed=3)[0], exact=True)
    finally:
        env.close()


def test_matches_a_local_cartpole_over_200_steps() -> None:
    env = rl.Env("CartPole-v1", source=rl.local())
    try:
        check_environments_match(gym.make("CartPole-v1"), env, num_steps=200, seed=7,
                                 skip_render=True)
        assert env.spec is None and env.metadata["render_fps"] == 50
    finally:
        env.close()


def test_unimportable_module_names_both_fixes() -> None:
    with pytest.raises(rl.EnvModuleNotFound) as info:
        rl.Env(_rl_envs.CountEnv, source=rl.local())
    assert info.value.module == "tests"
    assert "pickle_by_value=[tests]" in str(info.value) and "install it" in str(info.value)


def test_make_kwargs_reset_modes_and_errors() -> None:
    env = rl.Env(_rl_envs.CountEnv, source=rl.local(), pickle_by_value=[_rl_envs],
                 reset_mode="refork", ends=2)
    try:
        assert env.reset(seed=4)[0] == 4
        env.set_attr("tag", "changed")
        env.step(0)
        assert env.reset(seed=4)[0] == 4
        assert env.get_attr("tag") == "initial"  # a fresh server: nothing carried over
        assert env.call("double", 5) == 10
        with pytest.raises(rl.EnvError, match="AttributeError"):
            env.call("nope")
    finally:
        env.close()
        env.close()
    with pytest.raises(errors.InvalidRequest, match="rewind"):
        rl.Env("CartPole-v1", source=rl.local(), reset_mode="rewind")


def test_step_timeout_is_a_typed_timeout() -> None:
    env = rl.Env(_rl_envs.CountEnv, source=rl.local(), pickle_by_value=[_rl_envs],
                 step_timeout=0.3, delay=3.0)
    try:
        env.reset()
        t = time.monotonic()
        with pytest.raises(rl.EnvTimeout, match=r"did not answer within 0\.3s") as info:
            env.step(0)
        assert time.monotonic() - t < 2.5
        assert isinstance(info.value, TimeoutError)
    finally:
        env.close()


def test_verify_local() -> None:
    report = rl.verify(rl.local(), "CartPole-v1", seed=42, steps=60)
    assert report.identical and report.episodes >= 2
    clock = rl.verify(rl.local(), functools.partial(_rl_envs.ClockEnv, reads_at=5), seed=0,
                      steps=10, pickle_by_value=[_rl_envs])
    assert not clock.identical
    assert clock.first_divergence is not None and clock.first_divergence.step == 5
    assert clock.first_divergence.field == "obs"
    # the traced replay names the read (no rewind needed, so local servers do too)
    assert clock.likely_cause == f"{_verify.CAUSE_CLOCK} (step 5 read time.time_ns)"
    rows = dict(clock.rows())
    assert rows["identical"] == "NO" and rows["first divergence"] == "step 5, obs"


def test_verify_names_a_nondeterministic_policy() -> None:
    rng = np.random.default_rng()  # unseeded on purpose
    report = rl.verify(rl.local(), "CartPole-v1", seed=1, steps=30,
                       policy=lambda obs: int(rng.integers(2)))
    assert not report.identical and report.first_divergence is not None
    assert report.first_divergence.field == "action"
    assert report.likely_cause == _verify.CAUSE_POLICY


def test_after_a_timeout_the_env_refuses_rather_than_answer_wrongly() -> None:
    env = rl.Env(_rl_envs.CountEnv, source=rl.local(), pickle_by_value=[_rl_envs],
                 step_timeout=0.2, delay=1.0)
    try:
        env.reset()
        with pytest.raises(rl.EnvTimeout):
            env.step(0)
        time.sleep(1.2)  # the late reply has arrived by now: it must not be taken
        with pytest.raises(rl.EnvTimeout):
            env.get_attr("count")
    finally:
        env.close()


def test_sb3_vec_env_locally() -> None:
    from gymnasium.wrappers import TimeLimit

    from boxd.rl.sb3 import VecEnv

    fns = [functools.partial(_rl_envs.CountEnv, ends=2) for _ in range(2)]
    venv = VecEnv(fns, source=rl.local(), pickle_by_value=[_rl_envs])
    wrapped = VecEnv("CartPole-v1", 1, source=rl.local())
    try:
        assert venv.env_is_wrapped(_rl_envs.CountEnv) == [False, False]
        assert wrapped.env_is_wrapped(TimeLimit) == [True]
        venv.seed(100)
        assert venv.reset().tolist() == [100, 101]
        venv.seed(500)
        venv.set_options({"level": 3})
        venv.step_async(np.zeros(2, dtype=np.int64))
        obs, _, dones, infos = venv.step_wait()
        assert dones.tolist() == [False, True] and obs[1] == 501
        assert infos[1]["terminal_observation"] == 102
        assert venv.reset_infos[1]["options"] == {"level": 3}
        venv.step_async(np.zeros(2, dtype=np.int64))
        obs, _, dones, _ = venv.step_wait()  # sub-env 0 ends: seed 500 was for it too
        assert dones[0] and obs[0] == 500
        assert venv.reset_infos[0]["options"] == {"level": 3}
    finally:
        venv.close()
        wrapped.close()
