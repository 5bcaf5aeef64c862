"""Long-lived processes of machines (``machines.spawn``): the node's relay of frames.

A spawned process's stdin and stdout carry frames (a 4-byte big-endian length, then
the bytes); a machine's service (`boxd.node._services`) is a process whose stdout is
log, kept with its stderr. The relay writes each message the client sends as one frame and cuts the
process's stdout into frames as the agent delivers it: one slice per frame, no work
per byte. What the node holds of a process's output (the frames waiting for its
reader and the frame being received) is bounded per process (`MAX_BUFFERED`) and for
all processes of the node together (`MAX_BUFFERED_TOTAL`, a `Budget`): a frame header
larger than a process may hold is refused at once, and a process whose output passes
either bound is killed, its unread frames dropped, and the reason kept (`failure`,
``reason`` in its model). The agent channel stays at most a flow-control window ahead
of the relay (`AgentClient.start`). The last `LOG_TAIL` bytes of stderr are kept
(`OutputLog`): its last few KiB for the process's model and error messages, all of it
for a reader that follows it (`process_output`: the web console's live tail), which
never takes a frame from the process's client.

The table outlives a machine's VM process: when the VM is replaced (checkpoint
restore, a wake from hibernation, a RAM swap) or forked, the guest still runs the
process (same memory) but the host's connection to its stream is gone, so the relay is
``detached`` until it is re-attached on the new agent connection. A fork child
inherits its source's table (its copies of the processes, same ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from boxd import process_models as pm
from boxd.engine.base import ExecExit, ExecOutput, Process
from boxd.errors import BoxdError, Conflict, InvalidRequest, MachineFailed, NotFound

log = logging.getLogger("boxd.node")

#: Bytes of a process's output the node may hold (frames waiting for its reader, and
#: the frame being received) before the process is killed.
MAX_BUFFERED = 64 << 20
#: The largest frame a process may write: what the node may hold for it. A larger
#: header is refused when it arrives (the process is killed), never buffered towards.
MAX_FRAME = MAX_BUFFERED
#: Bytes of output all the processes of a node together may have held; the process
#: whose output passes it is killed.
MAX_BUFFERED_TOTAL = 256 << 20
#: Seconds a process killed for its output is waited for (its exit status).
KILL_WAIT = 10.0
#: Bytes of stderr a process's model and error messages show (its last ones).
STDERR_TAIL = 8 << 10
#: Bytes of stderr kept per process for a reader that follows it (its last ones).
LOG_TAIL = 64 << 10
#: Exited processes kept in the table (for their exit status) per machine.
KEEP_EXITED = 32


class Budget:
    """Bytes of process output held by a node, against ``limit``, shared by its relays."""

    def __init__(self, limit: int = MAX_BUFFERED_TOTAL) -> None:
        self.limit = limit
        self.used = 0


class _Overflow(Exception):
    """A process's output passed a bound: it is killed with this reason."""


#: A frame this large is received into a buffer of its own, grown as its bytes arrive
#: and handed over whole: no copy (three copies of a 63 MiB frame, buffer, slice and
#: bytes, once took the daemon past its accounted bound).
BIG_FRAME = 1 << 20


def _length(data: bytes | bytearray, i: int) -> int:
    """The length in the frame header at ``data[i:i+4]``.

    Raises:
        _Overflow: it is larger than `MAX_FRAME`.
    """
    n = int.from_bytes(data[i : i + 4], "big")
    if n > MAX_FRAME:
        raise _Overflow(
            f"killed: it wrote a {n}-byte frame header (limit {MAX_FRAME}"
            " bytes per frame): a larger message, or not framed output?")
    return n


def _whole(data: bytes | bytearray, out: list[bytes | bytearray]) -> int:
    """Append the whole frames at the head of ``data`` to ``out`` (each one copy, of
    ``data``'s type); return where the first incomplete one starts."""
    i, end = 0, len(data)
    while end - i >= 4:
        n = _length(data, i)
        if end - i - 4 < n:
            break
        out.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return i


