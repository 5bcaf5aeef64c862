"""boxd.rl.VectorEnv against Gymnasium's own SyncVectorEnv, as the oracle.

The sub-envs run in real env servers (local subprocesses, `boxd.rl.local()`); the same
env_fns go to `SyncVectorEnv` in this process, and every reset and step must return
equal data (same values, dtypes and container types). Gymnasium's tests/vector/ is the
reference for what is checked: the autoreset modes, partial resets with reset_mask and
their failures, final observation/info in SAME_STEP, dict-of-arrays infos with masks,
seeds, action-count checks, call/get_attr/set_attr. On real machines:
tests/integration/test_rl_machines.py.
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from tests._support import rl_envs as _rl_envs
from tests._support.rl_forked import forked

import boxd.rl as rl
from boxd import errors
from boxd.rl import _pool

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@pytest.fixture(autouse=True, params=[1, 2], ids=["k1", "k2"])
def envs_per_machine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every test runs with one server per sub-env and with two sub-envs to a server
    (``envs_per_machine=2``; with an odd count the last server holds one)."""
    k: int = request.param
    init = _pool.Pool.__init__

    def with_k(self: _pool.Pool, *args: Any, envs_per_machine: int = 1, **kw: Any) -> None:
        same = type(envs_per_machine) is int and envs_per_machine == 1
        init(self, *args, envs_per_machine=k if same else envs_per_machine,
             **kw)

    monkeypatch.setattr(_pool.Pool, "__init__", with_k)
    return k


def _fns(n: int = 3, **kw: Any) -> list[Any]:
    # Different episode lengths per sub-env, so finishes interleave.
    return [functools.partial(_rl_envs.CountEnv, ends=3 + i, **kw) for i in range(n)]


def _pair(mode: AutoresetMode, n: int = 3, **kw: Any) -> tuple[rl.VectorEnv, SyncVectorEnv]:
    fns = _fns(n, **kw)
    # forked(): rl.local()'s servers, forked from this process rather than spawned
    # (tests/_support/rl_forked.py); the tests below that name rl.local() spawn them.
    ours = rl.VectorEnv(fns, source=forked(), autoreset_mode=mode,
                        pickle_by_value=[_rl_envs])
    return ours, SyncVectorEnv(fns, autoreset_mode=mode)


def _same(a: Any, b: Any, what: str) -> None:
    assert data_equivalence(a, b, exact=True), f"{what} differs:\nboxd: {a!r}\ngym:  {b!r}"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("truncate", [False, True], ids=["terminate", "truncate"])
def test_steps_match_sync_vector_env(mode: AutoresetMode, truncate: bool) -> None:
    ours, ref = _pair(mode, truncate=truncate)
    try:
        assert ours.metadata["autoreset_mode"] == mode and ours.autoreset_mode == mode
        assert ours.single_observation_space == ref.single_observation_space
        assert ours.action_space == ref.action_space
        _same(ours.reset(seed=10), ref.reset(seed=10), "reset(seed=10)")
        rng = np.random.default_rng(0)
        finished = 0
        for t in range(14):
            actions = rng.integers(0, 3, size=3)
            got, want = ours.step(actions), ref.step(actions)
            _same(got, want, f"step {t}")
            done = np.logical_or(want[2], want[3])
            finished += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                opts = {"reset_mask": done.copy()}
                _same(ours.reset(options=dict(opts)), ref.reset(options=dict(opts)),
                      f"partial reset at step {t}")
        assert finished >= 6  # the run exercised the autoreset paths
    finally:
        ours.close()
        ref.close()


def test_same_step_reports_final_obs_and_info() -> None:
    ours, _ = _pair(AutoresetMode.SAME_STEP)
    try:
        ours.reset()  # every counter at 0
        for _ in range(2):
            obs, _, term, _, infos = ours.step(np.zeros(3, dtype=np.int64))
        # Sub-env 0 ends at 3: after the third step it was reset to 0 in the same step.
        obs, _, term, _, infos = ours.step(np.zeros(3, dtype=np.int64))
        assert term.tolist() == [True, False, False]
        assert infos["_final_obs"].tolist() == [True, False, False]
        assert infos["final_obs"][0] == 3 and infos["final_obs"][1] is None
        assert infos["final_info"]["nested"]["count"][0] == 3
        assert obs[0] == 0 and infos["reset_count"][0] == 0 and infos["_reset_count"][0]
    finally:
        ours.close()


