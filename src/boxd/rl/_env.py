"""`boxd.rl.Env`: a Gymnasium env whose environment runs in its own machine."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import gymnasium as gym

from boxd import errors
from boxd.rl import _server as W
from boxd.rl._channel import Home, MakeRequest, Rpc, Slot
from boxd.rl._errors import EnvServerLost, EnvTimeout

if TYPE_CHECKING:
    from boxd.rl._branch import EnvState
    from boxd.sdk._sync import Boxd

ResetMode = Literal["env", "rewind", "refork"]
RESET_MODES: tuple[str, ...] = ("env", "rewind", "refork")
#: The default reset mode: the env's own reset is one round trip; rewind and refork
#: cost a checkpoint restore or a fork each (docs/rl.md has the measurements).
DEFAULT_RESET_MODE: ResetMode = "env"


def check_reset_mode(mode: str) -> ResetMode:
    """Raises: InvalidRequest: not one of "env", "rewind", "refork"."""
    if mode not in RESET_MODES:
        raise errors.InvalidRequest(
            f"reset_mode must be one of {', '.join(map(repr, RESET_MODES))}, not {mode!r}",
            field="reset_mode")
    return mode  # type: ignore[return-value]


def resolve_home(source: str | Home | None, boxd: Boxd | None,
                 image: str | None = None) -> Home:
    """A machine name or id, or a boxd image's name (``image``), becomes a `MachineHome`
    on ``boxd`` (``Boxd()`` if None).

    Raises:
        InvalidRequest: both or neither of ``source`` and ``image``.
    """
    from boxd.rl._machines import MachineHome

    if image is not None:
        if source is not None:
            raise errors.InvalidRequest("give source= or image=, not both", field="image")
        return MachineHome(None, boxd, image=image)
    if isinstance(source, str):
        return MachineHome(source, boxd)
    if source is None:
        raise errors.InvalidRequest("give source= (a machine, or a Home) or image= (a "
                                    "boxd image)", field="source")
    return source


class Env(gym.Env[Any, Any]):
    """A `gymnasium.Env` whose environment runs in its own fork of ``source``.

    Args:
        env: a Gymnasium id (built with ``gym.make(env, **make_kwargs)``), a
            ``"module:function"`` importable in the machine, or any callable returning
            an env (shipped with cloudpickle; called with ``**make_kwargs``).
        source: the machine to fork (name or id), or a `Home` such as `boxd.rl.local()`.
        image: instead of ``source``, a boxd image (``NAME[:TAG]``, ``boxd image list``)
            whose ``python3`` has the env's packages: a machine started from it (its
            service ready) is the source, and goes with the rest at ``close``.
        reset_mode: ``"env"`` (the env's own ``reset``), ``"rewind"`` (rewind the
            machine to the moment the env was built, then ``reset``: byte-identical
            starts) or ``"refork"`` (a fresh fork of that moment, then ``reset``).
        boxd: the client to use (``Boxd()`` if None).
        pickle_by_value: modules whose code travels with the factory instead of being
            imported in the machine.
        step_timeout: seconds a reply may take before `EnvTimeout` (None: no limit).
        **make_kwargs: keyword arguments for the env's constructor.

    Raises:
        InvalidRequest: a bad ``env`` or ``reset_mode``.
        EnvError, EnvModuleNotFound: building the env failed in the machine.
        BoxdError: forking or starting the machine failed.
    """

    def __init__(
        self,
        env: str | Callable[..., Any],
        *,
        source: str | Home | None = None,
        image: str | None = None,
        reset_mode: ResetMode = DEFAULT_RESET_MODE,
        boxd: Boxd | None = None,
        pickle_by_value: Sequence[Any] = (),
        step_timeout: float | None = None,
        **make_kwargs: Any,
    ) -> None:
        self.reset_mode: ResetMode = check_reset_mode(reset_mode)
        self.step_timeout = step_timeout
        self._closed = False
        self._home = resolve_home(source, boxd, image)
        make = MakeRequest.of(env, make_kwargs, pickle_by_value)
        self._owns_home = isinstance(source, str) or image is not None
        try:
            self._slot: Slot = self._home.open(make, rewindable=self.reset_mode == "rewind",
                                               shared=self.reset_mode == "refork")
        except BaseException:
            if self._owns_home:
                self._home.close()
            raise
        self._rpc = Rpc(self._slot)
        info = self._slot.info
        self.observation_space = W.space_from_wire(info["observation_space"])
        self.action_space = W.space_from_wire(info["action_space"])
        self.metadata = dict(info.get("metadata") or {})
        self.render_mode = info.get("render_mode")
        self._pristine = True  # the env is as built: no reset or step since
        self._broken: BaseException | None = None

    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """One request; after a timeout or a lost server every later call fails too (a
        late reply would otherwise answer the wrong request)."""
        if self._broken is not None:
            raise self._broken
        try:
            return self._rpc.call(op, *args, timeout=timeout)
        except (EnvTimeout, EnvServerLost) as exc:
            self._broken = exc
            raise

    @property
    def machine(self) -> str | None:
        """The id of the machine the env runs in (None for a local server)."""
        return self._slot.machine

    @property
    def labels(self) -> dict[str, str]:
        """The labels every machine of this env carries (its branches' too; {} for a
        local server): ``boxd machine delete --label boxd.rl/run=ID`` removes them after
        a crash of this process; `close` deletes them by these labels."""
        return dict(getattr(self._home, "labels", None) or {})

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset per ``reset_mode`` and return the first observation and info.

        Raises:
            EnvError: the env's reset raised; EnvServerLost: its machine is gone.
        """
        super().reset(seed=seed)
        if not self._pristine and self.reset_mode == "rewind":
            self._slot.rewind()
        elif not self._pristine and self.reset_mode == "refork":
            self._slot.refork()
        self._pristine = False
        obs, info = self._call("reset", seed, options, timeout=self.step_timeout)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """One step of the remote env.

        Raises:
            EnvError: the env's step raised; EnvServerLost: its machine is gone;
            EnvTimeout: no answer within ``step_timeout``.
        """
        self._pristine = False
        obs, reward, terminated, truncated, info, _ = self._call(
            "step", action, None, timeout=self.step_timeout)
        return obs, reward, terminated, truncated, info

    def render(self) -> Any:
        """The remote env's ``render()`` (frames travel as numpy arrays)."""
        return self._call("call", "render", (), {})

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call a method of the remote env (or read an attribute when not callable)."""
        return self._call("call", name, args, kwargs)

    def get_attr(self, name: str) -> Any:
        """An attribute of the remote env (through its wrappers)."""
        return self._call("get_attr", name)

    def set_attr(self, name: str, value: Any) -> None:
        """Set an attribute of the remote env (on the wrapper that has it)."""
        self._call("set_attr", name, value)

    def close(self) -> None:
        """Close the remote env and delete its machine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._broken is None:
                self._rpc.call("close", timeout=30.0)
        except errors.BoxdError:
            pass  # the machine is deleted next anyway
        finally:
            self._slot.close()
            if self._owns_home:
                self._home.close()
        super().close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        return f"<boxd.rl.Env {self.machine or 'local'} reset_mode={self.reset_mode}>"

    # ------------------------------------------------------------------ branching

    def branch(self, k: int) -> list[Env]:
        """``k`` new envs that continue from this moment (forks of this env's machine,
        each attached to its copy of the env server); this env goes on unaffected.

        Raises:
            InvalidRequest: ``k`` is not an int >= 1 (also a ValueError), or the env has
                no machine (`boxd.rl.local()`); StateError: the env is closed.
            BoxdError: a fork failed (the others are deleted).
        """
        from boxd.rl._branch import env_branch

        out: list[Env] = env_branch(self, k)
        return out

    def save(self) -> EnvState:
        """A state this env can `load` any number of times (a checkpoint of its machine).

        Raises:
            InvalidRequest: the env has no machine; StateError: it is closed.
        """
        from boxd.rl._branch import env_save

        return env_save(self)

    def load(self, state: EnvState) -> None:
        """Return to ``state`` (from this env's `save`): machine and env as they were.

        Raises:
            InvalidRequest: ``state`` was saved by another env or machine;
            CheckpointNotFound: it was deleted; StateError: the env is closed.
        """
        from boxd.rl._branch import env_load

        env_load(self, state)


__all__ = ["DEFAULT_RESET_MODE", "RESET_MODES", "Env", "ResetMode"]