class _Cutter:
    """Cuts a process's stdout into frames (a 4-byte big-endian length, then the bytes).

    Small frames are sliced out of one buffer (one copy). A frame of `BIG_FRAME` bytes
    or more is received into a ``bytearray`` of its own that grows as its bytes arrive
    (not one allocated, and zeroed, at its full size when its header arrives: that
    would hold memory the node has not counted) and is itself the frame handed on, so
    the node holds each byte of it once.
    """

    def __init__(self) -> None:
        self.buf = bytearray()
        self.big: bytearray | None = None
        self.need = 0  # the size of the large frame being received

    def clear(self) -> None:
        self.buf.clear()
        self.big = None
        self.need = 0

    def feed(self, data: bytes) -> list[bytes | bytearray]:
        """The frames ``data`` completes, in order.

        Raises:
            _Overflow: a frame header larger than `MAX_FRAME`.
        """
        out: list[bytes | bytearray] = []
        if self.big is None and not self.buf:  # the usual case: whole frames, cut from data
            i = _whole(data, out)
            if i == len(data):
                return out
            data = data[i:]
        view = memoryview(data)
        while view:
            if self.big is not None:
                k = min(len(view), self.need - len(self.big))
                self.big += view[:k]
                view = view[k:]
                if len(self.big) == self.need:
                    out.append(self.big)
                    self.big, self.need = None, 0
                continue
            self.buf += view
            view = view[len(view):]
            self._cut(out)
        return out

    def _cut(self, out: list[bytes | bytearray]) -> None:
        buf = self.buf
        del buf[: _whole(buf, out)]
        if len(buf) >= 4 and (n := _length(buf, 0)) >= BIG_FRAME:
            # the rest of it arrives into a buffer of its own
            del buf[:4]  # at the front: O(1), no copy
            self.big, self.need = buf, n
            self.buf = bytearray()


class OutputLog:
    """The last ``limit`` bytes a process wrote to stderr, addressed by offset (bytes
    since it started), so that a reader resumes where it was: `read` after an offset,
    `more` to wait for the next bytes. Readers hold an offset each, nothing here: the
    memory is the log's, however many follow it."""

    def __init__(self, limit: int = LOG_TAIL) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.end = 0  # the offset after the last byte written
        self._more = asyncio.Event()

    @property
    def start(self) -> int:
        """The offset of the first byte kept."""
        return self.end - len(self.buf)

    def add(self, data: bytes) -> None:
        if not data:
            return
        self.buf += data
        self.end += len(data)
        del self.buf[: max(0, len(self.buf) - self.limit)]
        self.wake()

    def wake(self) -> None:
        """Wake the readers waiting in `more` (new bytes, or the process ended)."""
        self._more.set()
        self._more = asyncio.Event()

    async def more(self) -> None:
        """Return at the next `add` or `wake`."""
        await self._more.wait()

    def read(self, after: int | None) -> tuple[int, bytes]:
        """The offset the bytes start at, and the bytes kept after ``after``: all that
        is kept if ``after`` is None or older than `start` (the reader fell behind)."""
        start = self.start
        begin = start if after is None or after < start else min(after, self.end)
        return begin, bytes(self.buf[begin - start:])

    def tail(self, n: int) -> bytes:
        return bytes(self.buf[-n:])

    def copy(self) -> OutputLog:
        log = OutputLog(self.limit)
        log.buf, log.end = bytearray(self.buf), self.end
        return log


