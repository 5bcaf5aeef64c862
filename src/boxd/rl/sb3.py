"""`boxd.rl.sb3.VecEnv`: a Stable-Baselines3 `VecEnv` whose sub-envs run in machines.

Needs ``boxd[sb3]``. SB3's conventions: ``reset()`` returns observations only (infos
in ``reset_infos``); ``step_wait()`` returns ``(obs, rewards, dones, infos)`` with a
list of info dicts, and resets a finished sub-env inside the same step, putting its
last observation in ``infos[i]["terminal_observation"]`` and
``infos[i]["TimeLimit.truncated"]`` (truncated and not terminated).

Seeds and options (a deliberate difference from SB3's `DummyVecEnv`, which drops them
on autoreset): ``seed(s)`` seeds each sub-env's *next* reset, whether that is an
explicit ``reset()`` or an autoreset, then is used up; ``set_options(o)`` applies to
every reset of the sub-envs from then on, autoresets included, until changed.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Sequence
from copy import deepcopy
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array
from stable_baselines3.common.vec_env.base_vec_env import VecEnv as _SB3VecEnv

from boxd.rl import _server as W
from boxd.rl._channel import Home, MakeRequest
from boxd.rl._env import DEFAULT_RESET_MODE, ResetMode, check_reset_mode, resolve_home
from boxd.rl._pool import RECOVERABLE, PendingStep, Pool
from boxd.rl._vector import NoPendingCallError, PendingCallError

if TYPE_CHECKING:
    from boxd.sdk._sync import Boxd

__all__ = ["VecEnv"]


class VecEnv(_SB3VecEnv):
    """A Stable-Baselines3 `VecEnv` of machine-backed sub-envs, stepped concurrently.

    Args:
        env_fns_or_ids: callables that build the sub-envs (shipped with cloudpickle),
            Gymnasium ids / ``"module:function"`` strings, or one of either with
            ``num_envs``.
        num_envs: the number of sub-envs when one factory or id is given.
        source: the machine to fork (name or id), or a `Home` such as `boxd.rl.local()`.
        image: instead of ``source``, a boxd image (``NAME[:TAG]``, ``boxd image list``)
            whose ``python3`` has the env's packages: a machine started from it (its
            service ready) is the source, and goes with the rest at ``close``.
        reset_mode: ``"env"``, ``"rewind"`` or ``"refork"`` (see `boxd.rl.Env`).
        recover: replace a sub-env whose machine died (its episode ends as truncated,
            ``infos[i]["recovered"] = True``); without it the failure is raised.
        step_timeout: seconds a step may take (None: no limit).
        boxd: the client (``Boxd()`` if None).
        pickle_by_value: modules whose code travels with the factories.
        envs_per_machine: sub-envs per machine (see `boxd.rl.VectorEnv`).
        **make_kwargs: keyword arguments for every sub-env's constructor.

    Raises:
        InvalidRequest, EnvError, EnvModuleNotFound (see `boxd.rl.VectorEnv`).
    """

    def __init__(
        self,
        env_fns_or_ids: Sequence[Callable[..., Any] | str] | Callable[..., Any] | str,
        num_envs: int | None = None,
        *,
        source: str | Home | None = None,
        image: str | None = None,
        reset_mode: ResetMode = DEFAULT_RESET_MODE,
        recover: bool = False,
        step_timeout: float | None = None,
        boxd: Boxd | None = None,
        pickle_by_value: Sequence[Any] = (),
        envs_per_machine: int = 1,
        **make_kwargs: Any,
    ) -> None:
        from boxd import errors

        if isinstance(env_fns_or_ids, str) or callable(env_fns_or_ids):
            if num_envs is None or num_envs < 1:
                raise errors.InvalidRequest("give num_envs >= 1 with one env id or callable",
                                            field="num_envs")
            factories: list[Any] = [env_fns_or_ids] * num_envs
        else:
            factories = list(env_fns_or_ids)
        self.reset_mode: ResetMode = check_reset_mode(reset_mode)
        self.recover = recover
        makes = [MakeRequest.of(f, make_kwargs, pickle_by_value) for f in factories]
        self._pool = Pool(resolve_home(source, boxd, image), makes, reset_mode=self.reset_mode,
                          step_timeout=step_timeout, envs_per_machine=envs_per_machine)
        self.envs_per_machine = envs_per_machine
        self._closed = False
        try:
            infos = self._pool.infos
            obs_space = W.space_from_wire(infos[0]["observation_space"])
            act_space = W.space_from_wire(infos[0]["action_space"])
            self._render_modes = [i.get("render_mode") for i in infos]
            n = len(makes)
            self._batch_space = batch_space(obs_space, n)
            self._buf: Any = create_empty_array(obs_space, n=n, fn=np.zeros)
            self._obs: list[Any] = [None] * n
            self._last_obs: list[Any] = [None] * n
            #: the step `step_async` sent, until `step_wait` collects it
            self._pending: PendingStep | None = None
            self._persistent_options: list[dict[str, Any]] = [{} for _ in range(n)]
            super().__init__(n, obs_space, act_space)
        except BaseException:
            self._pool.close()
            raise

    @property
    def machines(self) -> list[str | None]:
        """The id of each sub-env's machine (None for local servers)."""
        return self._pool.machines

    # ------------------------------------------------------------------ stepping

    def _reset_args(self, i: int) -> tuple[int | None, Any]:
        """The seed and options sub-env ``i``'s next reset uses (see `_used`)."""
        opts = self._options[i] or self._persistent_options[i]
        return self._seeds[i], (opts or None)

    def _used(self, i: int) -> None:
        """Sub-env ``i`` was reset: its seed is used up, its options stay."""
        self._seeds[i] = None
        if self._options[i]:
            self._persistent_options[i] = self._options[i]
            self._options[i] = {}

    def _next_reset(self, i: int) -> tuple[int | None, Any]:
        args = self._reset_args(i)
        self._used(i)
        return args

    def reset(self) -> Any:
        """Reset every sub-env; returns the batched observations (infos in
        ``reset_infos``).

        Raises:
            PendingCallError: a `step_async` awaits its `step_wait`.
        """
        self._check_no_pending("reset")
        n = self.num_envs
        args = [self._next_reset(i) for i in range(n)]
        results = self._pool.reset(range(n), [a[0] for a in args], [a[1] for a in args])
        for i in self._recover(results):
            args_i = self._next_reset(i)
            again = self._pool.reset([i], [args_i[0]] * n, [args_i[1]] * n)
            results[i] = self._pool.values(again)[i]
        for i, (obs, info) in enumerate(results):
            self._obs[i] = obs
            self.reset_infos[i] = info
        return self._batch()

    def step_async(self, actions: np.ndarray[Any, Any]) -> None:
        """Send the actions: every sub-env starts its step now, while the learner goes
        on (as SB3's `SubprocVecEnv`); `step_wait` collects. A sub-env's failure is
        raised by `step_wait`.

        Raises:
            PendingCallError: a step is already pending (Gymnasium's
                `AlreadyPendingCallError`; SB3's vectorisers do not check).
        """
        self._check_no_pending("step_async")
        acts = [actions[i] for i in range(self.num_envs)]
        self._pending = self._pool.start_step(acts, autoreset=self._reset_args)

    def _check_no_pending(self, what: str) -> None:
        """A request to the sub-envs while a step is sent and not collected would read
        the step's replies as its own."""
        if self._pending is not None:
            raise PendingCallError(f"Calling `{what}` while waiting for a pending call to "
                                   "`step` to complete.", "step")

    def step_wait(self) -> tuple[Any, np.ndarray[Any, Any], np.ndarray[Any, Any],
                                 list[dict[str, Any]]]:
        """Collect the step `step_async` sent.

        Raises:
            NoPendingCallError: no step is pending.
            EnvError, EnvServerLost, EnvTimeout: a sub-env failed (without ``recover``).
        """
        if self._pending is None:
            raise NoPendingCallError(
                "Calling `step_wait` without any prior call to `step_async`.", "step")
        pending, self._pending = self._pending, None
        n = self.num_envs
        results = self._pool.finish_step(pending)
        recovered = self._recover(results)
        rewards = np.zeros(n, dtype=np.float32)
        dones = np.zeros(n, dtype=np.bool_)
        infos: list[dict[str, Any]] = []
        for i in range(n):
            if i in recovered:
                info = {"recovered": True, "TimeLimit.truncated": True,
                        "terminal_observation": self._obs[i]}
                seed, opts = self._next_reset(i)
                fresh = self._pool.values(self._pool.reset([i], [seed] * n, [opts] * n))[i]
                self._obs[i], self.reset_infos[i] = fresh
                dones[i] = True
                infos.append(info)
                continue
            obs, reward, terminated, truncated, info, final = results[i]
            rewards[i] = reward
            dones[i] = terminated or truncated
            if final is not None:
                self._used(i)
                # The new episode's reset info goes to reset_infos; infos[i] is the
                # finished step's info with its last observation.
                self.reset_infos[i] = info
                final_obs, info = final
                info = dict(info)
                info["terminal_observation"] = final_obs
            else:
                info = dict(info)
            info["TimeLimit.truncated"] = bool(truncated and not terminated)
            self._obs[i] = obs
            infos.append(info)
        return self._batch(), rewards, dones, infos

    def _recover(self, results: list[Any]) -> set[int]:
        failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
        if not failed:
            return set()
        for i in failed:
            if not self.recover or not isinstance(results[i], RECOVERABLE):
                raise results[i]
        replaced: set[int] = set()
        for i in failed:
            if i not in replaced:  # a machine's sub-envs are replaced together
                replaced.update(self._pool.replace(i))
        return replaced

    def _batch(self) -> Any:
        self._buf = concatenate(self.observation_space, self._obs, self._buf)
        return deepcopy(self._buf)

    # ------------------------------------------------------------------ the rest

    def close(self) -> None:
        """Close every sub-env and delete its machine. Idempotent."""
        if not self._closed:
            self._closed = True
            pending, self._pending = self._pending, None
            if pending is not None:  # its replies first, as SubprocVecEnv.close reads them
                with contextlib.suppress(Exception):
                    self._pool.collect(pending.sent, 30.0)
            self._pool.close()

    def _indices(self, indices: int | Iterable[int] | None) -> list[int]:
        return list(self._get_indices(indices))

    def _broadcast(self, indices: int | Iterable[int] | None,
                   make: Callable[[int], tuple[Any, ...]]) -> list[Any]:
        self._check_no_pending("env_method")
        idx = self._indices(indices)
        reqs: list[Any] = [None] * self.num_envs
        for i in idx:
            reqs[i] = make(i)
        results = self._pool.values(self._pool.broadcast(reqs))
        return [results[i] for i in idx]

    def get_attr(self, attr_name: str, indices: int | Iterable[int] | None = None) -> list[Any]:
        """An attribute of the sub-envs (``render_mode`` is known from construction)."""
        if attr_name == "render_mode":
            return [self._render_modes[i] for i in self._indices(indices)]
        return self._broadcast(indices, lambda i: ("get_attr", attr_name))

    def set_attr(self, attr_name: str, value: Any,
                 indices: int | Iterable[int] | None = None) -> None:
        self._broadcast(indices, lambda i: ("set_attr", attr_name, value))

    def env_method(self, method_name: str, *method_args: Any,
                   indices: int | Iterable[int] | None = None, **method_kwargs: Any) -> list[Any]:
        return self._broadcast(indices, lambda i: ("call", method_name, method_args,
                                                   method_kwargs))

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper[Any, Any, Any, Any]],
                       indices: int | Iterable[int] | None = None) -> list[bool]:
        name = f"{wrapper_class.__module__}.{wrapper_class.__qualname__}"
        return self._broadcast(indices, lambda i: ("has_wrapper", name))

    def get_images(self) -> Sequence[np.ndarray[Any, Any] | None]:
        if self.render_mode != "rgb_array":
            warnings.warn(f"The render mode is {self.render_mode}, but this method assumes "
                          "it is `rgb_array` to obtain images.", stacklevel=2)
            return [None] * self.num_envs
        return self._broadcast(None, lambda i: ("call", "render", (), {}))

