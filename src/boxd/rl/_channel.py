"""Channels to env servers, and the homes that run them.

A `Channel` carries whole messages both ways (``send(bytes)``, ``recv(timeout)``). A
`Home` is where env servers live: `MachineHome` forks a machine per env and talks to
the server through `boxd.machines.spawn`; `LocalHome` runs each server as a local
subprocess (no isolation, no fork: for debugging an env without machines, and for
the unit tests of the vector semantics). A `Slot` is one env's place in a home: its
channel, and how to rewind or replace it.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from boxd import errors
from boxd.rl import _server as W
from boxd.rl._errors import EnvError, EnvModuleNotFound, EnvServerLost, EnvTimeout

SERVER_FILE = Path(W.__file__)
#: Where the server lives inside a machine (``/home/boxd`` is on its ``sys.path``).
GUEST_SERVER = "/home/boxd/.boxd-rl/server.py"
#: The checkpoint a rewindable slot takes once its env is built.
REWIND_CHECKPOINT = "boxd-rl-built"


class Channel(Protocol):
    """A bidirectional stream of whole messages to one env server."""

    def send(self, data: bytes) -> None: ...

    def recv(self, timeout: float | None = None) -> bytes:
        """The next message.

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds.
            EnvServerLost: the stream ended.
        """
        ...

    def close(self) -> None: ...


_PICKLE_LOCK = threading.Lock()


@dataclass
class MakeRequest:
    """How the server builds the env: a Gymnasium id, a ``module:function`` reference
    importable in the machine, or a cloudpickled callable."""

    kind: str  # "id" | "ref" | "pickle"
    payload: str | bytes
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls, env: str | Callable[..., Any], kwargs: dict[str, Any] | None = None,
        pickle_by_value: Sequence[Any] = (),
    ) -> MakeRequest:
        """Raises: InvalidRequest: ``env`` is neither a string nor a callable."""
        kwargs = dict(kwargs or {})
        if isinstance(env, str):
            return cls("ref" if ":" in env and "/" not in env.split(":")[0] else "id", env,
                       kwargs)
        if not callable(env):
            raise errors.InvalidRequest(
                f"env must be a Gymnasium id, 'module:function' or a callable, not "
                f"{type(env).__name__}", field="env")
        import cloudpickle

        # cloudpickle's by-value registry is process-wide: requests made in threads at
        # once (rl.verify's, a user's pool) must not unregister a module while another
        # pickles, and a module the caller registered stays registered.
        with _PICKLE_LOCK:
            have = cloudpickle.list_registry_pickle_by_value()
            added = [m for m in pickle_by_value if m.__name__ not in have]
            for mod in added:
                cloudpickle.register_pickle_by_value(mod)
            try:
                payload = cloudpickle.dumps(env)
            finally:
                for mod in added:
                    with contextlib.suppress(ValueError):
                        cloudpickle.unregister_pickle_by_value(mod)
        return cls("pickle", payload, kwargs)

    def message(self) -> bytes:
        return W.encode(("make", self.kind, self.payload, self.kwargs))


@dataclass
class MakeGroup(MakeRequest):
    """Build several envs in one server (``envs_per_machine``): its reply's ``"group"``
    holds each env's ``make`` reply, in order."""

    members: list[MakeRequest] = field(default_factory=list)

    @classmethod
    def of_members(cls, members: Sequence[MakeRequest]) -> MakeGroup:
        return cls("group", b"", {}, list(members))

    def message(self) -> bytes:
        return W.encode(("make_group", [(m.kind, m.payload, m.kwargs) for m in self.members]))


def raise_reply(reply: Any, index: int | None, machine: str | None) -> Any:
    """The value of an ``("ok", value)`` reply; an ``err`` reply raised as its typed error."""
    if reply[0] == "ok":
        return reply[1]
    _, kind, message, details = reply
    where = f"sub-env {index}: " if index is not None else ""
    fields = {"index": index, "machine": machine, "remote_type": details.get("type"),
              "traceback": details.get("traceback")}
    if kind == "module":
        mod = details.get("module") or "?"
        raise EnvModuleNotFound(
            f"{where}the machine cannot import module {mod!r} ({message})",
            hint=(f"install it in the source machine (e.g. `pip install` it there, or put "
                  f"it under /home/boxd), or ship its code with pickle_by_value=[{mod}]"),
            module=mod, **fields)
    raise EnvError(f"{where}{message}", hint="the traceback attribute has the machine's "
                   "traceback", **fields)


class Slot(Protocol):
    """One env's place in a home."""

    @property
    def channel(self) -> Channel: ...

    @property
    def machine(self) -> str | None:
        """The machine's id, or None for a local server."""
        ...

    @property
    def info(self) -> dict[str, Any]:
        """The server's answer to ``make`` (spaces, metadata, render mode)."""
        ...

    def rewind(self) -> None:
        """Back to the moment the env was built (its server answers again)."""
        ...

    def refork(self) -> None:
        """Replace this slot's home by a fresh copy of the moment the env was built."""
        ...

    def close(self) -> None: ...