@dataclass
class Relay:
    """One spawned process as the node sees it."""

    id: str
    machine_id: str
    argv: list[str]
    started_at: float
    exec_id: int
    state: str = "running"  # running | detached | exited
    exit: ExecExit | None = None
    failure: str = ""
    attached: bool = False
    stderr: OutputLog = field(default_factory=OutputLog)
    process: Process | None = None
    frames: asyncio.Queue[bytes | bytearray | None] = field(default_factory=asyncio.Queue)
    buffered: int = 0  # bytes of its output held: frames queued, and the partial frame
    budget: Budget = field(default_factory=Budget)  # the node's (shared by its relays)
    sent: int = 0  # frames sent and not yet answered by a frame (idle timers)
    dirty: bool = False  # sent to since the machine's last template (see NodeRuntime)
    # Every agent exec id this process has had, newest last: a restore brings back the
    # guest as it was, keyed by the id of that moment (see NodeRuntime re-attach).
    exec_ids: list[int] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    attaching: asyncio.Lock = field(default_factory=asyncio.Lock)  # one re-attach at a time
    # False: a service (`boxd.node._services`): stdout is log, like stderr, not frames.
    framed: bool = True

    def model(self) -> pm.Process:
        return pm.Process(
            id=self.id, machine=self.machine_id, argv=self.argv, state=self.state,
            attached=self.attached,
            exit_code=self.exit.exit_code if self.exit else None,
            signal=self.exit.signal if self.exit else None, started_at=self.started_at,
            stderr_tail=self.stderr.tail(STDERR_TAIL).decode(errors="replace"),
            reason=self.failure or None,
        )

    def _hold(self, n: int) -> None:
        """Count ``n`` more bytes of output held; raises _Overflow past a bound."""
        self.buffered += n
        self.budget.used += n
        if self.buffered > MAX_BUFFERED:
            raise _Overflow(
                f"killed: it wrote {self.buffered} bytes of output nobody read yet "
                f"(limit {MAX_BUFFERED} per process)")
        if self.budget.used > self.budget.limit:
            raise _Overflow(
                f"killed: the node holds {self.budget.used} bytes of process output nobody "
                f"read yet, this process's {self.buffered} among them (limit "
                f"{self.budget.limit} for all processes)")

    def release(self, n: int) -> None:
        """``n`` bytes of output held are gone (read, or dropped)."""
        self.buffered -= n
        self.budget.used -= n

    def _drop_frames(self) -> None:
        """Drop the frames nobody read (a process killed for its output)."""
        ends = 0
        while not self.frames.empty():
            frame = self.frames.get_nowait()
            if frame is None:
                ends += 1
            else:
                self.release(len(frame))
        for _ in range(ends):
            self.frames.put_nowait(None)  # end markers stay, for a waiting reader

    def bind(self, process: Process, on_frame: Callable[[], None]) -> None:
        """Follow ``process`` (a fresh start, or a re-attach on a new connection)."""
        self.process = process
        self.exec_id = process.exec_id
        if process.exec_id not in self.exec_ids:
            self.exec_ids.append(process.exec_id)
        self.state = "running"
        self.failure = ""
        self.task = asyncio.create_task(self._read(process, on_frame),
                                        name=f"process {self.machine_id}/{self.id}")

    async def _read(self, process: Process, on_frame: Callable[[], None]) -> None:
        buf = _Cutter()
        partial = [0]  # bytes of buf counted as held
        try:
            await self._pump(process, on_frame, buf, partial)
        except asyncio.CancelledError:
            raise
        except _Overflow as exc:
            self.release(partial[0])
            partial[0] = 0
            buf.clear()
            self.failure = str(exc)
            self._drop_frames()
            log.warning("machine=%s event=process_killed process=%s reason=%r",
                        self.machine_id, self.id, self.failure)
            await self._kill(process)
            self.state = "exited"
        except InvalidRequest as exc:
            self.failure = exc.message
            with contextlib.suppress(BoxdError):
                await process.kill(9)
            self.state = "exited"
        except BoxdError as exc:
            # The agent connection went away: the guest may still run the process (a
            # VM swap, a restore, a fork) until the host re-attaches. A newer binding
            # (re-attached meanwhile) is left alone.
            if self.process is process and self.state != "exited":
                self.state = "detached"
                self.failure = exc.message
        finally:
            self.release(partial[0])
            if self.process is process:
                self.process = None
            self.frames.put_nowait(None)
            self.stderr.wake()  # its readers see it ended

    async def _pump(self, process: Process, on_frame: Callable[[], None], buf: _Cutter,
                    partial: list[int]) -> None:
        """Read ``process``'s output until it ends: stderr into its tail, stdout split into
        frames (``partial[0]``: the bytes of ``buf`` counted as held)."""
        async for chunk in process:
            if isinstance(chunk, ExecOutput):
                if chunk.stream == "stderr" or not self.framed:
                    self.stderr.add(chunk.data)
                    continue
                partial[0] += len(chunk.data)
                self._hold(len(chunk.data))
                for frame in buf.feed(chunk.data):
                    partial[0] -= 4 + len(frame)
                    self.release(4)  # the header: the frame stays held
                    self.sent = max(0, self.sent - 1)
                    self.frames.put_nowait(frame)
                    on_frame()
            elif isinstance(chunk, ExecExit):
                self.exit = chunk
                self.state = "exited"
        if self.process is process and self.state == "running":
            # The output ended without an exit status: the connection closed.
            self.state = "detached"
            self.failure = "the agent connection closed"

    async def _kill(self, process: Process) -> None:
        """Kill ``process`` and wait (a while) for its exit status, dropping its output."""
        with contextlib.suppress(BoxdError):
            await process.kill(9)

        async def status() -> None:
            async for chunk in process:
                if isinstance(chunk, ExecExit):
                    self.exit = chunk
                    return

        with contextlib.suppress(BoxdError, TimeoutError):
            await asyncio.wait_for(status(), KILL_WAIT)

    async def send(self, data: bytes) -> None:
        """Raises: Conflict: the process is not running (exited or detached)."""
        process = self.process
        if process is None or self.state != "running":
            raise self.not_running()
        self.sent += 1
        await process.write(len(data).to_bytes(4, "big") + data)

    def not_running(self) -> BoxdError:
        if self.state == "exited":
            status = (f"exit status {self.exit.exit_code}" if self.exit else "no exit status")
            why = f": {self.failure}" if self.failure else ""
            tail = self.stderr.tail(600).decode(errors="replace").strip()
            return Conflict(
                f"process {self.id} has exited ({status}){why}"
                + (f"; its stderr ends with: {tail}" if tail else ""),
                machine=self.machine_id, process=self.id,
                hint="spawn it again (`machines.spawn`)")
        why = self.failure or "the machine was restored, forked or woken"
        return MachineFailed(
            f"process {self.id} is detached from its stream ({why})", machine=self.machine_id,
            hint="re-attach it: machines.processes(ref) lists it, attach(id) reconnects")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


