"""Durable execs: what a node keeps of each exec, readable by its id (``exec_result``).

An exec runs in a task of the node's, not of the request that started it: a caller whose
connection drops does not end the command, and its result is read later by the exec's
id. Each record keeps the last `KEPT_OUTPUT` bytes of stdout and of stderr, and the exit
(or the error that ended the exec without one). Finished records are kept
`KEEP_SECONDS`, at most `KEEP_PER_MACHINE` per machine and `KEPT_TOTAL` bytes of output
on the node (the oldest finished ones go first); running ones are never dropped.

Records live in memory and, on a node with an `ExecFiles` (the daemon's), on disk too
(`boxd.storage.execs`, ``<data dir>/execs/<machine id>/<exec id>.json``): an exec's
record is written when it starts (running) and again when it ends, before its caller
gets the answer; what is dropped from memory is removed from disk. A new daemon loads
them (`ExecRecords.load`): a finished exec's result is read as before the restart, and
an exec that was still running when the daemon died answers `AgentLost` (its result
never reached the daemon; the command may have run in part or whole). See
docs/lifecycle.md#durable-exec.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import secrets
import shlex
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from boxd import models
from boxd.engine.base import ExecExit
from boxd.errors import AgentLost, BoxdError, ExecNotFound, ExecTimeout, error_from_body
from boxd.storage.execs import ExecFiles

log = logging.getLogger("boxd.node")

#: Bytes of each stream (stdout, stderr) an exec's record keeps: its last ones.
KEPT_OUTPUT = 1 << 20
#: Seconds a finished exec's record is kept.
KEEP_SECONDS = 15 * 60.0
#: Records kept per machine (the oldest finished ones are dropped past it).
KEEP_PER_MACHINE = 64
#: Bytes of output the finished records of a node may hold together.
KEPT_TOTAL = 256 << 20
#: Output up to which a finished record's file is written on the event loop (a
#: tenth of a millisecond); a larger one (up to 2 MiB: ten) is written in a thread.
_WRITE_INLINE = 64 << 10


def new_exec_id() -> str:
    return "x-" + secrets.token_hex(8)


def shown_command(command: str | list[str], limit: int = models.EXEC_COMMAND_SHOWN) -> str:
    """``command`` as a listing shows it: a string as given, an argv shell-quoted; cut
    to ``limit`` characters (the last one "…")."""
    text = command if isinstance(command, str) else shlex.join(command)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fingerprint(req: models.ExecRequest) -> str:
    """What makes two requests with one exec id the same exec."""
    body = req.model_dump(exclude={"exec_id"})
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class _Tail:
    """The last ``limit`` bytes written."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.dropped = False

    def add(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]
            self.dropped = True

    def text(self) -> str:
        return bytes(self.buf).decode(errors="replace")


