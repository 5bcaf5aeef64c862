"""What an env reads that a seed does not pin: the verifier's diagnostic replay.

`traced` builds the env (as the env server would) inside `Tracer`, a wrapper that,
while the env's own ``reset`` and ``step`` run, records every call the env's thread
makes to the clock (``time.time``, ``time.monotonic``, ``time.perf_counter``,
``time.clock_gettime`` and their ``_ns`` forms), the kernel RNG (``os.urandom``,
``os.getrandom``, opening ``/dev/urandom`` or ``/dev/random``) and the machine's
identity (``socket.gethostname``, ``os.uname``, ``uuid.getnode``, opening
``/etc/machine-id`` or ``/etc/hostname``), by step. `boxd.rl.verify` replays a
diverged seed through it in a fresh fork and names what the divergent step read.

It patches module attributes, so it sees what Python code looks up at call time
(``time.time()``, ``os.urandom(8)``, ``uuid.uuid4()``), not a function bound before the
env was built (``from time import time``) nor what C code reads directly; the verifier
says so when the trace finds nothing. This module imports nothing from boxd: it
travels to the env server by value (cloudpickle), so no boxd is needed there.
"""

from __future__ import annotations

import builtins
import importlib
import io
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import gymnasium as gym

CLOCK = "clock"
RNG = "rng"
IDENTITY = "identity"

_PATCHES: list[tuple[Any, str, str]] = [
    *((time, name, CLOCK) for name in (
        "time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns",
        "clock_gettime", "clock_gettime_ns", "process_time", "process_time_ns")),
    (os, "urandom", RNG), (os, "getrandom", RNG),
    (socket, "gethostname", IDENTITY), (os, "uname", IDENTITY), (uuid, "getnode", IDENTITY),
]
_PATHS = {"/dev/urandom": RNG, "/dev/random": RNG, "/etc/machine-id": IDENTITY,
          "/etc/hostname": IDENTITY, "/proc/sys/kernel/random/uuid": RNG,
          "/proc/sys/kernel/random/boot_id": IDENTITY}


class Tracer(gym.Wrapper[Any, Any, Any, Any]):
    """Records, per step, what the env read (``boxd_reads``: step -> sorted
    ``"kind:name"`` strings; step 0 is the first reset, a reset after step k counts
    as k)."""

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        super().__init__(env)
        self.boxd_reads: dict[int, list[str]] = {}
        self._t = 0

    def reset(self, **kwargs: Any) -> Any:
        with self._tracing():
            return self.env.reset(**kwargs)

    def step(self, action: Any) -> Any:
        self._t += 1
        with self._tracing():
            return self.env.step(action)

    @contextmanager
    def _tracing(self) -> Iterator[None]:
        owner = threading.get_ident()
        seen: set[str] = set()

        def wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
            def traced(*args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() == owner:
                    seen.add(label)
                return fn(*args, **kwargs)
            return traced

        def wrap_open(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
            def traced(file: Any, *args: Any, **kwargs: Any) -> Any:
                kind = _PATHS.get(os.fspath(file)) if isinstance(file, str | os.PathLike) \
                    else None
                if kind is not None and threading.get_ident() == owner:
                    seen.add(f"{kind}:open({os.fspath(file)})")
                return fn(file, *args, **kwargs)
            return traced

        saved: list[tuple[Any, str, Any]] = []
        for mod, name, kind in _PATCHES:
            fn = getattr(mod, name, None)
            if fn is not None:
                saved.append((mod, name, fn))
                setattr(mod, name, wrap(fn, f"{kind}:{mod.__name__}.{name}"))
        for mod, name in ((builtins, "open"), (io, "open"), (os, "open")):
            fn = getattr(mod, name)
            saved.append((mod, name, fn))
            setattr(mod, name, wrap_open(fn, name))
        try:
            yield
        finally:
            for mod, name, fn in reversed(saved):
                setattr(mod, name, fn)
            if seen:
                self.boxd_reads[self._t] = sorted(set(self.boxd_reads.get(self._t, ())) | seen)


def traced(spec: str | Callable[..., Any], kwargs: dict[str, Any]) -> Tracer:
    """Build the env as the env server does (a Gymnasium id, ``module:function``, or a
    callable) and wrap it in a `Tracer`."""
    if callable(spec):
        env = spec(**kwargs)
    elif ":" in spec and "/" not in spec.split(":")[0]:
        mod, _, name = spec.partition(":")
        env = getattr(importlib.import_module(mod), name)(**kwargs)
    else:
        env = gym.make(spec, **kwargs)
    return Tracer(env)