class ProcessStream:
    """One client's end of a process's stream (while it is attached)."""

    def __init__(
        self, relay: Relay, send: Callable[[Relay, bytes], Awaitable[None]],
        reattach: Callable[[Relay], Awaitable[None]],
    ) -> None:
        self._relay = relay
        self._send = send
        self._reattach = reattach

    @property
    def process(self) -> pm.Process:
        return self._relay.model()

    async def send(self, data: bytes) -> None:
        """One message to the process (one frame on its stdin).

        Raises:
            Conflict: it has exited; MachineFailed: it is detached and cannot be re-attached.
        """
        await self._send(self._relay, data)

    async def recv(self) -> bytes | bytearray | None:
        """The next frame the process wrote, or None once it has exited.

        Raises:
            MachineFailed: the stream was lost (the machine's VM was replaced and the
                process could not be re-attached).
        """
        relay = self._relay
        while True:
            if relay.frames.empty() and relay.state == "exited":
                return None
            frame = await relay.frames.get()
            if frame is not None:
                relay.release(len(frame))
                return frame
            if relay.state == "exited":
                return None
            if relay.state == "detached":
                # The machine's VM was replaced under the stream (a RAM swap before a
                # fork or checkpoint, a restore, a wake from hibernation): follow the
                # process on the new connection; the client sees nothing of it.
                await self._reattach(relay)
            # A None from a previous binding (re-attached since): keep reading.


