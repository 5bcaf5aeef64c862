"""boxd.rl.VectorEnv raises what Gymnasium's vectorisers raise, on every error path.

Each case makes the same bad call against `SyncVectorEnv` (and `AsyncVectorEnv` where
it behaves alike) and against boxd.rl.VectorEnv (local env servers, no machines), and
compares the outcomes:

- an error Gymnasium raises itself (argument checks, space checks, closed env,
  pending calls): boxd's is an instance of the same type, with the same ``str``
  (Async's messages name ``type(self).__name__``: filled in with boxd's class name);
- an error the *sub-env* raised (Gymnasium lets it through): boxd's is a
  `boxd.rl.EnvError` that is also an instance of the env's exception type, and its
  message contains the env's (after the sub-env's index and type);
- a call Gymnasium accepts: boxd accepts it too.

Paths only AsyncVectorEnv has (``step_async``/``step_wait``, closed env) are compared
with it alone; paths where Async differs from Sync (zip messages, space messages,
DISABLED stepping) with `SyncVectorEnv` alone.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv
from tests._support import rl_envs as _rl_envs
from tests._support.rl_forked import forked

import boxd.rl as rl
from boxd import errors
from boxd.rl import _pool

N = 3
Count = functools.partial(_rl_envs.CountEnv)



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

def _fns(n: int = N, **kw: Any) -> list[Any]:
    return [functools.partial(_rl_envs.CountEnv, **kw) for _ in range(n)]


def _make(kind: str, fns: Any, **kw: Any) -> Any:
    if kind == "sync":
        return SyncVectorEnv(fns, **kw)
    if kind == "async":
        # Forked workers, whatever the process's default start method: importing torchrl
        # (test_rl_torchrl, in the same pytest process) sets it to "spawn", which made
        # every reference env start 3 interpreters. The errors compared are the same.
        return AsyncVectorEnv(fns, context="fork", **kw)
    # Servers forked from this process (tests/_support/rl_forked.py): the same server code
    # and channel as rl.local()'s, without each one importing Gymnasium anew (the tests
    # at the end of this file use rl.local() itself).
    return rl.VectorEnv(fns, source=forked(), pickle_by_value=[_rl_envs], **kw)


def _zeros(n: int = N) -> np.ndarray[Any, Any]:
    return np.zeros(n, dtype=np.int64)


def _reset(env: Any) -> None:
    env.reset(seed=0)


def _pending(env: Any) -> None:
    env.reset(seed=0)
    env.step_async(_zeros())


def _closed(env: Any) -> None:
    env.reset(seed=0)
    env.close()


def _finished(env: Any) -> None:
    env.reset(seed=0)
    env.step(_zeros(2))


@dataclass(frozen=True)
class Case:
    id: str
    act: Callable[[Any], Any] | None  # None: the constructor is the bad call
    refs: tuple[str, ...] = ("sync", "async")
    fns: Callable[[], Any] = _fns
    kw: dict[str, Any] = field(default_factory=dict)
    setup: Callable[[Any], None] = _reset
    #: the sub-env raised: compare the type and that boxd's message holds the env's
    env_raised: bool = False
    #: compare the type only (boxd's message says more: a machine-level failure)
    type_only: bool = False


CASES = [
    # ------------------------------------------------------------ construction
    Case("empty-env-fns", None, fns=lambda: []),
    Case("env-fn-not-callable", None, fns=lambda: [1, 2]),
    Case("observation-spaces-differ", None, refs=("sync",),
         fns=lambda: [Count, functools.partial(_rl_envs.CountEnv, n_obs=999)]),
    Case("action-spaces-differ", None, refs=("sync",),
         fns=lambda: [Count, functools.partial(_rl_envs.CountEnv, n_actions=4)]),
    Case("observation-space-differs-in-a-later-sub-env", None, refs=("sync",),
         fns=lambda: [Count, Count, functools.partial(_rl_envs.CountEnv, n_obs=5)]),
    Case("bad-autoreset-mode", None, kw={"autoreset_mode": "Sometimes"}),
    Case("env-constructor-raises", None, env_raised=True,
         fns=lambda: [functools.partial(_rl_envs.CountEnv, bogus=1)]),
    # ------------------------------------------------------------ reset
    Case("seed-list-too-short", lambda e: e.reset(seed=[1, 2])),
    Case("seed-tuple-too-long", lambda e: e.reset(seed=(1, 2, 3, 4))),
    Case("seed-float", lambda e: e.reset(seed=1.5)),
    Case("seed-numpy-int", lambda e: e.reset(seed=np.int64(3))),
    Case("seed-negative", lambda e: e.reset(seed=-1), refs=("sync",)),
    Case("seed-str-of-num-envs-chars", lambda e: e.reset(seed="abc"), env_raised=True),
    Case("options-a-list-the-env-ignores", lambda e: e.reset(options=[1]),
         fns=lambda: [_rl_envs.BoxEnv] * N, setup=lambda e: None),
    Case("options-a-list-the-env-rejects", lambda e: e.reset(options=[1]), env_raised=True),
    Case("reset-mask-a-list", lambda e: e.reset(options={"reset_mask": [True] * N})),
    Case("reset-mask-wrong-shape",
         lambda e: e.reset(options={"reset_mask": np.array([True, False])})),
    Case("reset-mask-wrong-dtype", lambda e: e.reset(options={"reset_mask": np.ones(N)})),
    Case("reset-mask-all-false",
         lambda e: e.reset(options={"reset_mask": np.zeros(N, dtype=np.bool_)})),
    # ------------------------------------------------------------ step
    Case("step-before-reset", lambda e: e.step(_zeros()), setup=lambda e: None),
    Case("too-few-actions", lambda e: e.step(_zeros(N - 1)), refs=("sync",)),
    Case("too-many-actions", lambda e: e.step(_zeros(N + 1)), refs=("sync",)),
    Case("too-few-actions-as-a-list", lambda e: e.step([0, 1]), refs=("sync",)),
    Case("scalar-action", lambda e: e.step(0)),
    Case("actions-of-the-wrong-shape", lambda e: e.step(np.zeros((N, 2), dtype=np.int64)),
         env_raised=True),
    Case("action-outside-the-action-space", lambda e: e.step(np.full(N, 7))),
    Case("env-step-raises", lambda e: e.step(_zeros()),
         fns=lambda: [functools.partial(_rl_envs.CrashEnv, 1)] * N, env_raised=True),
    Case("disabled-step-of-a-finished-sub-env", lambda e: e.step(_zeros(2)), refs=("sync",),
         fns=lambda: _fns(2, ends=1), kw={"autoreset_mode": "Disabled"}, setup=_finished),
    # ------------------------------------------------------------ step_async / step_wait
    Case("step-wait-without-step-async", lambda e: e.step_wait(), refs=("async",)),
    Case("step-async-twice", lambda e: e.step_async(_zeros()), refs=("async",),
         setup=_pending),
    Case("reset-while-a-step-is-pending", lambda e: e.reset(), refs=("async",),
         setup=_pending),
    Case("call-while-a-step-is-pending", lambda e: e.call("double", 1), refs=("async",),
         setup=_pending),
    Case("get-attr-while-a-step-is-pending", lambda e: e.get_attr("tag"), refs=("async",),
         setup=_pending),
    Case("set-attr-while-a-step-is-pending", lambda e: e.set_attr("tag", "x"),
         refs=("async",), setup=_pending),
    Case("render-while-a-step-is-pending", lambda e: e.render(), refs=("async",),
         setup=_pending, fns=lambda: _fns(render_mode="rgb_array")),
    Case("step-wait-times-out", lambda e: e.step_wait(timeout=0.1), refs=("async",),
         fns=lambda: _fns(delay=1.0), setup=_pending,
         type_only=True),
    # ------------------------------------------------------------ call / get_attr / set_attr
    Case("call-a-missing-attribute", lambda e: e.call("nope"), env_raised=True),
    Case("call-that-raises", lambda e: e.call("double"), env_raised=True),
    Case("get-attr-a-missing-attribute", lambda e: e.get_attr("nope"), env_raised=True),
    Case("get-attr-of-a-method-calls-it", lambda e: e.get_attr("double"), env_raised=True),
    Case("set-attr-list-too-short", lambda e: e.set_attr("tag", ["a"])),
    Case("set-attr-tuple-too-long", lambda e: e.set_attr("tag", ("a",) * (N + 1))),
    # ------------------------------------------------------------ after close()
    *(Case(f"{name}-after-close", act, refs=("async",), setup=_closed) for name, act in [
        ("reset", lambda e: e.reset()),
        ("step", lambda e: e.step(_zeros())),
        ("step-async", lambda e: e.step_async(_zeros())),
        ("step-wait", lambda e: e.step_wait()),
        ("call", lambda e: e.call("double", 1)),
        ("get-attr", lambda e: e.get_attr("tag")),
        ("set-attr", lambda e: e.set_attr("tag", "x")),
        ("render", lambda e: e.render()),
    ]),
    Case("close-twice", lambda e: e.close(), setup=_closed),
]


def _outcome(case: Case, kind: str) -> tuple[Any, BaseException | None]:
    env = None
    try:
        env = _make(kind, case.fns(), **case.kw)
        case.setup(env)
        assert case.act is not None
        return case.act(env), None
    except Exception as exc:
        return None, exc
    finally:
        if env is not None:
            with contextlib.suppress(Exception):
                env.close()


@pytest.mark.parametrize(
    ("case", "ref"), [pytest.param(c, r, id=f"{c.id}[{r}]") for c in CASES for r in c.refs])
def test_boxd_raises_what_gymnasium_raises(case: Case, ref: str) -> None:
    if case.act is None:
        _, want = _outcome_of_construction(case, ref)
        _, got = _outcome_of_construction(case, "boxd")
    else:
        _, want = _outcome(case, ref)
        _, got = _outcome(case, "boxd")
    if want is None:
        assert got is None, f"Gymnasium accepts this call; boxd raised {got!r}"
        return
    assert got is not None, f"Gymnasium raised {want!r}; boxd did not raise"
    assert isinstance(got, type(want)), (
        f"boxd raised {type(got).__mro__}, Gymnasium {type(want).__qualname__}: {want}")
    if case.type_only:
        return
    if case.env_raised:
        assert isinstance(got, rl.EnvError)
        # AsyncVectorEnv re-raises ``exctype(exc)`` of the *last* failing worker, whose
        # str is not always the env's ("not enough arguments for format string"):
        # only the type is compared with it.
        if ref == "sync":
            assert str(want) in str(got), f"boxd: {got}\ngym:  {want}"
        return
    expected = str(want).replace("`AsyncVectorEnv`", "`VectorEnv`")
    assert str(got) == expected


def _outcome_of_construction(case: Case, kind: str) -> tuple[Any, BaseException | None]:
    try:
        env = _make(kind, case.fns(), **case.kw)
    except Exception as exc:
        return None, exc
    env.close()
    return env, None


# ---------------------------------------------------------------- boxd's own errors


def test_boxd_typed_errors_keep_their_boxd_types() -> None:
    """Gymnasium's types are added to boxd's, not swapped for them."""
    with pytest.raises(errors.InvalidRequest):
        rl.VectorEnv([], source=rl.local())
    with pytest.raises(errors.InvalidRequest):
        rl.VectorEnv([1], source=rl.local())  # type: ignore[list-item]
    env = rl.VectorEnv(_fns(2), source=rl.local(), pickle_by_value=[_rl_envs])
    try:
        env.reset(seed=0)
        with pytest.raises(RuntimeError):  # as before: still a RuntimeError too
            env.step_wait()
        env.step_async(_zeros(2))
        with pytest.raises(RuntimeError):
            env.step_async(_zeros(2))
        env.step_wait()
    finally:
        env.close()
    with pytest.raises(errors.StateError) as closed:
        env.reset()
    assert isinstance(closed.value, gym.error.ClosedEnvironmentError)


def test_a_sub_env_error_is_also_the_env_s_exception_type() -> None:
    fns = [Count, functools.partial(_rl_envs.CrashEnv, 1)]
    env = rl.VectorEnv(fns, source=rl.local(), pickle_by_value=[_rl_envs])
    try:
        env.reset()
        with pytest.raises(ValueError, match="crash at 1") as info:
            env.step(_zeros(2))
        exc = info.value
        assert isinstance(exc, rl.EnvError) and exc.index == 1
        assert exc.remote_type == "ValueError" and "in step" in exc.traceback
        # It pickles (as a cluster node's errors must) and comes back alike.
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.index == 1
        # Gymnasium's own errors raised in the env keep their type.
        with pytest.raises(gym.error.Error, match="Seed must be a python integer"):
            env.reset(seed=["a", "b"])  # type: ignore[list-item]
    finally:
        env.close()


def test_a_step_timeout_is_also_multiprocessings_timeout_error() -> None:
    env = rl.VectorEnv(_fns(1, delay=1.0), source=rl.local(), pickle_by_value=[_rl_envs])
    try:
        env.reset()
        env.step_async(_zeros(1))
        with pytest.raises(multiprocessing.TimeoutError) as info:
            env.step_wait(timeout=0.1)
        assert isinstance(info.value, rl.EnvTimeout) and isinstance(info.value, TimeoutError)
    finally:
        env.close()