def test_next_step_ignores_the_action_of_a_finished_sub_env() -> None:
    ours, _ = _pair(AutoresetMode.NEXT_STEP)
    try:
        ours.reset()
        for _ in range(3):
            obs, rew, term, trunc, _ = ours.step(np.full(3, 2))
        assert term[0]
        obs, rew, term, trunc, _infos = ours.step(np.full(3, 2))
        assert obs[0] == 0 and rew[0] == 0.0 and not term[0] and not trunc[0]
        assert rew[1] == 2.0
    finally:
        ours.close()


def test_infos_are_dicts_of_arrays_with_masks() -> None:
    ours, _ = _pair(AutoresetMode.NEXT_STEP)
    try:
        ours.reset(seed=1)
        _, _, _, _, infos = ours.step(np.array([0, 1, 2]))
        assert infos["action"].dtype == np.int64 and infos["action"].tolist() == [0, 1, 2]
        assert infos["half"].dtype == np.float64 and infos["even"].dtype == np.bool_
        assert infos["vec"].shape == (3, 2) and infos["vec"].dtype == np.float32
        assert infos["name"].dtype == object and infos["name"].tolist() == ["c2", "c3", "c4"]
        assert infos["nested"]["count"].tolist() == [2, 3, 4]
        # Only sub-env 1 (counter 3) has "third": the mask says so.
        assert infos["_third"].tolist() == [False, True, False]
        assert infos["third"].dtype == np.int32
    finally:
        ours.close()


@pytest.mark.parametrize(
    ("mask", "exc", "text"),
    [
        ([True, False, True], TypeError, "must be a numpy array"),
        (np.array([True, False]), ValueError, "must have shape"),
        (np.array([1, 0, 1]), TypeError, "dtype=np.bool_"),
        (np.array([False, False, False]), ValueError, "at least one True"),
    ],
    ids=["list", "shape", "dtype", "all-false"],
)
def test_reset_mask_is_validated_like_gymnasium(mask: Any, exc: type, text: str) -> None:
    ours, ref = _pair(AutoresetMode.DISABLED)
    try:
        ours.reset(seed=0)
        ref.reset(seed=0)
        with pytest.raises(exc, match=text):
            ours.reset(options={"reset_mask": mask})
        with pytest.raises(exc):
            ref.reset(options={"reset_mask": mask})
    finally:
        ours.close()
        ref.close()


def test_partial_reset_keeps_the_other_episodes() -> None:
    ours, _ = _pair(AutoresetMode.DISABLED)
    try:
        ours.reset(seed=[5, 6, 7])
        ours.step(np.zeros(3, dtype=np.int64))
        obs, infos = ours.reset(seed=[100, 200, 300], options={
            "reset_mask": np.array([False, True, False])})
        assert obs.tolist() == [6, 200, 8]
        assert infos["_reset_count"].tolist() == [False, True, False]
    finally:
        ours.close()


def test_disabled_refuses_to_step_a_finished_sub_env() -> None:
    ours, _ = _pair(AutoresetMode.DISABLED)
    try:
        ours.reset()
        for _ in range(3):
            ours.step(np.zeros(3, dtype=np.int64))
        # SyncVectorEnv's assertion (also a RuntimeError, as boxd raised before).
        with pytest.raises(AssertionError, match=r"self._autoreset_envs=array\(\[ True") as info:
            ours.step(np.zeros(3, dtype=np.int64))
        assert isinstance(info.value, RuntimeError)
    finally:
        ours.close()