class ProcessTable:
    """Every machine's processes on this node."""

    def __init__(self, budget: Budget | None = None) -> None:
        self._by_machine: dict[str, dict[str, Relay]] = {}
        self.budget = budget if budget is not None else Budget()

    def add(self, machine_id: str, argv: list[str], process: Process,
            on_frame: Callable[[], None], *, relay_id: str | None = None,
            framed: bool = True) -> Relay:
        """Follow a started ``process``; ``relay_id`` (default: a new one) replaces a
        relay of that id; ``framed=False``: its stdout is log, not frames (a service)."""
        relay = Relay(id=relay_id or f"p-{secrets.token_hex(6)}", machine_id=machine_id,
                      argv=argv, started_at=time.time(), exec_id=process.exec_id,
                      budget=self.budget, framed=framed)
        table = self._by_machine.setdefault(machine_id, {})
        exited = [r for r in table.values() if r.state == "exited" and not r.attached]
        for old in exited[: max(0, len(exited) + 1 - KEEP_EXITED)]:
            table.pop(old.id, None)
            old._drop_frames()
        table[relay.id] = relay
        relay.bind(process, on_frame)
        return relay

    def add_failed(self, machine_id: str, relay_id: str, argv: list[str], why: str) -> None:
        """A process that could not start: exited, with ``why`` as its reason."""
        relay = Relay(id=relay_id, machine_id=machine_id, argv=argv, started_at=time.time(),
                      exec_id=0, state="exited", failure=why, budget=self.budget,
                      framed=False)
        relay.stderr.add(f"boxd: it could not start: {why}\n".encode())
        self._by_machine.setdefault(machine_id, {})[relay_id] = relay

    def get(self, machine_id: str, process_id: str) -> Relay:
        relay = self._by_machine.get(machine_id, {}).get(process_id)
        if relay is None:
            raise NotFound(
                f"no process {process_id!r} in this machine", machine=machine_id,
                process=process_id, hint="machines.processes(ref) lists its processes")
        return relay

    def list(self, machine_id: str) -> list[Relay]:
        return list(self._by_machine.get(machine_id, {}).values())

    def busy(self, machine_id: str) -> bool:
        """A frame was sent and its answer has not come yet (keeps the machine awake)."""
        return any(r.sent > 0 and r.state == "running"
                   for r in self._by_machine.get(machine_id, {}).values())

    def inherit(self, source_id: str, child_id: str) -> None:
        """A fork child runs copies of its source's running processes: same ids, to be
        re-attached on the child's own connection."""
        copies = {}
        for r in self.list(source_id):
            if r.state != "exited":
                copies[r.id] = Relay(id=r.id, machine_id=child_id, argv=list(r.argv),
                                     started_at=r.started_at, exec_id=r.exec_id,
                                     state="detached", failure="a fork's copy",
                                     stderr=r.stderr.copy(), exec_ids=list(r.exec_ids),
                                     budget=self.budget, framed=r.framed)
        if copies:
            self._by_machine[child_id] = copies

    def detach_all(self, machine_id: str, why: str) -> None:
        """The machine's VM process was replaced: every live relay loses its stream."""
        for r in self.list(machine_id):
            if r.state == "running":
                r.state = "detached"
                r.failure = why

    async def drop(self, machine_id: str) -> None:
        for r in self._by_machine.pop(machine_id, {}).values():
            await r.stop()
            r._drop_frames()

    async def close(self) -> None:
        for machine_id in list(self._by_machine):
            await self.drop(machine_id)


__all__ = ["LOG_TAIL", "MAX_BUFFERED", "MAX_BUFFERED_TOTAL", "MAX_FRAME", "Budget",
           "OutputLog", "ProcessStream", "ProcessTable", "Relay"]