class ExecRecord:
    """One exec of a machine: its output's tail, then its exit or its error."""

    def __init__(self, exec_id: str, machine_id: str, req: models.ExecRequest,
                 kept: int = KEPT_OUTPUT) -> None:
        self.exec_id = exec_id
        self.machine_id = machine_id
        self.fingerprint = fingerprint(req)
        self.command = shown_command(req.command)
        self.timeout = req.timeout
        self.started_at = time.time()
        self.stdout = _Tail(kept)
        self.stderr = _Tail(kept)
        self.exit: ExecExit | None = None
        self.error: BoxdError | None = None
        self.finished_at: float | None = None  # monotonic
        self.done = asyncio.Event()

    @property
    def size(self) -> int:
        return len(self.stdout.buf) + len(self.stderr.buf)

    def output(self, stream: str, data: bytes) -> None:
        (self.stdout if stream == "stdout" else self.stderr).add(data)

    def finish(self, exit: ExecExit | None, error: BoxdError | None) -> None:
        self.exit, self.error = exit, error
        self.finished_at = time.monotonic()
        self.done.set()

    def status(self) -> models.ExecStatus:
        fields = {k: v for k, v in self.summary() if k != "command"}
        return models.ExecStatus(
            **fields, stdout=self.stdout.text(), stderr=self.stderr.text(),
            stdout_truncated=self.stdout.dropped, stderr_truncated=self.stderr.dropped,
        )

    def summary(self) -> models.ExecSummary:
        """What a listing shows of it: no output."""
        ex = self.exit
        return models.ExecSummary(
            exec_id=self.exec_id, command=self.command, running=not self.done.is_set(),
            exit_code=ex.exit_code if ex else None, signal=ex.signal if ex else None,
            timed_out=ex.timed_out if ex else False, duration=ex.duration if ex else None,
            started_at=self.started_at,
            error=models.ErrorBody.model_validate(self.error.to_body()["error"])
            if self.error is not None else None,
        )

    def result(self) -> models.ExecResult:
        """The finished exec as ``exec`` answers it (its kept output).

        Raises:
            BoxdError: what ended it without an exit; ExecTimeout: it timed out.
        """
        if self.error is not None:
            raise self.error
        ex = self.exit
        assert ex is not None
        out, err = self.stdout.text(), self.stderr.text()
        if ex.timed_out:
            raise ExecTimeout(
                f"command timed out after {self.timeout}s and was killed",
                timeout=self.timeout, stdout=out, stderr=err, exec_id=self.exec_id,
                hint="raise the timeout or make the command finish sooner",
            )
        return models.ExecResult(
            exec_id=self.exec_id, stdout=out, stderr=err, exit_code=ex.exit_code,
            signal=ex.signal, timed_out=ex.timed_out, duration=ex.duration,
            stdout_truncated=self.stdout.dropped, stderr_truncated=self.stderr.dropped,
        )

    def doc(self) -> dict[str, Any]:
        """The record as its file keeps it (`boxd.storage.execs`; the ids are its path)."""
        ex = self.exit
        return {
            "fingerprint": self.fingerprint, "timeout": self.timeout,
            "started_at": self.started_at,
            # Wall clock on disk: the monotonic clock starts again with the host.
            "finished_at": None if self.finished_at is None
            else time.time() - (time.monotonic() - self.finished_at),
            "exit": None if ex is None else {"exit_code": ex.exit_code, "signal": ex.signal,
                                             "timed_out": ex.timed_out, "duration": ex.duration},
            "error": None if self.error is None else self.error.to_body(),
            "stdout": base64.b64encode(self.stdout.buf).decode(),
            "stderr": base64.b64encode(self.stderr.buf).decode(),
            "stdout_dropped": self.stdout.dropped, "stderr_dropped": self.stderr.dropped,
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> ExecRecord:
        """The record a file kept (running, if it was when written).

        Raises:
            KeyError, TypeError, ValueError: not a record of this format.
        """
        rec = cls(str(doc["exec_id"]), str(doc["machine_id"]),
                  models.ExecRequest(command="-", timeout=doc["timeout"]))
        rec.fingerprint = str(doc["fingerprint"])
        rec.started_at = float(doc["started_at"])
        for tail, name in ((rec.stdout, "stdout"), (rec.stderr, "stderr")):
            tail.add(base64.b64decode(str(doc[name]), validate=True))
            tail.dropped = tail.dropped or bool(doc[f"{name}_dropped"])
        if doc["finished_at"] is not None:
            exit = ExecExit(**doc["exit"]) if doc["exit"] is not None else None
            error = error_from_body(doc["error"]) if doc["error"] is not None else None
            if exit is None and error is None:
                raise ValueError("a finished record without its exit or error")
            rec.finish(exit, error)
            rec.finished_at = time.monotonic() - max(0.0, time.time() - doc["finished_at"])
        return rec


class ExecRecords:
    """The exec records of a node, per machine (see the module docstring)."""

    def __init__(self, *, keep_seconds: float = KEEP_SECONDS,
                 per_machine: int = KEEP_PER_MACHINE, total: int = KEPT_TOTAL,
                 files: ExecFiles | None = None) -> None:
        self.keep_seconds = keep_seconds
        self.per_machine = per_machine
        self.total = total
        self.files = files  # None: in memory only
        self._by_machine: dict[str, OrderedDict[str, ExecRecord]] = {}

    def get(self, machine_id: str, exec_id: str) -> ExecRecord | None:
        self.prune()
        return self._by_machine.get(machine_id, OrderedDict()).get(exec_id)

    def find(self, machine_id: str, machine_name: str, exec_id: str) -> ExecRecord:
        """Raises: ExecNotFound."""
        rec = self.get(machine_id, exec_id)
        if rec is None:
            raise ExecNotFound(
                f"no exec {exec_id!r} is kept for machine {machine_name!r}",
                machine=machine_name, exec_id=exec_id,
                hint=f"results are kept {self.keep_seconds / 60:.0f} minutes after the exec "
                f"ends (the last {self.per_machine} per machine); check the id",
            )
        return rec

    def recent(self, machine_id: str, limit: int) -> list[ExecRecord]:
        """The machine's last ``limit`` kept execs, newest first."""
        self.prune()
        records = list(self._by_machine.get(machine_id, OrderedDict()).values())
        return records[::-1][:max(0, limit)]

    def add(self, rec: ExecRecord) -> None:
        """Keep a new (running) record.

        Raises:
            ResourceExhausted, InternalError: its file could not be written (nothing kept).
        """
        if self.files is not None:
            # On disk before the command runs: a daemon that dies while it runs leaves a
            # record that says so (`load`), not no record at all.
            self.files.write(rec.machine_id, rec.exec_id, rec.doc())
        self._by_machine.setdefault(rec.machine_id, OrderedDict())[rec.exec_id] = rec
        self.prune()

    def drop(self, rec: ExecRecord) -> None:
        records = self._by_machine.get(rec.machine_id)
        if records is not None and records.get(rec.exec_id) is rec:
            del records[rec.exec_id]
            if not records:
                del self._by_machine[rec.machine_id]
            self._unlink(rec)

    def forget(self, machine_id: str) -> None:
        """The machine is gone: so are its records."""
        self._by_machine.pop(machine_id, None)
        if self.files is not None:
            self.files.remove_machine(machine_id)

    def prune(self) -> None:
        """Drop what is past its time, past a machine's count, past the node's bytes."""
        now = time.monotonic()
        finished: list[ExecRecord] = []
        for machine_id, records in list(self._by_machine.items()):
            for rec in list(records.values()):
                if rec.finished_at is not None and now - rec.finished_at > self.keep_seconds:
                    del records[rec.exec_id]
                    self._unlink(rec)
            over = len(records) - self.per_machine
            for rec in [r for r in records.values() if r.finished_at is not None][:max(0, over)]:
                del records[rec.exec_id]
                self._unlink(rec)
            if not records:
                del self._by_machine[machine_id]
            finished += [r for r in records.values() if r.finished_at is not None]
        held = sum(r.size for r in finished)
        finished.sort(key=lambda r: r.finished_at or 0.0)
        for rec in finished:
            if held <= self.total:
                break
            held -= rec.size
            self.drop(rec)

    # ------------------------------------------------------------ on disk

    def _unlink(self, rec: ExecRecord) -> None:
        if self.files is not None:
            self.files.remove(rec.machine_id, rec.exec_id)

    async def finished(self, rec: ExecRecord) -> None:
        """``rec`` ended: its end goes to its file (before its caller hears of it), then
        the bounds apply. A file that cannot be written is logged (it still says
        running: after a restart the exec answers `AgentLost`)."""
        self.prune()
        if self.files is None or self._kept(rec) is not rec:
            return
        try:
            if rec.size <= _WRITE_INLINE:
                self.files.write(rec.machine_id, rec.exec_id, rec.doc())
                return
            # MiBs of output: encoded and written off the event loop. The record may be
            # dropped meanwhile (its file then goes), or even replaced by a new exec of
            # the same id (whose own record goes back).
            await asyncio.to_thread(self.files.write, rec.machine_id, rec.exec_id, rec.doc())
            now = self._kept(rec)
            if now is None:
                self._unlink(rec)
            elif now is not rec:
                self.files.write(now.machine_id, now.exec_id, now.doc())
        except BoxdError as exc:
            log.warning("machine=%s event=exec_record_not_written exec=%s error=%s",
                        rec.machine_id, rec.exec_id, exc)

    def _kept(self, rec: ExecRecord) -> ExecRecord | None:
        """The record kept now under ``rec``'s machine and id (``rec`` or another)."""
        return self._by_machine.get(rec.machine_id, OrderedDict()).get(rec.exec_id)

    async def load(self, machine_name: Callable[[str], str | None]) -> None:
        """After a daemon (re)start: the records the last one left on disk. A record that
        was running when it died ends with `AgentLost` (and is written so). Records of
        machines the node no longer has (``machine_name`` answers None) are removed;
        then the bounds apply."""
        if self.files is None:
            return
        files = self.files
        loaded: list[ExecRecord] = []
        for doc in await asyncio.to_thread(files.read_all):
            name = machine_name(doc["machine_id"])
            if name is None:
                files.remove_machine(doc["machine_id"])
                continue
            try:
                rec = ExecRecord.from_doc(doc)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("machine=%s event=exec_record_dropped exec=%s error=%r",
                            doc["machine_id"], doc["exec_id"], exc)
                files.remove(doc["machine_id"], doc["exec_id"])
                continue
            if rec.finished_at is None:
                rec.finish(None, _interrupted(rec, name))
                with contextlib.suppress(BoxdError):  # still "running": the same answer
                    files.write(rec.machine_id, rec.exec_id, rec.doc())
            loaded.append(rec)
        for rec in sorted(loaded, key=lambda r: r.started_at):
            self._by_machine.setdefault(rec.machine_id, OrderedDict())[rec.exec_id] = rec
        self.prune()


def _interrupted(rec: ExecRecord, machine: str) -> AgentLost:
    return AgentLost(
        f"the daemon restarted while exec {rec.exec_id!r} ran on machine {machine!r}: its "
        "exit was lost with the daemon's connection to the guest's agent",
        machine=machine, exec_id=rec.exec_id,
        hint="its outcome is unknown (the command may have run in part or whole): run it "
        "again with a new exec id",
    )


__all__ = [
    "KEEP_PER_MACHINE", "KEEP_SECONDS", "KEPT_OUTPUT", "KEPT_TOTAL", "ExecRecord",
    "ExecRecords", "fingerprint", "new_exec_id", "shown_command",
]