def test_seeds_and_action_counts() -> None:
    ours, _ = _pair(AutoresetMode.NEXT_STEP)
    try:
        assert ours.reset(seed=40)[0].tolist() == [40, 41, 42]
        assert ours.reset(seed=[1, None, 3])[0].tolist() == [1, 0, 3]
        with pytest.raises(ValueError, match="length must match num_envs=3"):
            ours.reset(seed=[1, 2])
        with pytest.raises(ValueError, match=r"zip\(\) argument 2 is longer than argument 1"):
            ours.step(np.zeros(2, dtype=np.int64))
    finally:
        ours.close()


def test_call_get_attr_set_attr_render() -> None:
    fns = [functools.partial(_rl_envs.CountEnv, render_mode="rgb_array") for _ in range(2)]
    env = rl.VectorEnv(fns, source=rl.local(), pickle_by_value=[_rl_envs])
    try:
        env.reset(seed=0)
        assert env.call("double", 21) == (42, 42)
        assert env.get_attr("tag") == ("initial", "initial")
        env.set_attr("tag", ["a", "b"])
        assert env.get_attr("tag") == ("a", "b")
        env.set_attr("tag", "same")
        assert env.call("tag") == ("same", "same")  # a non-callable attribute is read
        with pytest.raises(ValueError, match="length equal to the number"):
            env.set_attr("tag", ["only-one"])
        frames = env.render()
        assert frames is not None and frames[0].dtype == np.uint8 and frames[0].shape == (2, 2, 3)
        assert env.render_mode == "rgb_array"
    finally:
        env.close()


def test_step_async_and_wait() -> None:
    env = rl.VectorEnv("CartPole-v1", 2, source=rl.local())
    try:
        env.reset(seed=0)
        with pytest.raises(gym.error.NoAsyncCallError, match="without any prior call"):
            env.step_wait()
        env.step_async(np.array([0, 1]))
        with pytest.raises(gym.error.AlreadyPendingCallError, match="pending call to `step`"):
            env.step_async(np.array([0, 1]))
        obs, rew, _term, _trunc, _ = env.step_wait(timeout=30)
        assert obs.shape == (2, 4) and obs.dtype == np.float32 and rew.dtype == np.float64
    finally:
        env.close()


def test_a_failing_sub_env_is_named() -> None:
    fns = [functools.partial(_rl_envs.CountEnv), functools.partial(_rl_envs.CrashEnv, 2)]
    env = rl.VectorEnv(fns, source=rl.local(), pickle_by_value=[_rl_envs])
    try:
        env.reset()
        env.step(np.zeros(2, dtype=np.int64))
        with pytest.raises(rl.EnvError, match="sub-env 1: ValueError: crash at 2") as info:
            env.step(np.zeros(2, dtype=np.int64))
        assert info.value.index == 1 and "in step" in info.value.traceback
        # The other sub-env's reply was collected, so the channel stays in step.
        assert env.call("double", 1) == (2, 2)
    finally:
        env.close()


def test_close_is_idempotent_and_final() -> None:
    env = rl.VectorEnv("CartPole-v1", 2, source=rl.local())
    env.close()
    env.close()
    with pytest.raises(errors.StateError):
        env.reset()
    with pytest.raises(gym.error.ClosedEnvironmentError, match="after a call to `close"):
        env.step(np.zeros(2, dtype=np.int64))


def test_string_autoreset_mode_and_make_vec_registration() -> None:
    gym.register("BoxdLocalCartPole-v1", vector_entry_point=functools.partial(
        rl.VectorEnv, "CartPole-v1", source=rl.local(), autoreset_mode="SameStep"))
    try:
        env = gym.make_vec("BoxdLocalCartPole-v1", num_envs=2)
        try:
            assert isinstance(env, rl.VectorEnv) and env.num_envs == 2
            assert env.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
        finally:
            env.close()
    finally:
        gym.registry.pop("BoxdLocalCartPole-v1", None)


def test_bad_arguments() -> None:
    with pytest.raises(errors.InvalidRequest, match="num_envs"):
        rl.VectorEnv("CartPole-v1", source=rl.local())
    with pytest.raises(errors.InvalidRequest, match="reset_mode"):
        rl.VectorEnv("CartPole-v1", 1, source=rl.local(), reset_mode="again")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        rl.VectorEnv("CartPole-v1", 1, source=rl.local(), autoreset_mode="Sometimes")


