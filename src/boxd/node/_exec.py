"""Exec, files and spawned processes: what a request does through a machine's agent.

Every call here goes through the node's `Guests.using` (it wakes a sleeping machine,
holds it against a swap or suspend, counts as activity) and, when it may change the
guest, bumps the machine's generation (`Guests.changed`: the next fork needs a new
template).

Processes (boxd.rl): a spawned process keeps running between requests; its frames are
relayed by `boxd.node._processes`. Sends go through `using` (they wake a sleeping
machine and count as activity); a frame sent and not yet answered keeps the idle
timers off. The first send after a template was taken bumps the generation, so a later
fork never reuses a template from before the process changed the guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from boxd import models
from boxd import process_models as pm
from boxd.engine.base import (
    Agent,
    ExecExit,
    ExecOutcome,
    ExecOutput,
    MachineHandle,
    Process,
)
from boxd.errors import (
    AgentLost,
    BoxdError,
    Conflict,
    ExecIdConflict,
    ExecTimeout,
    InvalidRequest,
    MachineFailed,
)
from boxd.node._exec_records import ExecRecord, ExecRecords, fingerprint, new_exec_id
from boxd.node._processes import ProcessStream, ProcessTable, Relay
from boxd.node._services import SERVICE_ID, service_argv
from boxd.node.lifecycle import Lease, Lifecycle
from boxd.state import MachineRecord
from boxd.storage.execs import ExecFiles

log = logging.getLogger("boxd.node")

# Seconds past an exec's own timeout before the host gives up on a silent guest.
HOST_GRACE = 30.0


class Guests(Protocol):
    """What a request needs of the node: the machine's agent, held for the request."""

    def using(
        self, machine_id: str, timeout: float = 120.0
    ) -> AbstractAsyncContextManager[tuple[MachineRecord, MachineHandle, Agent]]: ...

    def changed(self, machine_id: str) -> None: ...

    def touch(self, machine_id: str) -> None: ...

    def record(self, machine_id: str) -> MachineRecord: ...

    def lease(self, machine_id: str) -> Lease: ...

    def current(self, machine_id: str) -> MachineHandle | None: ...

    async def raise_if_died(
        self, rec: MachineRecord, handle: MachineHandle, exc: MachineFailed
    ) -> None: ...


def _exec_kwargs(rec: MachineRecord, req: models.ExecRequest) -> dict[str, Any]:
    return {
        **image_defaults(rec, req.env, req.cwd, req.user), "timeout": req.timeout,
        "stdin": req.stdin.encode() if req.stdin is not None else None,
    }


def image_defaults(
    rec: MachineRecord, env: Mapping[str, str | None] | None, cwd: str | None,
    user: str | None,
) -> dict[str, Any]:
    """An exec's ``env``, ``cwd`` and ``user`` on ``rec``: on a machine of a container
    image, the image's ENV under the request's own (which wins), its WORKDIR (``/``
    without one, as a container runtime does) when the request names no cwd, and its
    USER when the request names no user (None: root)."""
    run = rec.run_image
    if run is None:
        return {"env": dict(env) if env else None, "cwd": cwd, "user": user}
    merged: dict[str, str | None] = {**run.exec_env(), **(env or {})}
    return {"env": merged or None, "cwd": cwd if cwd is not None else (run.working_dir or "/"),
            "user": user if user is not None else (run.user or None)}


async def _feed(proc: Process, inputs: AsyncIterator[pm.ExecInput]) -> None:
    """Hand an interactive exec its input until the input or the command ends. An item
    it cannot take (the command closed its stdin, a resize of no pty) is dropped: the
    command's events tell the rest, and the input is still drained."""
    async for item in inputs:
        try:
            if item.size is not None:
                await proc.resize(*item.size)
            if item.data:
                await proc.write(item.data)
            if item.eof:
                await proc.close_stdin()
        except InvalidRequest as exc:
            log.debug("exec input dropped: %s", exc.message)
        except BoxdError as exc:  # the connection is lost: the events end too
            log.debug("exec input stopped: %s", exc.message)
            return


