"""Errors of boxd.rl, under `boxd.errors.BoxdError` (client side only, never on the wire).

::

    BoxdError
    ├── EnvError                  the environment raised inside its machine   .index, .remote_type
    │   └── EnvModuleNotFound     the env's code needs a module the machine lacks   .module
    ├── InfrastructureError       (boxd.errors) the machine, engine, agent or node failed
    │   └── EnvServerLost         the env server's process or machine went away     .index, .machine
    └── EnvTimeout                a step took longer than ``step_timeout``          .index, .timeout

An `EnvServerLost` is an infrastructure fault, not the policy's outcome: it carries no
reward or termination, so a trainer retries or drops the rollout (``except
boxd.InfrastructureError``); its ``__cause__`` is the machine's own error when there is
one (`MachineFailed`, `AgentLost`, `NodeLost`).

Each is also what Gymnasium's vectorisers would raise there, so code written for them
catches it: an `EnvError` is also an instance of the exception type the env raised
(``except ValueError`` catches an env's ``ValueError``; ``remote_type`` names it) when
that type is a builtin or a class the host has imported (``gymnasium.error.Error``,
the env's own module); `EnvModuleNotFound` is a `ModuleNotFoundError`; `EnvTimeout` a
`TimeoutError` and a `multiprocessing.TimeoutError` (what `AsyncVectorEnv.step_wait`
raises).
"""

from __future__ import annotations

import builtins
import multiprocessing
import re
import sys
import threading
from typing import Any, ClassVar

from boxd.errors import BoxdError, InfrastructureError

#: Exception types never mixed into an EnvError (they steer iteration, not report).
_NOT_MIXED: tuple[type[BaseException], ...] = (StopIteration, StopAsyncIteration,
                                                GeneratorExit)
_mixed: dict[tuple[str, str], type[EnvError]] = {}
_mixed_lock = threading.Lock()


class EnvError(BoxdError):
    """The environment raised an exception inside its machine (``traceback`` has the
    machine's traceback).

    Built with a ``remote_type`` that the host can resolve (a builtin exception, or a
    class of a module the host has imported: the last line of ``traceback`` names its
    module), the error is an instance of a subclass of both `EnvError` and that type,
    as a Gymnasium vectoriser would let the env's own exception through.
    """

    code = "env_error"
    status = 500
    _fields: ClassVar[tuple[str, ...]] = ("index", "remote_type", "traceback", "machine")
    #: True on the classes that mix an env's exception type into EnvError.
    _mixes: ClassVar[bool] = False

    def __new__(cls, message: str = "", *args: Any, **details: Any) -> EnvError:
        if cls is EnvError:
            cls = _mixed_class(details.get("remote_type"), details.get("traceback"))
        return super().__new__(cls, message)

    def __reduce__(self) -> tuple[Any, ...]:
        # A mixed class is made at run time: pickle as EnvError, which makes it again.
        red = super().__reduce__()
        if type(self)._mixes:
            return (red[0], (EnvError, *red[1][1:]))
        return red


def _mixed_class(remote_type: Any, tb: Any) -> type[EnvError]:
    """EnvError, or a subclass that also is the remote exception type (cached)."""
    if not isinstance(remote_type, str) or not remote_type:
        return EnvError
    module = _remote_module(remote_type, tb if isinstance(tb, str) else "")
    key = (module, remote_type)
    with _mixed_lock:
        if key not in _mixed:
            _mixed[key] = _make_mixed(_resolve(module, remote_type))
        return _mixed[key]


def _remote_module(qualname: str, tb: str) -> str:
    """The module of the final exception in a traceback (``builtins`` when unnamed)."""
    pattern = re.compile(rf"^(?:([\w.]+)\.)?{re.escape(qualname)}(?::|$)")
    for line in reversed(tb.splitlines()):
        m = pattern.match(line)
        if m:
            return m.group(1) or "builtins"
    return "builtins"


def _resolve(module: str, qualname: str) -> type[Exception] | None:
    # Only modules already imported here: naming an exception never imports code.
    obj: Any = builtins if module == "builtins" else sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if (isinstance(obj, type) and issubclass(obj, Exception)
            and not issubclass(obj, (BoxdError, *_NOT_MIXED))):
        return obj
    return None


def _make_mixed(remote: type[Exception] | None) -> type[EnvError]:
    """A subclass of EnvError and ``remote``, or of its nearest base that can be built
    with one message (UnicodeDecodeError's five arguments: ValueError)."""
    for base in remote.__mro__ if remote is not None else ():
        if base is Exception or not issubclass(base, Exception) or base in _NOT_MIXED:
            break
        try:
            cls = type(f"EnvError[{base.__qualname__}]", (EnvError, base),
                       {"__module__": __name__, "_mixes": True, "__doc__": EnvError.__doc__})
            cls("probe", hint="", index=None)
        except Exception:  # a layout clash or a constructor that wants more
            continue
        return cls
    return EnvError


class EnvModuleNotFound(EnvError, ModuleNotFoundError):
    """Building the env needs a module that the machine cannot import (also a
    `ModuleNotFoundError`, as building it in this process would raise)."""

    code = "env_module_not_found"
    _fields = (*EnvError._fields, "module")


class EnvServerLost(InfrastructureError):
    """The env server's process or its machine stopped answering (an
    `InfrastructureError`: the step has no outcome to score)."""

    code = "env_server_lost"
    status = 503
    _fields = ("index", "machine")


class EnvTimeout(BoxdError, TimeoutError, multiprocessing.TimeoutError):
    """A sub-env did not answer within ``step_timeout`` (also a `TimeoutError` and a
    `multiprocessing.TimeoutError`, as `AsyncVectorEnv.step_wait` raises)."""

    code = "env_timeout"
    status = 408
    _fields = ("index", "timeout", "machine")


__all__ = ["EnvError", "EnvModuleNotFound", "EnvServerLost", "EnvTimeout"]
