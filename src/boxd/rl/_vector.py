"""`boxd.rl.VectorEnv`: a Gymnasium 1.x vector env whose sub-envs run in machines."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from boxd import errors
from boxd.rl import _conformance
from boxd.rl import _server as W
from boxd.rl._channel import Home, MakeRequest
from boxd.rl._env import DEFAULT_RESET_MODE, ResetMode, check_reset_mode, resolve_home
from boxd.rl._pool import RECOVERABLE, PendingStep, Pool

if TYPE_CHECKING:
    from boxd.rl._branch import EnvState
    from boxd.sdk._sync import Boxd

#: The info key (with its ``_recovered`` mask) that reports a replaced sub-env.
RECOVERED = "recovered"


# Errors: each is what `SyncVectorEnv` (or, for what only it has, `AsyncVectorEnv`)
# raises on the same path, with the same message, and also boxd's type where boxd had
# one (tests/unit/test_rl_vector_conformance.py compares them call by call).


class VectorEnvClosed(errors.StateError, gym.error.ClosedEnvironmentError):
    """A call after `VectorEnv.close` (its machines are gone): `AsyncVectorEnv`'s
    `gymnasium.error.ClosedEnvironmentError`, and boxd's `StateError`."""


class PendingCallError(gym.error.AlreadyPendingCallError, RuntimeError):
    """A call while a `VectorEnv.step_async` awaits its `VectorEnv.step_wait`
    (`AsyncVectorEnv`'s error; also a `RuntimeError`, as boxd raised before)."""


class NoPendingCallError(gym.error.NoAsyncCallError, RuntimeError):
    """`VectorEnv.step_wait` without a `VectorEnv.step_async` (`AsyncVectorEnv`'s
    error; also a `RuntimeError`, as boxd raised before)."""


class _EnvFnsEmpty(errors.InvalidRequest, IndexError):
    """No env fns: Gymnasium's IndexError, and boxd's InvalidRequest."""


class _EnvFnNotCallable(errors.InvalidRequest, TypeError):
    """An env fn that is not callable (nor an id): Gymnasium's TypeError, and boxd's
    InvalidRequest."""


class _StepOfFinishedEnv(AssertionError, RuntimeError):
    """A DISABLED-mode step of a finished sub-env: `SyncVectorEnv`'s assertion (also
    a `RuntimeError`, as boxd raised before)."""