class Home(Protocol):
    """Where env servers run."""

    def open(self, make: MakeRequest, *, rewindable: bool, index: int | None = None,
             shared: bool = False) -> Slot:
        """Start a server and build the env in it (``shared``: the same factory opens
        again soon, so building it once and copying is worth it).

        Raises:
            EnvError, EnvModuleNotFound: building the env failed in the server.
            BoxdError: the machine could not be made.
        """
        ...

    def close(self) -> None: ...


class Rpc:
    """Requests and replies over a slot's channel, errors typed with the slot's index."""

    def __init__(self, slot: Slot, index: int | None = None) -> None:
        self.slot = slot
        self.index = index

    def send(self, op: str, *args: Any) -> None:
        try:
            self.slot.channel.send(W.encode((op, *args)))
        except errors.BoxdError as exc:
            if isinstance(exc, EnvServerLost):
                raise
            raise self._lost(str(exc)) from exc

    def reply(self, timeout: float | None = None) -> Any:
        try:
            raw = self.slot.channel.recv(timeout)
        except TimeoutError:
            where = f"sub-env {self.index}" if self.index is not None else "the env"
            raise EnvTimeout(
                f"{where} did not answer within {timeout:g}s", index=self.index,
                timeout=timeout, machine=self.slot.machine,
                hint="raise step_timeout, or pass recover=True to replace a hung sub-env",
            ) from None
        except EnvServerLost:
            raise
        except errors.BoxdError as exc:
            raise self._lost(str(exc)) from exc
        return raise_reply(W.decode(raw), self.index, self.slot.machine)

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        self.send(op, *args)
        return self.reply(timeout)

    def _lost(self, why: str) -> EnvServerLost:
        where = f"sub-env {self.index}" if self.index is not None else "the env"
        return EnvServerLost(
            f"{where}'s server is gone: {why}", index=self.index, machine=self.slot.machine,
            hint="its machine may have died; pass recover=True to a VectorEnv to replace it",
        )


# ---------------------------------------------------------------------- local home


class PipeChannel:
    """A local subprocess's stdin/stdout, framed."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self._proc = proc
        self._in = proc.stdin
        self._out = proc.stdout
        self._fd = proc.stdout.fileno()
        self._buf = bytearray()
        self._lock = threading.Lock()

    def send(self, data: bytes) -> None:
        try:
            self._in.write(W.frame(data))
            self._in.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise EnvServerLost(f"env server process {self._proc.pid} is gone: {exc}") from exc

    def _frame(self) -> bytes | None:
        if len(self._buf) < 4:
            return None
        n = int.from_bytes(self._buf[:4], "big")
        if n > W.MAX_FRAME:
            raise EnvServerLost(f"env server process {self._proc.pid} sent a {n}-byte frame")
        if len(self._buf) < 4 + n:
            return None
        out = bytes(self._buf[4 : 4 + n])
        del self._buf[: 4 + n]
        return out

    def recv(self, timeout: float | None = None) -> bytes:
        with self._lock:
            while (got := self._frame()) is None:
                if timeout is not None:
                    ready, _, _ = select.select([self._fd], [], [], timeout)
                    if not ready:
                        raise TimeoutError
                try:
                    chunk = os.read(self._fd, 1 << 16)
                except OSError as exc:
                    raise EnvServerLost(f"env server process {self._proc.pid}: {exc}") from exc
                if not chunk:
                    code = self._proc.poll()
                    raise EnvServerLost(
                        f"env server process {self._proc.pid} ended"
                        + (f" with exit status {code}" if code is not None else ""))
                self._buf += chunk
            return got

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._in.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        with contextlib.suppress(OSError, ValueError):
            self._out.close()


class LocalSlot:
    def __init__(self, make: MakeRequest, index: int | None) -> None:
        self._make = make
        self._index = index
        self._channel = self._start()
        self._info: dict[str, Any] = Rpc(self, index).reply()

    def _start(self) -> PipeChannel:
        proc = subprocess.Popen(
            [sys.executable, "-u", str(SERVER_FILE)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        ch = PipeChannel(proc)
        ch.send(self._make.message())
        return ch

    @property
    def channel(self) -> PipeChannel:
        return self._channel

    @property
    def machine(self) -> str | None:
        return None

    @property
    def info(self) -> dict[str, Any]:
        return self._info

    def rewind(self) -> None:
        raise errors.InvalidRequest(
            'reset_mode="rewind" needs a machine: local env servers cannot rewind',
            field="reset_mode", hint='use reset_mode="env" or "refork" with boxd.rl.local()')

    def refork(self) -> None:
        self._channel.kill()
        self._channel.close()
        self._channel = self._start()
        self._info = Rpc(self, self._index).reply()

    def close(self) -> None:
        self._channel.close()


class LocalHome:
    """Env servers as local subprocesses (the host's Python): no machine, no isolation."""

    def open(self, make: MakeRequest, *, rewindable: bool, index: int | None = None,
             shared: bool = False) -> Slot:
        if rewindable:
            raise errors.InvalidRequest(
                'reset_mode="rewind" needs a machine: local env servers cannot rewind',
                field="reset_mode", hint='use reset_mode="env" or "refork" with boxd.rl.local()')
        return LocalSlot(make, index)

    def close(self) -> None:
        pass


def local() -> LocalHome:
    """A `Home` that runs env servers as local processes, for debugging without machines.

    ``reset_mode="rewind"`` is unavailable there; nothing is isolated.
    """
    return LocalHome()
