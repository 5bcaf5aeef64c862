"""Errors of boxd.rl, under `boxd.errors.BoxdError` (client side only, never on the wire).

::

    BoxdError
    ├── EnvError                  the environment raised inside its machine   .index, .remote_type
    │   └── EnvModuleNotFound     the env's code needs a module the machine lacks   .module
    ├── EnvServerLost             the env server's process or machine went away     .index, .machine
    └── EnvTimeout                a step took longer than ``step_timeout``          .index, .timeout
"""

from __future__ import annotations

from typing import ClassVar

from boxd.errors import BoxdError


class EnvError(BoxdError):
    """The environment raised an exception inside its machine (``traceback`` has the
    machine's traceback)."""

    code = "env_error"
    status = 500
    _fields: ClassVar[tuple[str, ...]] = ("index", "remote_type", "traceback", "machine")


class EnvModuleNotFound(EnvError):
    """Building the env needs a module that the machine cannot import."""

    code = "env_module_not_found"
    _fields = (*EnvError._fields, "module")


class EnvServerLost(BoxdError):
    """The env server's process or its machine stopped answering."""

    code = "env_server_lost"
    status = 503
    _fields = ("index", "machine")


class EnvTimeout(BoxdError, TimeoutError):
    """A sub-env did not answer within ``step_timeout`` (also a `TimeoutError`, as
    `AsyncVectorEnv.step_wait` raises)."""

    code = "env_timeout"
    status = 408
    _fields = ("index", "timeout", "machine")


__all__ = ["EnvError", "EnvModuleNotFound", "EnvServerLost", "EnvTimeout"]
