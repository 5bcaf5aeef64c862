"""envd's processes on top of boxd's streamed exec.

E2B's ``Process/Start`` names a process by a pid that later calls (``List``,
``Connect``, ``SendSignal``) refer to. boxd's exec has no pid, so the shim gives each
command one (per sandbox, counting up) and runs it in a task of its own: the command
keeps running when the client that started it goes (as a background command does on
E2B), its events go to whoever is connected, and a signal ends it by closing the exec
stream, which kills the command in the guest. An ended process leaves the table.

A command started with ``stdin: true`` or a ``pty`` is an interactive exec
(`MachineService.exec_interactive`): ``SendInput``, ``StreamInput``, ``CloseStdin`` and
``Update`` (a pty's size) go through its input queue (`INPUT_QUEUE` items: a sender
waits while the command does not read), and its output reaches the client as the bytes
the command wrote (a pty's as ``pty`` data).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import ValidationError

from boxd import models
from boxd import process_models as pm
from boxd.e2b._connect import ConnectError
from boxd.e2b._users import invalid_user, is_unknown_user
from boxd.errors import BoxdError, MachineFailed, MachineNotFound
from boxd.services import MachineService

__all__ = ["MAX_PROCESSES", "Item", "Proc", "ProcessTable", "connect_code", "end_event"]

log = logging.getLogger("boxd.e2b")

#: Running commands one sandbox may have through the shim.
MAX_PROCESSES = 1024
#: Events one connected client may lag behind before the command waits for it.
_QUEUE = 256
#: Inputs (each at most one request's bytes) an interactive command may have waiting.
INPUT_QUEUE = 8

Event = dict[str, Any]
#: What a subscriber receives: an event, the error that ended the command, or None (the
#: end of the stream).
Item = Event | ConnectError | None


@dataclass
class Proc:
    """One command started through ``Process/Start``."""

    pid: int
    sandbox_id: str
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    task: asyncio.Task[None] | None = None
    gone: bool = False  # its sandbox was killed
    subscribers: list[asyncio.Queue[Item]] = field(default_factory=list)
    #: An interactive command's input (None: its stdin is /dev/null, or closed).
    inputs: asyncio.Queue[pm.ExecInput] | None = None
    pty: bool = False
    user: str | None = None  # who it runs as (None: root, or an image's USER)

    def info(self) -> Event:
        """Its ``ProcessInfo`` (proto3 JSON)."""
        config: Event = {"cmd": self.cmd, "args": self.args, "envs": self.envs}
        if self.cwd is not None:
            config["cwd"] = self.cwd
        out: Event = {"config": config, "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out

    async def publish(self, event: Item) -> None:
        for q in list(self.subscribers):
            await q.put(event)

    def finish(self, end: Item) -> None:
        """The last two items, ``end`` and None, to every subscriber, now: a subscriber
        whose client stopped reading loses its oldest events instead (a kill, or the
        command's end, must not wait for a reader that may never come)."""
        for q in list(self.subscribers):
            for item in (end, None):
                while q.full():
                    q.get_nowait()
                q.put_nowait(item)

    def attach(self) -> asyncio.Queue[Item]:
        """A new subscriber's queue. Attach in the same step as the command starts
        (before any await): then no event is published before it is there."""
        q: asyncio.Queue[Item] = asyncio.Queue(_QUEUE)
        self.subscribers.append(q)
        return q

    def detach(self, q: asyncio.Queue[Item]) -> None:
        with contextlib.suppress(ValueError):
            self.subscribers.remove(q)
        # A command blocked on this full queue must not wait for a reader that left.
        while not q.empty():
            q.get_nowait()


def sandbox_gone(sandbox_id: str) -> ConnectError:
    """How a command's stream ends when its sandbox is killed or dies: the words of E2B's
    proxy, so the SDK raises its ``SandboxNotRunningException``."""
    return ConnectError("unavailable", f"The sandbox {sandbox_id} was not found")


def end_event(exit_code: int, signal: int | None, error: str | None = None) -> Event:
    """envd's ``end`` event for a command that exited, or was killed by ``signal``."""
    end: Event = {"exitCode": exit_code, "exited": signal is None,
                  "status": f"exit status {exit_code}" if signal is None
                  else f"signal: {_signal_name(signal)}"}
    if error is not None:
        end["error"] = error
    return {"end": end}


def _signal_name(signal: int) -> str:
    return {9: "killed", 15: "terminated", 2: "interrupt", 1: "hangup"}.get(signal,
                                                                            f"signal {signal}")


def _data_event(kind: str, data: str | bytes) -> Event:
    raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    return {"data": {kind: base64.b64encode(raw).decode()}}


def _event_of(proc: Proc, ev: pm.ExecBytes | models.ExecEvent) -> Event | None:
    """envd's event for an exec's: ``data`` or ``end`` (None: nothing to send)."""
    if isinstance(ev, pm.ExecBytes):
        return _data_event("pty" if proc.pty else ev.stream, ev.data) if ev.data else None
    if ev.type in ("stdout", "stderr") and ev.data:
        return _data_event(ev.type, ev.data)
    if ev.type == "exit":
        return end_event(ev.exit_code if ev.exit_code is not None else -1, ev.signal)
    if ev.type == "error" and ev.error is not None:
        return end_event(-1, None, ev.error.message)
    return None


async def _drain(queue: asyncio.Queue[pm.ExecInput]) -> AsyncIterator[pm.ExecInput]:
    while True:
        yield await queue.get()


class ProcessTable:
    """The running commands of every sandbox, by sandbox id and pid."""

    def __init__(self, machines: MachineService) -> None:
        self.machines = machines
        self._procs: dict[str, dict[int, Proc]] = {}
        self._pids = itertools.count(1000)

    def list(self, sandbox_id: str) -> builtins.list[Proc]:
        return list(self._procs.get(sandbox_id, {}).values())

    def find(self, sandbox_id: str, selector: Event | None) -> Proc:
        """The process a ``ProcessSelector`` (``{"pid": N}`` or ``{"tag": T}``) names.

        Raises:
            ConnectError: ``invalid_argument`` (no selector), ``not_found``.
        """
        if not isinstance(selector, dict) or not ({"pid", "tag"} & selector.keys()):
            raise ConnectError("invalid_argument", "give the process as {\"pid\": N} or "
                               "{\"tag\": T}")
        for proc in self.list(sandbox_id):
            if ("pid" in selector and proc.pid == selector["pid"]) or (
                    "tag" in selector and proc.tag == selector["tag"]):
                return proc
        raise ConnectError("not_found", f"process {selector} not found (it may have ended)")

    def start(self, account: str, sandbox_id: str, argv: builtins.list[str],
              envs: dict[str, str], cwd: str | None, tag: str | None, *,
              stdin: bool = False, pty: tuple[int, int] | None = None,
              user: str | None = None) -> Proc:
        """Start a command in its own task, as ``user`` (None: root, or a container
        image's USER); a client subscribes to see its events. With ``stdin`` its stdin
        stays open for `send`; with ``pty`` (rows, cols) it runs on a terminal of that
        size. A user the guest lacks ends the command's stream ``unauthenticated``.

        Raises:
            ConnectError: ``invalid_argument`` (a bad command), ``resource_exhausted``.
        """
        running = self._procs.setdefault(sandbox_id, {})
        if len(running) >= MAX_PROCESSES:
            raise ConnectError("resource_exhausted", f"sandbox {sandbox_id} runs "
                               f"{MAX_PROCESSES} commands already: end some first")
        try:
            req = models.ExecRequest.model_validate({"command": argv, "env": envs, "cwd": cwd,
                                                     "user": user})
        except ValidationError as exc:
            raise ConnectError("invalid_argument", "bad command: " + "; ".join(
                str(e.get("msg")) for e in exc.errors())) from exc
        proc = Proc(next(self._pids), sandbox_id, argv[0], argv[1:], envs, cwd, tag,
                    user=user)
        events: AsyncIterator[pm.ExecBytes | models.ExecEvent]
        if stdin or pty is not None:
            proc.inputs = asyncio.Queue(INPUT_QUEUE)
            proc.pty = pty is not None
            events = self.machines.exec_interactive(account, sandbox_id, req,
                                                    _drain(proc.inputs), pty)
        else:
            events = self.machines.exec_stream(account, sandbox_id, req)
        running[proc.pid] = proc
        proc.task = asyncio.create_task(self._run(proc, events))
        return proc

    async def send(self, sandbox_id: str, selector: Event | None, item: pm.ExecInput,
                   kind: str = "stdin") -> None:
        """Queue ``item`` for a process's input (``kind``: ``stdin`` or ``pty``, as the
        client sent it); returns once it is queued, or the process ended.

        Raises:
            ConnectError: ``not_found`` (no such process, or it ended meanwhile),
                ``failed_precondition`` (started without stdin, stdin closed, or a pty
                input or size for a command that has no pty).
        """
        proc = self.find(sandbox_id, selector)
        if proc.inputs is None:
            raise ConnectError("failed_precondition", f"process {proc.pid} was not started "
                               "with stdin enabled, or its stdin was closed")
        if (kind == "pty" or item.size is not None) and not proc.pty:
            raise ConnectError("failed_precondition", f"process {proc.pid} has no pty")
        queue, task = proc.inputs, proc.task
        if item.eof:
            proc.inputs = None  # closed: later sends are refused
        put = asyncio.ensure_future(queue.put(item))
        if task is not None:
            await asyncio.wait([put, task], return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
            raise ConnectError("not_found", f"process {proc.pid} has ended")

    async def _run(self, proc: Proc,
                   events: AsyncIterator[pm.ExecBytes | models.ExecEvent]) -> None:
        end: Item = None
        try:
            async for ev in events:
                out = _event_of(proc, ev)
                if out is not None and "end" in out:
                    end = out
                elif out is not None:
                    await proc.publish(out)
        except asyncio.CancelledError:
            end = sandbox_gone(proc.sandbox_id) if proc.gone else end_event(-1, 9)
            raise
        except (MachineNotFound, MachineFailed):
            end = sandbox_gone(proc.sandbox_id)
        except BoxdError as exc:
            end = (invalid_user(proc.user or "root", exc.message) if is_unknown_user(exc)
                   else ConnectError(connect_code(exc), exc.message))
        except Exception as exc:
            log.exception("command %s in %s failed", proc.pid, proc.sandbox_id)
            end = ConnectError("internal", f"the command failed: {exc}")
        finally:
            await cast("AsyncGenerator[object, None]", events).aclose()
            running = self._procs.get(proc.sandbox_id, {})
            running.pop(proc.pid, None)
            if not running:  # no empty table per sandbox that ever ran a command
                self._procs.pop(proc.sandbox_id, None)
            proc.finish(end or end_event(-1, None, "the command ended unseen"))

    async def kill(self, sandbox_id: str, selector: Event | None) -> None:
        """End a process (SIGKILL or SIGTERM alike: its exec stream is closed).

        Raises:
            ConnectError: ``not_found``.
        """
        proc = self.find(sandbox_id, selector)
        if proc.task is not None:
            proc.task.cancel()
            with contextlib.suppress(BaseException):
                await proc.task

    def forget(self, sandbox_id: str) -> None:
        """Drop a killed sandbox's table (its commands died with it)."""
        for proc in self._procs.pop(sandbox_id, {}).values():
            proc.gone = True
            if proc.task is not None:
                proc.task.cancel()


def connect_code(exc: BoxdError) -> str:
    """The Connect code of a boxd error."""
    return {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied",
            404: "not_found", 408: "deadline_exceeded", 409: "failed_precondition",
            413: "resource_exhausted", 429: "resource_exhausted", 503: "unavailable",
            507: "resource_exhausted"}.get(exc.status, "internal")