class VectorEnv(gym.vector.VectorEnv[Any, Any, Any]):
    """A `gymnasium.vector.VectorEnv` whose sub-envs each run in their own fork of
    ``source``, stepped concurrently.

    Gymnasium 1.x semantics: ``autoreset_mode`` NEXT_STEP (a finished sub-env resets on
    the next ``step``, which ignores its action and returns reward 0 and no flags),
    SAME_STEP (it resets inside the finishing step; ``infos["final_obs"]`` and
    ``infos["final_info"]`` with their ``_final_obs``/``_final_info`` masks hold what
    the episode ended with) or DISABLED (reset it with ``options={"reset_mask": ...}``).
    ``reset(seed=s)`` seeds sub-env ``i`` with ``s + i`` (or takes a list); autoresets
    are unseeded. Infos are a dict of arrays with a ``_key`` bool mask per key.

    Args:
        env_fns: callables that build the sub-envs (as for `SyncVectorEnv`; each is
            shipped to its machine with cloudpickle and called there), or a Gymnasium
            id / ``"module:function"`` with ``num_envs``.
        num_envs: the number of sub-envs when ``env_fns`` is an id or one callable.
        source: the machine to fork (name or id), or a `Home` such as `boxd.rl.local()`.
        image: instead of ``source``, a boxd image (``NAME[:TAG]``, ``boxd image list``)
            whose ``python3`` has the env's packages: a machine started from it (its
            service ready) is the source, and goes with the rest at ``close``.
        autoreset_mode: an `AutoresetMode` or its string value.
        reset_mode: how an explicit reset or an autoreset happens: ``"env"``,
            ``"rewind"`` or ``"refork"`` (see `boxd.rl.Env`).
        recover: when a sub-env's machine dies or does not answer within
            ``step_timeout``, refork that slot from ``source`` and keep the others'
            episodes; the step reports the slot ``truncated`` with
            ``infos["recovered"]`` set (without it the failure is raised, naming the
            sub-env's index).
        step_timeout: seconds a step may take (None: no limit).
        boxd: the client (``Boxd()`` if None).
        pickle_by_value: modules whose code travels with the factories.
        copy: return copies of the batched observations (as `SyncVectorEnv`).
        envs_per_machine: sub-envs per machine (1: each in its own fork). With k > 1,
            k consecutive sub-envs share one fork and one env server (the last machine
            holds the rest), and a step is one frame per machine; they are not isolated
            from each other (see docs/rl.md, "Several envs per machine").
        **make_kwargs: keyword arguments for every sub-env's constructor.

    Raises:
        InvalidRequest: bad arguments (an empty ``env_fns`` is also an `IndexError`, an
            env fn that is not callable a `TypeError`, as for `SyncVectorEnv`).
        ValueError: not an `AutoresetMode`.
        EnvError, EnvModuleNotFound: a sub-env could not be built (``index`` says which;
            also an instance of the exception the env raised).
        RuntimeError: the sub-envs' spaces differ (`SyncVectorEnv`'s message).

    Errors are Gymnasium's: each error path raises what `SyncVectorEnv` raises there
    (or `AsyncVectorEnv`, for ``step_async``/``step_wait`` and calls after ``close``),
    with the same message; boxd's own errors are also instances of Gymnasium's type
    where one applies (see docs/rl.md, "Errors").
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[..., Any]] | Callable[..., Any] | str,
        num_envs: int | None = None,
        *,
        source: str | Home | None = None,
        image: str | None = None,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        reset_mode: ResetMode = DEFAULT_RESET_MODE,
        recover: bool = False,
        step_timeout: float | None = None,
        boxd: Boxd | None = None,
        pickle_by_value: Sequence[Any] = (),
        copy: bool = True,
        envs_per_machine: int = 1,
        **make_kwargs: Any,
    ) -> None:
        super().__init__()
        self.autoreset_mode = (autoreset_mode if isinstance(autoreset_mode, AutoresetMode)
                               else AutoresetMode(autoreset_mode))
        self.reset_mode: ResetMode = check_reset_mode(reset_mode)
        self.recover = recover
        self.step_timeout = step_timeout
        self.copy = copy
        factories = _factories(env_fns, num_envs)
        makes = [MakeRequest.of(f, make_kwargs, pickle_by_value) for f in factories]
        self.num_envs = len(makes)
        self._pool = Pool(resolve_home(source, boxd, image), makes, reset_mode=self.reset_mode,
                          step_timeout=step_timeout, envs_per_machine=envs_per_machine)
        self.envs_per_machine = envs_per_machine
        try:
            self._init_spaces()
        except BaseException:
            self._pool.close()
            # Closed for good: a later __del__ must not close the pool again (from a
            # garbage collection inside another pool's thread pool, that deadlocks).
            self.closed = True
            raise
        self._obs: list[Any] = [None] * self.num_envs
        self._observations: Any = create_empty_array(self.single_observation_space,
                                                n=self.num_envs, fn=np.zeros)
        self._rewards = np.zeros((self.num_envs,), dtype=np.float64)
        self._terminations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._truncations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._autoreset_envs = np.zeros((self.num_envs,), dtype=np.bool_)
        #: the step `step_async` sent (or the error `step_wait` raises), or None
        self._pending: PendingStep | _StepOfFinishedEnv | None = None

    def _init_spaces(self) -> None:
        infos = self._pool.infos
        first = infos[0]
        self.single_observation_space = W.space_from_wire(first["observation_space"])
        self.single_action_space = W.space_from_wire(first["action_space"])
        subs = [(W.space_from_wire(i["observation_space"]), W.space_from_wire(i["action_space"]))
                for i in infos]
        try:
            self._check_spaces(subs)
        except RuntimeError as ours:  # the installed SyncVectorEnv's error, if it has one
            raise _conformance.spaces_error(subs) or ours from None
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = dict(first.get("metadata") or {})
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = first.get("render_mode")

    def _check_spaces(self, subs: list[tuple[Any, Any]]) -> None:
        for obs_space, act_space in subs:  # SyncVectorEnv 1.4's checks, in its order
            if obs_space != self.single_observation_space:
                raise RuntimeError(
                    "SyncVectorEnv(..., observation_mode='same') however the "
                    "sub-environments observation spaces are not equivalent. "
                    f"single_observation_space={self.single_observation_space}, "
                    f"sub-environment observation_space={obs_space}. If this is "
                    "intentional, use `observation_mode='different'` instead.")
            if act_space != self.single_action_space:
                raise RuntimeError(
                    "Sub-environment action space doesn't make the `single_action_space`, "
                    f"action_space={act_space}, "
                    f"single_action_space={self.single_action_space}")

    @property
    def machines(self) -> list[str | None]:
        """The id of each sub-env's machine (None for local servers)."""
        return self._pool.machines

    # ------------------------------------------------------------------ reset

    def reset(
        self, *, seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset all sub-envs (or those in ``options["reset_mask"]``).

        Raises:
            TypeError, ValueError: a bad seed list or reset mask (as Gymnasium's).
            VectorEnvClosed: after `close`.
            PendingCallError: a `step_async` awaits its `step_wait`.
            EnvError, EnvServerLost, EnvTimeout: a sub-env failed (``index`` says which).
        """
        self._check_open()
        if isinstance(seed, int) and not isinstance(seed, bool):
            super().reset(seed=seed)
        given = options
        try:
            seeds = _seeds(seed, self.num_envs)
        except (TypeError, ValueError) as ours:
            raise self._as_installed(ours, seed, given) from None
        self._check_no_pending("reset_async", period=False)
        # Copied, where SyncVectorEnv pops "reset_mask" from the caller's dict.
        options = dict(options) if isinstance(options, dict) else options
        try:
            mask = self._reset_mask(options)
        except (TypeError, ValueError) as ours:
            raise self._as_installed(ours, seed, given) from None
        indices = [i for i in range(self.num_envs) if mask is None or mask[i]]
        mask_set = set(indices)
        results = self._pool.reset(indices, seeds, [options] * self.num_envs)
        recovered = self._recover_or_raise(results, indices)
        if recovered:  # fresh slots: reset them as asked (a second failure is raised)
            # A replaced machine's other sub-envs (outside the mask) start over too,
            # unseeded, and are reported recovered.
            outside = sorted(recovered.difference(indices))
            seeds = [None if i in outside else seeds[i] for i in range(self.num_envs)]
            again = self._pool.reset(sorted(recovered), seeds, [options] * self.num_envs)
            self._pool.values([again[i] for i in recovered])
            for i in recovered:
                results[i] = again[i]
            indices = sorted(set(indices) | recovered)
        infos: dict[str, Any] = {}
        for i in indices:
            obs, info = results[i]
            self._obs[i] = obs
            if i in recovered and i not in mask_set:
                info = {**info, RECOVERED: True}
            infos = self._add_info(infos, info, i)
            self._terminations[i] = self._truncations[i] = self._autoreset_envs[i] = False
        self._observations = concatenate(self.single_observation_space, self._obs,
                                         self._observations)
        return (deepcopy(self._observations) if self.copy else self._observations), infos

    def _as_installed(self, ours: Exception, seed: Any, options: Any) -> BaseException:
        """What the installed Gymnasium's `SyncVectorEnv` raises for this bad reset
        (its version's type and message: see `boxd.rl._conformance`), else ``ours``."""
        return _conformance.reset_error(self.num_envs, seed, options) or ours

    def _reset_mask(self, options: Any) -> np.ndarray[Any, Any] | None:
        if options is None or "reset_mask" not in options:
            return None
        mask = options.pop("reset_mask")
        if not isinstance(mask, np.ndarray):
            raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
        if mask.shape != (self.num_envs,):
            raise ValueError(f"`options['reset_mask']` must have shape `({self.num_envs},)`, "
                             f"got {mask.shape}")
        if mask.dtype != np.bool_:
            raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, "
                            f"got {mask.dtype}")
        if not np.any(mask):
            raise ValueError("`options['reset_mask']` must contain a boolean array with at "
                             f"least one True value, got reset_mask={mask}")
        return mask

    # ------------------------------------------------------------------ step

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every sub-env concurrently (see the class docstring for autoresets).

        Raises:
            EnvError, EnvServerLost, EnvTimeout: a sub-env failed (``index`` says which).
        """
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Send the actions: every sub-env starts its step now, while the caller goes
        on (as `AsyncVectorEnv`); `step_wait` collects the results. A sub-env's failure
        is raised by `step_wait`.

        Raises:
            VectorEnvClosed: after `close`.
            PendingCallError: a step is already pending.
            TypeError: ``actions`` cannot be iterated as a batch of ``action_space``.
            ValueError: the batch does not hold ``num_envs`` actions (SyncVectorEnv's
                ``zip(..., strict=True)`` message).
        """
        self._check_open()
        self._check_no_pending("step_async")
        # As SyncVectorEnv pairs them: zip(actions, envs, strict=True) (but before any
        # sub-env is stepped).
        acts = [a for a, _ in zip(iterate(self.action_space, actions), range(self.num_envs),
                                  strict=True)]
        mode = self.autoreset_mode
        if mode == AutoresetMode.DISABLED and np.any(self._autoreset_envs):
            # SyncVectorEnv's `assert not self._autoreset_envs[i], f"{self._autoreset_envs=}"`
            # (the finished sub-envs need reset(options={"reset_mask": ...}) first):
            # nothing is sent, step_wait raises it.
            self._pending = _StepOfFinishedEnv(f"self._autoreset_envs={self._autoreset_envs!r}")
            return
        resets = [i for i in range(self.num_envs) if mode == AutoresetMode.NEXT_STEP
                  and self._autoreset_envs[i]]
        # One frame per machine: the NEXT_STEP resets travel with the others' steps.
        self._pending = self._pool.start_step(
            acts, resets=resets,
            autoreset=(lambda i: (None, None)) if mode == AutoresetMode.SAME_STEP else None)

    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Collect the step sent by `step_async` (``timeout``, from this call, overrides
        ``step_timeout``).

        Raises:
            VectorEnvClosed: after `close`.
            NoPendingCallError: no step is pending.
            AssertionError: with autoreset_mode DISABLED, a finished sub-env was not reset
                (SyncVectorEnv's assertion; also a RuntimeError).
            EnvError, EnvServerLost, EnvTimeout: a sub-env failed (``index`` says which).
        """
        self._check_open()
        if self._pending is None:
            raise NoPendingCallError(
                "Calling `step_wait` without any prior call to `step_async`.", "step")
        pending, self._pending = self._pending, None
        if isinstance(pending, _StepOfFinishedEnv):
            raise pending
        n = self.num_envs
        results = self._pool.finish_step(pending, timeout)
        recovered = self._recover_or_raise(results, list(range(n)))
        infos: dict[str, Any] = {}
        for i in range(n):
            if i in recovered:
                infos = self._record_cut_short(i, infos)
            elif i in pending.resets:
                infos = self._record_reset(i, results[i], infos)
            else:
                infos = self._record_step(i, results[i], infos)
        self._observations = concatenate(self.single_observation_space, self._obs,
                                         self._observations)
        self._autoreset_envs = np.logical_or(self._terminations, self._truncations)
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            # A recovered slot is fresh (built, not reset): the next step resets it.
            for i in recovered:
                self._autoreset_envs[i] = True
        return (deepcopy(self._observations) if self.copy else self._observations,
                np.copy(self._rewards), np.copy(self._terminations),
                np.copy(self._truncations), infos)

    def _record_step(self, i: int, result: Any, infos: dict[str, Any]) -> dict[str, Any]:
        """Sub-env ``i``'s step (and, in SAME_STEP mode, the episode it ended) into the
        batch; returns ``infos`` with its info added."""
        obs, reward, terminated, truncated, info, final = result
        self._obs[i] = obs
        self._rewards[i] = reward
        self._terminations[i] = terminated
        self._truncations[i] = truncated
        if final is not None:
            infos = self._add_info(infos, {"final_obs": final[0], "final_info": final[1]}, i)
        return self._add_info(infos, info, i)

    def _record_reset(self, i: int, result: Any, infos: dict[str, Any]) -> dict[str, Any]:
        """Sub-env ``i``'s NEXT_STEP reset (reward 0, no flags) into the batch."""
        self._obs[i], info = result
        self._rewards[i] = 0.0
        self._terminations[i] = self._truncations[i] = False
        return self._add_info(infos, info, i)

    def _record_cut_short(self, i: int, infos: dict[str, Any]) -> dict[str, Any]:
        """Sub-env ``i``'s episode was cut short by its machine (the slot was replaced):
        report it truncated with the last observation. The fresh slot starts its episode
        on the next reset, or, in SAME_STEP mode, now.

        Raises:
            EnvError, EnvServerLost, EnvTimeout: that SAME_STEP reset failed.
        """
        self._rewards[i] = 0.0
        self._terminations[i] = False
        self._truncations[i] = True
        infos = self._add_info(infos, {RECOVERED: True}, i)
        if self.autoreset_mode == AutoresetMode.SAME_STEP:
            infos = self._add_info(infos, {"final_obs": self._obs[i], "final_info": {}}, i)
            fresh = self._pool.reset([i], [None] * self.num_envs, [None] * self.num_envs)[i]
            if isinstance(fresh, BaseException):
                raise fresh
            self._obs[i], info = fresh
            infos = self._add_info(infos, info, i)
        return infos

    def _recover_or_raise(self, results: list[Any], indices: Sequence[int]) -> set[int]:
        """Replace failed slots when ``recover`` allows it; else raise the first failure."""
        failed = [i for i in indices if isinstance(results[i], BaseException)]
        if not failed:
            return set()
        if not self.recover or any(not isinstance(results[i], RECOVERABLE) for i in failed):
            first = next(results[i] for i in failed
                         if not self.recover or not isinstance(results[i], RECOVERABLE))
            raise first
        replaced: set[int] = set()
        for i in failed:
            if i not in replaced:  # a machine's sub-envs are replaced together
                replaced.update(self._pool.replace(i))
        return replaced

    # ------------------------------------------------------------------ the rest

    def render(self) -> tuple[Any, ...] | None:
        """Every sub-env's ``render()``."""
        return tuple(self.call("render"))

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call a method (or read an attribute) of every sub-env.

        Raises:
            VectorEnvClosed: after `close`.
            PendingCallError: a `step_async` awaits its `step_wait`.
            EnvError: a sub-env raised (``index`` says which).
        """
        self._check_open()
        self._check_no_pending("call_async")
        results = self._pool.broadcast([("call", name, args, kwargs)] * self.num_envs)
        return tuple(self._pool.values(results))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """An attribute of every sub-env (a method is called, as Gymnasium's
        vectorisers do: this is `call` with no arguments)."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set an attribute of every sub-env: one value per sub-env if ``values`` is a
        list or tuple, else the same value for all.

        Raises:
            VectorEnvClosed: after `close`.
            ValueError: the number of values is not ``num_envs``.
            PendingCallError: a `step_async` awaits its `step_wait`.
        """
        self._check_open()
        if not isinstance(values, list | tuple):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError("Values must be a list or tuple with length equal to the number "
                             f"of environments. Got `{len(values)}` values for "
                             f"{self.num_envs} environments.")
        self._check_no_pending("set_attr")
        self._pool.values(self._pool.broadcast(
            [("set_attr", name, v) for v in values]))

    def close_extras(self, **kwargs: Any) -> None:
        """Close every sub-env and delete its machine, by label: those whose creation
        answered and those whose answer was lost (a pending step is collected first, its
        results dropped, as `AsyncVectorEnv.close` waits for it)."""
        self._drain_pending()
        self._pool.close()

    @property
    def labels(self) -> dict[str, str]:
        """The labels every machine of this vector env carries ({} for local servers):
        ``boxd machine delete --label boxd.rl/run=ID`` removes them after a crash."""
        return dict(getattr(self._pool.home, "labels", None) or {})

    def _drain_pending(self) -> None:
        pending, self._pending = self._pending, None
        if isinstance(pending, PendingStep):
            with contextlib.suppress(Exception):
                self._pool.collect(pending.sent, 30.0 if self.step_timeout is None
                                   else self.step_timeout)

    def _check_open(self) -> None:
        if self.closed:
            raise VectorEnvClosed(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`.")

    def _check_no_pending(self, what: str, *, period: bool = True) -> None:
        # AsyncVectorEnv's message (its reset_async's lacks the final period).
        if self._pending is not None:
            raise PendingCallError(
                f"Calling `{what}` while waiting for a pending call to `step` to complete"
                + ("." if period else ""), "step")

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        if not getattr(self, "closed", True) and hasattr(self, "_pool"):
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        return (f"<boxd.rl.VectorEnv num_envs={self.num_envs} "
                f"envs_per_machine={self.envs_per_machine} "
                f"autoreset_mode={self.autoreset_mode.value} reset_mode={self.reset_mode}>")

    # ------------------------------------------------------------------ branching

    def branch(self, index: int | Sequence[int], k: int | None = None) -> VectorEnv:
        """A new vector env whose sub-envs continue sub-envs of this one from this
        moment: ``branch(i, k)`` gives ``k`` branches of sub-env ``i``, ``branch([i, j,
        ...])`` one branch of each; this vector env goes on unaffected.

        Raises:
            InvalidRequest: a bad index (also an IndexError) or ``k`` (a ValueError).
            VectorEnvClosed, PendingCallError; BoxdError: a fork failed.
        """
        from boxd.rl._branch import vector_branch

        new: VectorEnv = vector_branch(self, index, k)
        return new

    def save(self, index: int) -> EnvState:
        """A state sub-env ``index`` can `load` any number of times.

        Raises:
            InvalidRequest: a bad index (also an IndexError); VectorEnvClosed.
        """
        from boxd.rl._branch import vector_save

        return vector_save(self, index)

    def load(self, index: int, state: EnvState) -> None:
        """Return sub-env ``index`` to ``state`` (from ``save(index)``).

        Raises:
            InvalidRequest: a bad index, or a state of another sub-env; VectorEnvClosed.
        """
        from boxd.rl._branch import vector_load

        vector_load(self, index, state)


def _factories(
    env_fns: Sequence[Callable[..., Any]] | Callable[..., Any] | str, num_envs: int | None
) -> list[Callable[..., Any] | str]:
    if isinstance(env_fns, str) or callable(env_fns):
        if num_envs is None or num_envs < 1:
            raise errors.InvalidRequest(
                "give num_envs >= 1 with an env id or a single callable", field="num_envs")
        return [env_fns] * num_envs
    fns: list[Callable[..., Any] | str] = list(env_fns)
    if not fns:  # SyncVectorEnv fails on envs[0]
        raise _EnvFnsEmpty("list index out of range", field="env_fns")
    for fn in fns:
        if not (isinstance(fn, str) or callable(fn)):  # SyncVectorEnv calls it
            raise _EnvFnNotCallable(f"'{type(fn).__name__}' object is not callable",
                                    field="env_fns")
    if num_envs is not None and num_envs != len(fns):
        raise errors.InvalidRequest(
            f"num_envs={num_envs} but {len(fns)} env_fns were given", field="num_envs")
    return fns


def _seeds(seed: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    if seed is None:
        return [None] * n
    if isinstance(seed, int):
        return [seed + i for i in range(n)]
    if len(seed) != n:  # len() first, as SyncVectorEnv: a float seed is a TypeError
        raise ValueError(f"If seeds are passed as a list the length must match num_envs={n} "
                         f"but got length={len(seed)}.")
    return list(seed)


__all__ = ["RECOVERED", "NoPendingCallError", "PendingCallError", "VectorEnv",
           "VectorEnvClosed"]