def _without_exit(exc: BaseException, record: ExecRecord, stopping: bool) -> BoxdError:
    """The error that ended an exec without an exit status, as its record keeps it."""
    if stopping:
        return AgentLost(
            f"the daemon stopped while exec {record.exec_id!r} ran: its exit was lost with "
            "the daemon's connection to the guest's agent", exec_id=record.exec_id,
            hint="its outcome is unknown (the command may have run in part or whole): run "
            "it again with a new exec id")
    if isinstance(exc, BoxdError):
        return exc
    return MachineFailed(f"the exec ended without an exit status: {exc!r}")


def _absolute(path: str) -> None:
    if not path.startswith("/"):
        raise InvalidRequest(f"guest path must be absolute: {path!r}", field="path")


class Exec:
    """Exec, upload, download, spawn and the spawned processes of one node."""

    def __init__(self, guests: Guests, lifecycle: Lifecycle, procs: ProcessTable, *,
                 max_output: int, files: ExecFiles | None = None) -> None:
        self._g = guests
        self.lifecycle = lifecycle
        self.procs = procs
        self._max_output = max_output
        self.records = ExecRecords(files=files)
        self._tasks: set[asyncio.Task[ExecOutcome]] = set()
        self.stopping = False  # the daemon stops: see `_run`

    async def exec(self, machine_id: str, req: models.ExecRequest) -> models.ExecResult:
        """Run ``req`` to completion in a task of the node's (a caller that goes away does
        not end it) and keep its record (`exec_result`). An exec id the machine keeps
        already is not run again: the caller waits for that exec and gets its result.

        Raises:
            ExecIdConflict: the id's exec ran another command.
            ExecTimeout, MachineNotFound, MachineFailed, ...: as the exec ended.
        """
        rec = self._g.record(machine_id)
        exec_id = req.exec_id or new_exec_id()
        record = self.records.get(machine_id, exec_id)
        if record is not None:
            if record.fingerprint != fingerprint(req):
                raise ExecIdConflict(
                    f"exec id {exec_id!r} of machine {rec.name!r} names another command",
                    machine=rec.name, exec_id=exec_id,
                    hint="read that exec with exec_result, or give this one a new id")
            await asyncio.shield(record.done.wait())
            return record.result()
        record = ExecRecord(exec_id, machine_id, req)
        self.records.add(record)
        task = asyncio.create_task(self._run(record, req), name=f"exec {exec_id}")
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        out = await asyncio.shield(task)
        result = models.ExecResult(
            exec_id=exec_id,
            stdout=out.stdout.decode(errors="replace"), stderr=out.stderr.decode(errors="replace"),
            exit_code=out.exit_code, signal=out.signal, timed_out=out.timed_out,
            duration=out.duration, stdout_truncated=out.stdout_truncated,
            stderr_truncated=out.stderr_truncated,
        )
        if result.timed_out:
            raise ExecTimeout(
                f"command timed out after {req.timeout}s and was killed",
                timeout=req.timeout, stdout=result.stdout, stderr=result.stderr,
                exec_id=exec_id, hint="raise the timeout or make the command finish sooner",
            )
        return result

    async def _run(self, record: ExecRecord, req: models.ExecRequest) -> ExecOutcome:
        """The exec itself: its output to the caller (the first `max_output` bytes of each
        stream) and to its record (the last ones), then its exit or error to the record.
        An exec that failed before its command said anything is not kept (a retry runs
        it)."""
        machine_id = record.machine_id
        kept: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        size = {"stdout": 0, "stderr": 0}
        cut = {"stdout": False, "stderr": False}
        said = False
        try:
            async with self._g.using(machine_id) as (rec, _handle, agent):
                self._g.changed(machine_id)
                # The guest enforces the timeout; the host deadline only catches a guest
                # that stopped answering altogether (a VM left paused, a hung kernel).
                deadline = req.timeout + HOST_GRACE if req.timeout else None
                exit: ExecExit | None = None
                try:
                    async with asyncio.timeout(deadline):
                        async for item in agent.exec(req.command, **_exec_kwargs(rec, req)):
                            said = True
                            if isinstance(item, ExecExit):
                                exit = item
                                continue
                            record.output(item.stream, item.data)
                            data = item.data
                            if size[item.stream] + len(data) > self._max_output:
                                data = data[: max(0, self._max_output - size[item.stream])]
                                cut[item.stream] = True
                            if data:
                                kept[item.stream].append(data)
                                size[item.stream] += len(data)
                except TimeoutError as exc:
                    raise MachineFailed(
                        f"machine {rec.name!r} stopped answering: the command's "
                        f"{req.timeout}s timeout passed {HOST_GRACE:.0f}s ago with no word "
                        "from the guest",
                        machine=rec.name, hint="check `boxd machine info`; delete and recreate it",
                    ) from exc
            if exit is None:  # pragma: no cover - exec() always ends with an exit or raises
                raise MachineFailed("exec ended without an exit status")
        except BaseException as exc:
            # The daemon's stop (which detaches the agents, then cancels what is left)
            # ends it: the command may be running, so it is kept (as after a kill) even
            # if it said nothing yet.
            stopping = self.stopping or isinstance(exc, asyncio.CancelledError)
            err = _without_exit(exc, record, stopping)
            if not said and not stopping:
                self.records.drop(record)
            record.finish(None, err)
            await self.records.finished(record)
            raise
        record.finish(exit, None)
        await self.records.finished(record)
        return ExecOutcome(
            stdout=b"".join(kept["stdout"]), stderr=b"".join(kept["stderr"]),
            exit_code=exit.exit_code, signal=exit.signal, timed_out=exit.timed_out,
            duration=exit.duration, stdout_truncated=cut["stdout"],
            stderr_truncated=cut["stderr"],
        )

    def _ended(self, task: asyncio.Task[ExecOutcome]) -> None:
        """An exec's task ended: its error is its record's (and its caller's, if one
        still waits), not an unretrieved task exception."""
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()

    async def exec_result(self, machine_id: str, exec_id: str, wait: float) -> models.ExecStatus:
        """The exec's record: its output so far and its exit, waiting up to ``wait``
        seconds for a running one to end.

        Raises:
            ExecNotFound: no exec of that id is kept for the machine.
        """
        rec = self._g.record(machine_id)
        record = self.records.find(machine_id, rec.name, exec_id)
        if wait > 0 and not record.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(record.done.wait()), wait)
        return record.status()

    async def execs(self, machine_id: str, limit: int) -> list[models.ExecSummary]:
        """The machine's last ``limit`` kept execs, newest first (no output)."""
        self._g.record(machine_id)
        return [r.summary() for r in self.records.recent(machine_id, limit)]

    async def exec_stream(
        self, machine_id: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        async with self._g.using(machine_id) as (rec, _handle, agent):
            self._g.changed(machine_id)
            async for item in agent.exec(req.command, **_exec_kwargs(rec, req)):
                if isinstance(item, ExecOutput):
                    yield models.ExecEvent(
                        type=item.stream, data=item.data.decode(errors="replace"), error=None
                    )
                else:
                    yield models.ExecEvent(
                        type="exit", exit_code=item.exit_code, signal=item.signal,
                        timed_out=item.timed_out, duration=item.duration, error=None,
                    )

    async def exec_interactive(
        self, machine_id: str, req: models.ExecRequest, inputs: AsyncIterator[pm.ExecInput],
        pty: tuple[int, int] | None,
    ) -> AsyncIterator[pm.ExecBytes | models.ExecEvent]:
        """A command whose stdin stays open: ``inputs`` feed it (bytes, EOF, a pty's new
        size) while its output is yielded as it comes, then one exit event. Closing the
        iterator before the exit kills the command."""
        async with self._g.using(machine_id) as (rec, _handle, agent):
            self._g.changed(machine_id)
            proc = await agent.start(
                req.command, **image_defaults(rec, req.env, req.cwd, req.user),
                timeout=req.timeout, pty=pty)
            feeder = asyncio.create_task(_feed(proc, inputs), name=f"stdin {machine_id}")
            try:
                async for item in proc:
                    if isinstance(item, ExecOutput):
                        yield pm.ExecBytes(item.stream, item.data)
                    else:
                        yield models.ExecEvent(
                            type="exit", exit_code=item.exit_code, signal=item.signal,
                            timed_out=item.timed_out, duration=item.duration, error=None)
            finally:
                feeder.cancel()
                await proc.aclose()

    async def upload(
        self, machine_id: str, path: str, data: bytes | AsyncIterable[bytes], mode: int,
        user: str | None = None,
    ) -> models.FileInfo:
        _absolute(path)
        async with self._g.using(machine_id) as (_, _handle, agent):
            self._g.changed(machine_id)
            st = await agent.write_file(path, data, mode, user)
        return models.FileInfo(path=path, size=st.size, mode=st.mode, sha256=st.sha256)

    async def download(self, machine_id: str, path: str) -> AsyncGenerator[bytes, None]:
        _absolute(path)
        # The machine stays awake (and leased) while the consumer reads; closing this
        # iterator stops the read in the guest.
        async with (
            self._g.using(machine_id) as (_, _handle, agent),
            contextlib.aclosing(agent.read_stream(path)) as chunks,
        ):
            async for chunk in chunks:
                yield chunk

    # ------------------------------------------------------------ processes

    async def spawn(self, machine_id: str, req: pm.SpawnRequest) -> pm.Process:
        if req.cwd is not None and not req.cwd.startswith("/"):
            raise InvalidRequest(f"cwd must be absolute: {req.cwd!r}", field="cwd")
        async with self._g.using(machine_id) as (rec, _handle, agent):
            self._g.changed(machine_id)
            proc = await agent.start(req.argv, **image_defaults(rec, req.env, req.cwd, req.user))
            relay = self.procs.add(machine_id, list(req.argv), proc,
                                   lambda: self._g.touch(machine_id))
        relay.dirty = True
        log.info("machine=%s event=spawned process=%s argv0=%s", machine_id, relay.id,
                 req.argv[0])
        return relay.model()

    async def start_service(self, rec: MachineRecord, agent: Agent) -> None:
        """Start the machine's image's service (`boxd.node._services`), if it has one;
        one that cannot start is an exited process whose reason says why."""
        argv = service_argv(rec.run_image)
        if argv is None:
            return
        try:
            proc = await agent.start(argv, **image_defaults(rec, None, None, None))
        except BoxdError as exc:
            self.procs.add_failed(rec.id, SERVICE_ID, argv, exc.message)
            log.warning("machine=%s event=service_failed error=%s", rec.id, exc.message)
            return
        self.procs.add(rec.id, argv, proc, lambda: None, relay_id=SERVICE_ID, framed=False)
        log.info("machine=%s event=service_started argv0=%s", rec.id, argv[0])

    async def processes(self, machine_id: str) -> list[pm.Process]:
        self._g.record(machine_id)
        return [r.model() for r in self.procs.list(machine_id)]

    async def process_output(self, machine_id: str, process_id: str, after: int | None,
                             wait: float) -> pm.ProcessOutput:
        """The process's stderr (a service's stdout too) kept after offset ``after``
        (None: all that is kept), waiting up to ``wait`` seconds for more when there is
        none yet. It reads the node's copy: no frame is taken from the process's client,
        and no guest is woken, except to follow a service detached from its stream (a
        fork child's copy, a restored or woken machine's).

        Raises:
            NotFound: no such process.
        """
        relay = self.procs.get(machine_id, process_id)
        if not relay.framed and relay.state == "detached":
            # A fork child's (or a restored machine's) service: follow it on the
            # machine's own connection, so its log goes on (the machine wakes for it).
            with contextlib.suppress(BoxdError):
                await self._reattach(relay)
        log = relay.stderr
        if wait > 0 and relay.state != "exited" and (after or 0) >= log.end:  # none yet
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(log.more(), wait)
        start, data = log.read(after)
        return pm.ProcessOutput(start=start, end=start + len(data), data=data,
                                state=relay.state,
                                exit_code=relay.exit.exit_code if relay.exit else None)

    async def process_kill(self, machine_id: str, process_id: str, signal: int) -> pm.Process:
        relay = self.procs.get(machine_id, process_id)
        if relay.state == "detached":
            await self._reattach(relay)
        if relay.process is not None:
            async with self._g.using(machine_id):
                await relay.process.kill(signal)
        return relay.model()

    @contextlib.asynccontextmanager
    async def process_attach(
        self, machine_id: str, process_id: str
    ) -> AsyncIterator[ProcessStream]:
        relay = self.procs.get(machine_id, process_id)
        if relay.attached:
            raise Conflict(f"process {process_id} already has a client attached",
                           machine=machine_id, hint="close the other handle first")
        if relay.state == "detached":
            await self._reattach(relay)
        relay.attached = True
        try:
            yield ProcessStream(relay, self.process_send, self._reattach)
        finally:
            relay.attached = False

    async def _reattach(self, relay: Relay) -> None:
        """Follow a detached process again on the machine's current agent connection.

        The guest keys the process by the exec id it had when the guest's memory was
        captured (a restore brings back an older one than the last attach), so the ids
        are tried newest first.
        """
        async with relay.attaching, self._g.using(relay.machine_id) as (_, _handle, agent):
            if relay.state == "running" and relay.process is not None:
                return  # another request re-attached it meanwhile
            last: BoxdError | None = None
            for exec_id in reversed(relay.exec_ids or [relay.exec_id]):
                try:
                    proc = await agent.attach(exec_id)
                except InvalidRequest as exc:  # not this id (or an agent too old)
                    last = exc
                    continue
                relay.bind(proc, lambda: self._g.touch(relay.machine_id))
                return
            relay.failure = last.message if last is not None else "no exec id"
            raise relay.not_running()

    async def process_send(self, relay: Relay, data: bytes) -> None:
        if relay.state == "detached":
            await self._reattach(relay)
        machine_id = relay.machine_id
        if relay.dirty and self.lifecycle.is_running(machine_id) and await self._send_hot(
            relay, data
        ):
            return
        async with self._g.using(machine_id):
            if not relay.dirty:
                self._g.changed(relay.machine_id)
                relay.dirty = True
            await relay.send(data)

    async def _send_hot(self, relay: Relay, data: bytes) -> bool:
        """The hot path (boxd.rl's steps): a running machine as this node last saw it,
        so no database read per frame; the lease still holds it against a swap. False
        when the machine was not running after all (the caller takes the slow path)."""
        machine_id = relay.machine_id
        async with self._g.lease(machine_id).use():
            if not (self.lifecycle.is_running(machine_id) and relay.state == "running"):
                return False
            self._g.touch(machine_id)
            try:
                await relay.send(data)
            except MachineFailed as exc:
                handle = self._g.current(machine_id)
                if handle is not None:
                    await self._g.raise_if_died(self._g.record(machine_id), handle, exc)
                raise
            return True

    def captured(self, machine_id: str) -> None:
        """A template of the machine is being taken: the next send changes it again."""
        for r in self.procs.list(machine_id):
            r.dirty = False


__all__ = ["HOST_GRACE", "Exec"]
