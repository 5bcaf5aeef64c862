"""boxd.rl.VectorEnv raises what the *installed* Gymnasium raises (issue 39, item 9).

boxd supports ``gymnasium>=1.0``; Gymnasium 1.3's `SyncVectorEnv` asserts where 1.4's
raises TypeError/ValueError/RuntimeError. The dev extras install 1.4, so this test
installs 1.3's behaviour into `SyncVectorEnv` (its checks as 1.3.0 wrote them, copied
from its source) and checks that boxd follows. The other direction, 1.4's own errors,
is tests/unit/test_rl_vector_conformance.py; that file also passes as is under a real
Gymnasium 1.3.0 (see docs/rl.md, "Errors: Gymnasium's").
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv
from tests._support import rl_envs as _rl_envs

import boxd.rl as rl


def _assert(condition: bool, message: str) -> None:
    """1.3's ``assert condition, message``, with its message as is (this module's own
    asserts are rewritten by pytest)."""
    if not condition:
        raise AssertionError(message)


def _as_gymnasium_1_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """SyncVectorEnv's reset and space checks as in Gymnasium 1.3.0: assertions."""
    reset, init = SyncVectorEnv.reset, SyncVectorEnv.__init__

    def reset_1_3(self: SyncVectorEnv, *, seed: Any = None, options: Any = None) -> Any:
        if seed is not None and not isinstance(seed, int):
            _assert(len(seed) == self.num_envs, (
                f"If seeds are passed as a list the length must match num_envs="
                f"{self.num_envs} but got length={len(seed)}."))
        if options is not None and "reset_mask" in options:
            reset_mask = options["reset_mask"]
            _assert(isinstance(reset_mask, np.ndarray), (
                f"`options['reset_mask': mask]` must be a numpy array, got {type(reset_mask)}"))
            _assert(reset_mask.shape == (self.num_envs,), (
                f"`options['reset_mask': mask]` must have shape `({self.num_envs},)`, "
                f"got {reset_mask.shape}"))
            _assert(reset_mask.dtype == np.bool_, (
                f"`options['reset_mask': mask]` must have `dtype=np.bool_`, "
                f"got {reset_mask.dtype}"))
            _assert(bool(np.any(reset_mask)), (
                "`options['reset_mask': mask]` must contain a boolean array, "
                f"got reset_mask={reset_mask}"))
        return reset(self, seed=seed, options=options)

    def init_1_3(self: SyncVectorEnv, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except RuntimeError as exc:  # 1.3 asserted the same conditions
            raise AssertionError(str(exc)) from None

    monkeypatch.setattr(SyncVectorEnv, "reset", reset_1_3)
    monkeypatch.setattr(SyncVectorEnv, "__init__", init_1_3)


def _bad_resets() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("seed list", {"seed": [1, 2, 3]}),
        ("mask not an array", {"options": {"reset_mask": [True, False]}}),
        ("mask shape", {"options": {"reset_mask": np.array([True])}}),
        ("mask dtype", {"options": {"reset_mask": np.array([1, 0])}}),
        ("mask all false", {"options": {"reset_mask": np.array([False, False])}}),
    ]


def _outcome(env: Any, kwargs: dict[str, Any]) -> BaseException:
    # a copy: SyncVectorEnv pops "reset_mask" from the options it is given
    kwargs = {k: dict(v) if isinstance(v, dict) else v for k, v in kwargs.items()}
    with pytest.raises(Exception) as got:
        env.reset(**kwargs)
    return got.value


def test_reset_errors_follow_the_installed_gymnasium(monkeypatch: pytest.MonkeyPatch) -> None:
    fns = [functools.partial(_rl_envs.CountEnv) for _ in range(2)]
    env = rl.VectorEnv(fns, source=rl.local(), pickle_by_value=[_rl_envs])
    try:
        env.reset(seed=0)
        for emulated in (False, True):
            if emulated:
                _as_gymnasium_1_3(monkeypatch)
            sync = SyncVectorEnv(fns)
            for name, kwargs in _bad_resets():
                want, got = _outcome(sync, kwargs), _outcome(env, kwargs)
                assert type(got) is type(want), (name, emulated, got, want)
                assert str(got) == str(want), (name, emulated)
                assert isinstance(got, AssertionError) or not emulated
            sync.close()
        env.reset(options={"reset_mask": np.array([True, False])})  # a good call still works
    finally:
        env.close()


def test_space_errors_follow_the_installed_gymnasium(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_gymnasium_1_3(monkeypatch)
    fns = [functools.partial(_rl_envs.CountEnv), functools.partial(_rl_envs.CountEnv, n_obs=9)]
    with pytest.raises(AssertionError) as want:
        SyncVectorEnv(fns)
    with pytest.raises(AssertionError) as got:
        rl.VectorEnv(fns, source=rl.local(), pickle_by_value=[_rl_envs])
    assert str(got.value) == str(want.value) and "not equivalent" in str(got.value)