# ---------------------------------------------------------------------- envs_per_machine


def _pids(env: rl.VectorEnv) -> list[int]:
    return [info["pid"] for info in env._pool.infos]


def test_sub_envs_share_servers_and_a_step_is_one_frame_per_server() -> None:
    fns = _fns(5)
    env = rl.VectorEnv(fns, source=rl.local(), envs_per_machine=2, pickle_by_value=[_rl_envs])
    ref = SyncVectorEnv(fns)
    try:
        pids = _pids(env)
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]  # the last holds one
        assert len(env._pool.slots) == 3 and env.envs_per_machine == 2
        frames = 0
        for rpc in env._pool.rpcs:
            send = rpc.send

            def counted(*a: Any, _send: Any = send) -> None:
                nonlocal frames
                frames += 1
                _send(*a)

            rpc.send = counted  # type: ignore[method-assign]
        _same(env.reset(seed=3), ref.reset(seed=3), "reset")
        assert frames == 3
        for t in range(12):
            acts = np.array([(t + i) % 2 for i in range(5)])
            _same(env.step(acts), ref.step(acts), f"step {t}")
        assert frames == 3 + 12 * 3
    finally:
        env.close()
        ref.close()


def test_recover_replaces_a_shared_server_with_all_its_sub_envs() -> None:
    env = rl.VectorEnv("CartPole-v1", 3, source=rl.local(), envs_per_machine=2, recover=True)
    try:
        env.reset(seed=0)
        env._pool.slots[0].channel.kill()  # type: ignore[attr-defined]
        _, rew, term, trunc, infos = env.step(np.array([0, 1, 0]))
        assert infos["_recovered"].tolist() == [True, True, False]
        assert trunc.tolist()[:2] == [True, True] and not term[:2].any() and rew[2] == 1.0
        obs, *_ = env.step(np.array([0, 1, 0]))  # NEXT_STEP: the fresh pair resets
        assert obs.shape == (3, 4)
        assert _pids(env)[0] == _pids(env)[1] != _pids(env)[2]
    finally:
        env.close()


def test_a_lost_server_is_an_infrastructure_error_not_an_outcome() -> None:
    """Without recover: the step raises (no reward, no termination to score), and what
    it raises is a `boxd.InfrastructureError` a trainer can catch to retry or drop."""
    env = rl.VectorEnv("CartPole-v1", 2, source=rl.local())
    try:
        env.reset(seed=0)
        env._pool.slots[0].channel.kill()  # type: ignore[attr-defined]
        with pytest.raises(errors.InfrastructureError) as caught:
            env.step(np.array([0, 1]))
        assert isinstance(caught.value, rl.EnvServerLost)
    finally:
        env.close()


def test_refork_renews_a_server_only_when_all_its_sub_envs_reset() -> None:
    env = rl.VectorEnv("CartPole-v1", 4, source=rl.local(), envs_per_machine=2,
                       reset_mode="refork", autoreset_mode=AutoresetMode.DISABLED)
    try:
        env.reset(seed=0)
        env.step(np.zeros(4, dtype=np.int64))
        before = _pids(env)
        env.reset(options={"reset_mask": np.array([True, False, True, True])})
        after = _pids(env)
        assert after[0] == after[1] == before[0]  # half of the pair: reset by its env
        assert after[2] == after[3] != before[2]  # the whole pair: a fresh server
        # Reforked or not, a seeded reset gives the same observations.
        a, _ = env.reset(seed=7)
        ref = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
        b, _ = ref.reset(seed=7)
        ref.close()
        assert np.array_equal(a, b)
    finally:
        env.close()


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_envs_per_machine_is_validated(k: Any) -> None:
    with pytest.raises(errors.InvalidRequest, match="envs_per_machine must be an int >= 1"):
        rl.VectorEnv("CartPole-v1", 2, source=rl.local(), envs_per_machine=k)
