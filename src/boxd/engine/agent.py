"""Host side of the guest agent channel: an asyncio client for ``boxd.guest.agent``.

One `AgentClient` is one connection to a machine's agent socket (QEMU's virtio-serial
chardev). Requests are multiplexed over it by id; replies whose id the client does not know
(stale answers from before a fork, restore or reconnect) are dropped. Protocol:
``docs/agent-protocol.md``.

Every failure surfaces as a `boxd.errors.BoxdError`: a lost connection or an agent that does
not answer is `MachineFailed`, a missing guest file is `GuestFileNotFound`, other guest file
errors are `InvalidRequest`, a corrupted transfer is `IntegrityError`.

`AgentClient` is a facade over collaborators with narrow interfaces: a `_Channel` (the
framing, request ids and the reader that routes replies to their request), and over it
`_ExecSessions` (commands: their output, stdin and exit), `_FileTransfer` (guest files,
checked by sha256) and `_RelayServer` (the in-guest API socket); `AgentClient.dial` runs a
dialer process and bridges it to a socket pair (`_bridge`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import select
import socket
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
)
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from boxd.errors import (
    AgentLost,
    BoxdError,
    GuestFileNotFound,
    HostSetupError,
    IntegrityError,
    InternalError,
    InvalidRequest,
    MachineFailed,
)
from boxd.guest import protocol as P

__all__ = [
    "AgentClient",
    "ExecChunk",
    "ExecExit",
    "ExecOutcome",
    "ExecOutput",
    "ExecProcess",
    "FileStat",
    "GuestStream",
    "GuestUsage",
    "connect_watched",
    "dial_guest_port",
]

log = logging.getLogger(__name__)

#: Seconds to wait for the reply of a one-shot request (ping, stat, kill, identity, ...).
REQUEST_TIMEOUT = 30.0
#: Where a QEMU guest's agent tree is (boxd-init and agent.py, for `AgentClient.dial`);
#: a gVisor sandbox has it at ``boxd.images.AGENT_MOUNT``.
GUEST_TREE = "/run/boxd"
#: Seconds the guest's dialer (`AgentClient.dial`) has to connect.
DIAL_TIMEOUT = 10.0
#: Seconds a streaming read or a file write may go without any message from the agent.
STREAM_IDLE_TIMEOUT = 120.0
#: The protocol minor version from which the agent can re-attach an exec (``attach``).
ATTACH_MINOR = 2
#: From this minor version ``stdin`` takes ``"reply": false``: no reply unless it fails.
UNACKED_STDIN_MINOR = 4
#: The protocol minor version from which the agent serves the in-guest API socket.
RELAY_MINOR = 5
#: The protocol minor version from which an exec takes ``user`` (an older agent would
#: ignore it and run the command as root).
USER_MINOR = 6
#: The protocol minor version from which an exec runs on a pty (``pty``, ``resize``).
PTY_MINOR = 7
#: The protocol minor version from which the agent answers ``metrics``.
METRICS_MINOR = 8
#: The protocol minor version from which a write takes ``user`` (its owner; an older
#: agent would ignore it and leave the file root's).
WRITE_USER_MINOR = 9
#: How often `connect` re-sends hello while the guest agent is not up yet.
HELLO_RETRY = 0.25
#: The protocol minor version from which reads and execs take a flow-control ``window``.
WINDOW_MINOR = 3
#: Seconds a guest stream whose connection was lost waits to be moved to the next one.
STREAM_MOVE_WAIT = 30.0
#: Guest connections to the in-guest API socket a machine may have open at once
#: (`AgentClient.serve_relay`); more are closed as they come.
MAX_GUEST_STREAMS = 64

_RELAY_EVENTS = frozenset({P.EV_RELAY_OPEN, P.EV_RELAY_DATA, P.EV_RELAY_EOF})
# Relay events kept for a relay not served yet (`_StrayRelay`).
_STRAY_MAX = 1024
# Tasks serving guest streams: they may outlive the agent connection they came on.
_STREAM_TASKS: set[asyncio.Task[None]] = set()


class ExecOutput(NamedTuple):
    """A piece of a command's output, as it arrived (unpacks as ``(stream, data)``)."""

    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True)
class ExecExit:
    """The end of a command: ``exit_code`` is 128+N when it was killed by signal N."""

    exit_code: int
    signal: int | None
    timed_out: bool
    duration: float


ExecChunk = ExecOutput | ExecExit


@dataclass(frozen=True)
class ExecOutcome:
    """A finished command with its output (cut at ``max_output`` bytes per stream, if
    given: ``stdout_truncated`` / ``stderr_truncated`` say so)."""

    stdout: bytes
    stderr: bytes
    exit_code: int
    signal: int | None
    timed_out: bool
    duration: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False


@dataclass(frozen=True)
class FileStat:
    """A guest file after a write (size, permission bits, sha256 hex digest)."""

    path: str
    size: int
    mode: int
    sha256: str


@dataclass(frozen=True)
class GuestUsage:
    """One reading of a guest's resources (``metrics``, protocol 1.8): CPU time since its
    boot in clock ticks (``cpu_busy`` of ``cpu_total``, over ``cpu_count`` CPUs: CPU use
    is the busy share of the ticks between two readings), memory and root disk in bytes,
    and the guest's wall clock (``time``)."""

    time: float
    cpu_count: int
    cpu_busy: int
    cpu_total: int
    mem_total: int
    mem_used: int
    mem_cache: int
    disk_total: int
    disk_used: int


_Msg = dict[str, Any]
# Each pending request has a queue of messages; None means "the connection is gone".
_Queue = asyncio.Queue[_Msg | None]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(msg: _Msg) -> bytes:
    text = msg.get("data")
    if not text:
        return b""
    try:
        return base64.b64decode(text)
    except (ValueError, TypeError) as exc:
        raise MachineFailed(f"agent sent corrupt data: {exc}") from exc


async def _chunks(data: bytes | AsyncIterable[bytes], size: int) -> AsyncGenerator[bytes, None]:
    """``data`` cut into pieces of at most ``size`` bytes (empty pieces skipped)."""
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        for i in range(0, len(view), size):
            yield bytes(view[i : i + size])
        return
    pending = bytearray()
    async for piece in data:
        pending += piece
        while len(pending) >= size:
            yield bytes(pending[:size])
            del pending[:size]
    if pending:
        yield bytes(pending)


async def connect_watched(
    connect: Awaitable[AgentClient], alive: Callable[[], bool],
    failed: Callable[[], MachineFailed], poll: float = 0.2,
) -> AgentClient:
    """Await an agent connection while watching its VM process: a VM that dies
    meanwhile fails fast with ``failed()`` instead of at the connect's timeout, and a
    connect that fails because the VM died says so (``failed()``) too.

    Raises:
        MachineFailed: the VM died, or its agent did not answer.
    """
    task = asyncio.ensure_future(connect)
    while not task.done():
        await asyncio.wait({task}, timeout=poll)
        if not task.done() and not alive():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise failed()
    try:
        return task.result()
    except MachineFailed:
        if not alive():
            raise failed() from None
        raise


async def dial_guest_port(
    machine_id: str, agent: Awaitable[AgentClient], port: int, *, tree: str = GUEST_TREE,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a machine's guest ``port`` through its agent (`AgentClient.dial`),
    for an engine's ``open_http``: an agent that does not answer is an `OSError`, as a
    connection that cannot be made is.

    Args:
        machine_id: the machine, for the error's message.
        agent: its agent connection, as the engine opens it.
        port: the guest's TCP port.
        tree: where the guest's agent tree is.

    Raises:
        OSError: the agent does not answer, or the dial failed (see `AgentClient.dial`).
    """
    try:
        client = await agent
    except BoxdError as exc:
        raise OSError(f"machine {machine_id}'s agent does not answer: {exc}") from exc
    return await client.dial(port, tree=tree)


def _agent_error(msg: _Msg) -> BoxdError:
    """The error an agent's ``error`` event stands for."""
    code = str(msg.get("code", ""))
    text = str(msg.get("message") or code or "guest agent error")
    path = msg.get("path")
    if code == P.ERR_NOT_FOUND and path is not None:
        return GuestFileNotFound(text, path=path)
    if code == P.ERR_INTERNAL:
        return InternalError(f"guest agent: {text}")
    if code == P.ERR_VERSION:
        return HostSetupError(text, hint="rebuild the guest image with this version of boxd")
    details: dict[str, Any] = {"field": "path"} if path is not None else {}
    if path is not None:
        details["path"] = path
    if isinstance(msg.get("field"), str):
        details["field"] = msg["field"]  # the request field the agent rejected
    details["errno"] = code
    return InvalidRequest(text, **details)


def _exec_fields(
    command: str | list[str],
    env: Mapping[str, str | None] | None,
    cwd: str | None,
    timeout: float | None,
    user: str | None = None,
) -> _Msg:
    """The fields of an ``exec`` request common to `AgentClient.exec` and ``start``."""
    fields: _Msg = {"cmd": command}
    if user:
        fields["user"] = user
    if env:
        fields["env"] = dict(env)
    if cwd is not None:
        fields["cwd"] = cwd
    if timeout is not None:
        fields["timeout"] = timeout
    return fields


def _window(supports: Callable[[int], bool]) -> int:
    """The flow-control window to ask for (0 with an agent older than 1.3)."""
    return P.DEFAULT_WINDOW if supports(WINDOW_MINOR) else 0


class AgentClient:
    """An asyncio connection to one machine's guest agent.

    Safe for many concurrent requests. Build one with `AgentClient.connect`.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        socket_path: Path,
    ) -> None:
        self._path = socket_path
        self._channel = _Channel(reader, writer, socket_path)
        self._nonce = secrets.token_hex(8)
        self._execs = _ExecSessions(self._channel, self.supports)
        self._files = _FileTransfer(self._channel, self.supports)
        self.agent_version = ""
        self.agent_pid = 0
        self.agent_started = 0.0

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(cls, socket_path: Path, *, timeout: float) -> AgentClient:
        """Connect to the agent socket and handshake, retrying until the agent answers.

        Args:
            socket_path: QEMU's unix socket for the ``boxd.agent`` port.
            timeout: seconds to keep trying.

        Raises:
            MachineFailed: nothing answered within ``timeout``.
            HostSetupError: the agent speaks an incompatible protocol major version.
        """
        deadline = time.monotonic() + timeout
        last = "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MachineFailed(
                    f"guest agent at {socket_path} did not answer within {timeout:g}s ({last})",
                    hint="the machine may still be booting, or its agent crashed (see its console)",
                )
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(str(socket_path), limit=P.MAX_LINE),
                    timeout=remaining,
                )
            except (OSError, TimeoutError) as exc:
                last = f"cannot connect: {exc}"
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            client = cls(reader, writer, socket_path)
            try:
                await client._hello(deadline)
            except MachineFailed as exc:
                last = exc.message
                await client.close()
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            except BaseException:
                await client.close()
                raise
            return client

    @classmethod
    async def over(
        cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: Path, *,
        timeout: float,
    ) -> AgentClient:
        """Handshake over an already open stream (gVisor: the sandbox's stdio FIFOs).

        Args:
            reader, writer: the stream; the client owns it from now on.
            name: what log lines call the connection.
            timeout: seconds to keep re-sending hello.

        Raises:
            MachineFailed: the agent did not answer within ``timeout``.
            HostSetupError: the agent speaks an incompatible protocol major version.
        """
        client = cls(reader, writer, name)
        try:
            await client._hello(time.monotonic() + timeout)
        except BaseException:
            await client.close()
            raise
        return client

    async def _hello(self, deadline: float) -> None:
        # All hellos of this connection share one queue: the first answer wins, late ones are
        # harmless (same nonce, so the agent does not treat them as a new connection).
        channel = self._channel
        q: _Queue = asyncio.Queue()
        ids: list[int] = []
        try:
            # A leading newline ends any partial line left in the channel by a previous host.
            await channel.send_raw(b"\n")
            while True:
                req_id, _, msg = channel.open(
                    P.OP_HELLO, q, version=P.PROTOCOL_VERSION, nonce=self._nonce)
                ids.append(req_id)
                await channel.send(msg)
                wait = min(HELLO_RETRY, deadline - time.monotonic())
                if wait <= 0:
                    raise MachineFailed("guest agent did not answer hello")
                try:
                    reply = await asyncio.wait_for(q.get(), timeout=wait)
                except TimeoutError:
                    continue
                if reply is None:
                    raise MachineFailed(
                        f"agent connection closed during hello ({channel.failure})")
                self._greeted(reply)
                return
        finally:
            for req_id in ids:
                channel.forget(req_id)

    def _greeted(self, msg: _Msg) -> None:
        """Take the agent's answer to hello: its version, pid and start time.

        Raises:
            HostSetupError: it speaks another protocol major version.
        """
        if msg.get("ev") == P.EV_ERROR:
            if msg.get("code") == P.ERR_VERSION:
                raise HostSetupError(
                    f"guest agent protocol mismatch: {msg.get('message')}",
                    hint="rebuild the guest image with this version of boxd",
                )
            raise _agent_error(msg)
        version = str(msg.get("version", ""))
        if version.split(".", 1)[0] != str(P.PROTOCOL_MAJOR):
            raise HostSetupError(
                f"guest agent speaks protocol {version}, boxd speaks {P.PROTOCOL_VERSION}",
                hint="rebuild the guest image with this version of boxd",
            )
        self.agent_version = version
        self.agent_pid = int(msg.get("pid", 0))
        self.agent_started = float(msg.get("started", 0.0))

    @property
    def connected(self) -> bool:
        """True until the connection is closed or lost."""
        return not self._channel.closed

    async def close(self) -> None:
        """Close the connection; pending requests fail with `MachineFailed`."""
        await self._channel.close()

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ operations

    async def ping(self) -> float:
        """Round trip to the agent, in seconds.

        Raises:
            MachineFailed: the agent did not answer.
        """
        start = time.perf_counter()
        await self._channel.call(P.OP_PING)
        return time.perf_counter() - start

    def nudge(self) -> None:
        """Send a ping and do not wait for it: it only wakes the guest agent's loop (its
        answer is dropped as stale if it ever comes). Nothing on a closed connection."""
        if not self._channel.closed:
            self._channel.fire_and_forget(P.OP_PING)

    async def exec(
        self,
        command: str | list[str],
        *,
        env: Mapping[str, str | None] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        user: str | None = None,
    ) -> AsyncIterator[ExecChunk]:
        """Run a command, yielding its output as it arrives, then one `ExecExit`.

        ``command`` is a shell string (``/bin/sh -c``) or an argv list. ``env`` is merged
        over the agent's default environment (a None value unsets a variable). Closing or
        cancelling the iterator early kills the command's process group in the guest; use
        ``contextlib.aclosing`` when breaking out of the loop.

        Raises:
            MachineFailed: the connection was lost.
            GuestFileNotFound: ``cwd`` does not exist.
            InvalidRequest: the agent rejected the request.
        """
        fields = _exec_fields(command, env, cwd, timeout, self._user(user))
        if stdin is not None:
            fields["stdin"] = _b64(stdin)
        async with contextlib.aclosing(self._execs.events(fields)) as events:
            async for item in events:
                yield item

    async def start(
        self,
        command: str | list[str],
        *,
        env: Mapping[str, str | None] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        user: str | None = None,
        pty: tuple[int, int] | None = None,
    ) -> ExecProcess:
        """Start a long-lived command whose stdin stays open (e.g. a warm worker).

        With ``pty`` (``(rows, cols)``, protocol 1.7) it runs on a new terminal of that
        size: its output (stdout and stderr alike) is the terminal's, as ``stdout``
        chunks, its stdin the terminal's input; `ExecProcess.resize` changes the size.

        Feed it with `ExecProcess.write` / `ExecProcess.close_stdin` and iterate the
        `ExecProcess` for its output and exit, exactly as with `exec`. Returns once the
        agent has started it: a command that cannot start is an error here, not an exit
        status later. Its output is flow-controlled (protocol 1.3): the agent stays at
        most a window ahead of the iteration, so a slow consumer holds the command,
        not this process's memory.

        Raises:
            MachineFailed: the connection was lost, or the agent did not answer.
            GuestFileNotFound: ``cwd`` does not exist, or the program (exit status 127).
            InvalidRequest: the agent rejected the request, or the program cannot be
                executed (exit status 126).
        """
        fields = _exec_fields(command, env, cwd, timeout, self._user(user))
        if pty is not None:
            if not self.supports(PTY_MINOR):
                raise InvalidRequest(
                    f"this machine's agent ({self.agent_version}) cannot run a command "
                    "on a pty", field="pty",
                    hint="create the machine again (its agent is older than this boxd)")
            fields["pty"] = {"rows": pty[0], "cols": pty[1]}
        return await self._execs.start(fields)

    async def run(
        self,
        command: str | list[str],
        *,
        env: Mapping[str, str | None] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        max_output: int | None = None,
        user: str | None = None,
    ) -> ExecOutcome:
        """Run a command to completion and return its buffered output.

        A timeout is reported in the outcome (``timed_out``), not raised. With
        ``max_output``, each stream keeps its first ``max_output`` bytes and the rest is
        read and dropped (the command still runs to its end); the outcome's
        ``stdout_truncated`` / ``stderr_truncated`` say when that happened.

        Raises:
            MachineFailed: the connection was lost.
            GuestFileNotFound: ``cwd`` does not exist.
            InvalidRequest: the agent rejected the request.
        """
        kept: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        size = {"stdout": 0, "stderr": 0}
        cut = {"stdout": False, "stderr": False}
        result: ExecExit | None = None
        async for item in self.exec(command, env=env, cwd=cwd, timeout=timeout, stdin=stdin,
                                    user=user):
            if isinstance(item, ExecExit):
                result = item
                continue
            data = item.data
            if max_output is not None and size[item.stream] + len(data) > max_output:
                data = data[: max(0, max_output - size[item.stream])]
                cut[item.stream] = True
            if data:
                kept[item.stream].append(data)
                size[item.stream] += len(data)
        if result is None:  # pragma: no cover - exec() always ends with an exit or raises
            raise MachineFailed("exec ended without an exit status")
        return ExecOutcome(
            stdout=b"".join(kept["stdout"]),
            stderr=b"".join(kept["stderr"]),
            exit_code=result.exit_code,
            signal=result.signal,
            timed_out=result.timed_out,
            duration=result.duration,
            stdout_truncated=cut["stdout"],
            stderr_truncated=cut["stderr"],
        )

    async def dial(
        self, port: int, tree: str = GUEST_TREE
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to the guest's ``127.0.0.1:port``, for a machine URL: a
        dialer in the guest (``TREE/boxd-init --dial PORT``, or ``TREE/agent.py --dial
        PORT`` where boxd-init is not there) connects and relays the socket to its
        stdin and stdout; the returned streams are one end of a local socket pair
        bridged to it. The dialer says ``+`` once connected. Bytes are flow-controlled
        both ways (the exec window; a write waits for the agent).

        Raises:
            ConnectionRefusedError: nothing in the guest answers on ``port``.
            OSError: the dialer could not start, or the connection was lost.
        """
        proc = await _start_dialer(self.start, port, tree)
        events = aiter(proc)
        leftover = await _dialer_connected(proc, events, port)
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=ours)
        self._channel.spawn(_bridge(theirs, proc, events, leftover))
        return reader, writer

    async def write_file(
        self, path: str, data: bytes | AsyncIterable[bytes], mode: int = 0o644,
        user: str | None = None,
    ) -> FileStat:
        """Write ``data`` to ``path`` in the guest atomically (temp file, fsync, rename).

        ``data`` is bytes or an async iterable of chunks (streamed: at most a chunk or
        two are held here, the socket's back-pressure paces the source). Parent
        directories are created. The agent's sha256 is checked against ours. With
        ``user`` (1.9) the file and the parents it makes belong to that user.

        Raises:
            InvalidRequest: the path is a directory, not absolute, or not writable; a
                ``user`` the guest does not have, or an agent older than 1.9 (which
                would ignore it): field ``user``, refused before any of ``data`` is read.
            IntegrityError: the guest's copy does not match.
            MachineFailed: the connection was lost.
        """
        if user and not self.supports(WRITE_USER_MINOR):
            raise InvalidRequest(
                f"this machine's agent ({self.agent_version}) cannot give a file an owner "
                f"({user!r})", field="user",
                hint="create the machine again (its agent is older than this boxd)")
        return await self._files.write(path, data, mode, user or None)

    async def read_file(self, path: str) -> bytes:
        """Read a whole guest file, verified by sha256.

        Raises:
            GuestFileNotFound: no such file.
            InvalidRequest: the path is a directory, a device or fifo, or not readable.
            IntegrityError: the data does not match the agent's digest.
            MachineFailed: the connection was lost.
        """
        parts = [chunk async for chunk in self.read_stream(path)]
        return b"".join(parts)

    def read_stream(self, path: str) -> AsyncGenerator[bytes, None]:
        """Read a guest file chunk by chunk, as the consumer takes them.

        The agent stays at most a window (8 MiB) ahead of the consumer; closing the
        iterator early stops the read in the guest. The digest is checked at the end:
        a corrupted transfer raises after the last chunk, so a consumer writing a file
        must not trust it until the iterator finished.

        Raises:
            GuestFileNotFound: no such file.
            InvalidRequest: the path is a directory, a device or fifo, or not readable.
            IntegrityError: the data does not match the agent's digest.
            MachineFailed: the connection was lost.
        """
        return self._files.read(path)

    async def stat(self, path: str) -> dict[str, Any]:
        """``lstat`` a guest path: type ("file", "dir", "symlink", "other"), size, mode, mtime.

        Raises:
            GuestFileNotFound: no such path.
            InvalidRequest: the path is not absolute or not accessible.
            MachineFailed: the connection was lost.
        """
        reply = await self._channel.call(P.OP_STAT, path=path)
        return {k: v for k, v in reply.items() if k not in ("id", "ev")}

    async def identity(self, *, hostname: str, machine_id: str, seed: bytes, now: float,
                       api_key: str | None = None) -> None:
        """Give the machine a new identity (after a fork or restore).

        Sets the hostname, /etc/machine-id (32 lowercase hex digits), mixes ``seed`` into
        (and credits) the kernel RNG and sets the wall clock to ``now``; writes ``api_key``
        to ``/run/boxd/key`` (1.5 agents; older ones ignore it). No user-space process is
        touched.

        Raises:
            InvalidRequest: a bad value, or the agent lacks the privilege.
            MachineFailed: the connection was lost.
        """
        extra: dict[str, Any] = {"api_key": api_key} if api_key is not None else {}
        await self._channel.call(
            P.OP_IDENTITY, hostname=hostname, machine_id=machine_id, seed=_b64(seed), now=now,
            **extra,
        )

    async def set_api_key(self, api_key: str) -> None:
        """Write the machine's in-guest API credential (``identity`` with only that field:
        answered by boxd-init, no Python in the guest). No-op on agents before 1.5.

        Raises:
            InvalidRequest: a bad key. MachineFailed: the connection was lost.
        """
        if self.supports(RELAY_MINOR):
            await self._channel.call(P.OP_IDENTITY, api_key=api_key)

    async def clock(self, now: float) -> None:
        """Step the guest's wall clock to ``now`` (after a wake); nothing else changes.

        Raises:
            InvalidRequest: a bad value, or the agent lacks the privilege.
            MachineFailed: the connection was lost.
        """
        await self._channel.call(P.OP_IDENTITY, now=now)

    async def sync(self, timeout: float = 60.0) -> None:
        """Write the guest's dirty page cache to its disk (``sync(2)``).

        Agents from protocol 1.1 do it themselves; older ones run the ``sync`` command.

        Raises:
            MachineFailed: the connection was lost or the guest did not finish in time.
        """
        minor = self.agent_version.partition(".")[2]
        if minor.isdigit() and int(minor) >= 1:
            await self._channel.call(P.OP_SYNC, timeout=timeout)
        else:
            await self.run(["sync"], timeout=timeout)

    async def metrics(self) -> GuestUsage:
        """The guest's CPU counters, memory and root disk use now (one agent round trip,
        answered by agent.py without starting a process).

        Raises:
            InvalidRequest: the agent is older than protocol 1.8.
            MachineFailed: the connection was lost.
        """
        if not self.supports(METRICS_MINOR):
            raise InvalidRequest(
                f"this machine's agent ({self.agent_version}) does not report metrics",
                hint="create the machine again (its agent is older than this boxd)")
        reply = await self._channel.call(P.OP_METRICS, timeout=10.0)
        try:
            return GuestUsage(**{f: reply[f] for f in GuestUsage.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise MachineFailed(f"the guest agent sent a malformed metrics reply: {exc}",
                                hint="the guest agent is not boxd's") from exc

    async def kill(self, exec_id: int, signal: int = 9) -> bool:
        """Signal the process group of a running exec; False when it already finished."""
        return await self._execs.kill(exec_id, signal)

    def _user(self, user: str | None) -> str | None:
        """``user`` if the agent can run a command as it.

        Raises:
            InvalidRequest: it cannot (an agent older than 1.6, which would run as root).
        """
        if user and not self.supports(USER_MINOR):
            raise InvalidRequest(
                f"this machine's agent ({self.agent_version}) cannot run a command as "
                f"another user ({user!r})", field="user",
                hint="create the machine again (its agent is older than this boxd)")
        return user

    def supports(self, minor: int) -> bool:
        """True when the agent speaks at least protocol ``1.minor``."""
        m = self.agent_version.partition(".")[2]
        return m.isdigit() and int(m) >= minor

    async def attach(self, exec_id: int) -> ExecProcess:
        """Follow a running exec of the guest on this connection (after a fork, restore
        or reconnect): its output from now on, its stdin, its exit.

        Raises:
            InvalidRequest: no such running exec (``errno`` ESRCH), or an agent too old
                to re-attach.
            MachineFailed: the connection was lost.
        """
        if not self.supports(ATTACH_MINOR):
            raise InvalidRequest(
                f"the guest agent (protocol {self.agent_version}) cannot re-attach a process",
                hint="boot the machine from an image built by this version of boxd")
        return await self._execs.attach(exec_id)

    async def serve_relay(
        self, key: str, on_stream: Callable[[GuestStream], Awaitable[None]], *,
        streams: dict[int, GuestStream] | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        """Serve the guest's API socket (``/run/boxd/boxd.sock``) until this connection ends.

        The agent writes ``key`` to ``/run/boxd/key`` (tmpfs). Each guest connection
        becomes a `GuestStream` in ``streams`` (keyed by the guest's stream id), handed to
        ``on_stream`` in a task of its own that outlives this connection. Streams already
        in ``streams`` (the same guest under a new VM process: a RAM swap) move to this
        connection; without any, the agent ends those of an earlier relay (a fork
        child's or a restored guest's copies of calls in flight). ``on_started`` is
        called once the agent serves the socket. When the connection is lost the streams
        stay in ``streams``, waiting (`GuestStream.orphan`); the caller moves them to the
        next relay or ends them (`GuestStream.end`). At most `MAX_GUEST_STREAMS` are
        open at once: a guest connection past it is closed at once.

        Raises:
            InvalidRequest: the agent is too old (protocol < 1.5) or refused the key.
        """
        if not self.supports(RELAY_MINOR):
            raise InvalidRequest(
                f"the guest agent (protocol {self.agent_version}) has no API socket",
                hint="boot the machine from an image built by this version of boxd")
        relay = _RelayServer(self, self._channel, {} if streams is None else streams, on_stream)
        await relay.serve(key, on_started)

    def on_guest_connect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when a guest process connects to the API socket while this
        connection does not serve it yet (at once if one did already)."""
        self._channel.strays.watch(callback)

    async def _relay_send(self, relay_id: int, stream_id: int, **fields: Any) -> None:
        """Send on guest stream ``stream_id`` of relay ``relay_id`` (data, EOF or close)."""
        await self._channel.send(
            {"id": relay_id, "op": P.OP_RELAY_SEND, "stream": stream_id, **fields})

    def __repr__(self) -> str:
        state = "connected" if self.connected else f"closed ({self._channel.failure})"
        return f"<AgentClient {os.fspath(self._path)} {state}>"


# ---------------------------------------------------------------------- the connection


class _StrayRelay:
    """Relay events under an id the connection does not know: a guest process that
    connected before this connection served the API socket (a fresh fork child or a
    restored guest). `_RelayServer` takes them over; at most `_STRAY_MAX` are kept
    (oldest dropped)."""

    def __init__(self) -> None:
        self._events: list[_Msg] = []
        self._watcher: Callable[[], None] | None = None

    def add(self, msg: _Msg) -> None:
        self._events.append(msg)
        del self._events[:-_STRAY_MAX]
        if self._watcher is not None:
            self._watcher()

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on each one that comes (at once if one came already)."""
        self._watcher = callback
        if self._events:
            callback()

    def opened(self) -> set[int]:
        """The guest streams they open."""
        return {m["stream"] for m in self._events
                if m.get("ev") == P.EV_RELAY_OPEN and isinstance(m.get("stream"), int)}

    def take(self, streams: set[int]) -> list[_Msg | None]:
        """Those of ``streams``, in order of arrival; all others are dropped."""
        taken: list[_Msg | None] = [m for m in self._events if m.get("stream") in streams]
        self._events.clear()
        return taken


class _Channel:
    """The connection under an `AgentClient`: a JSON object a line each way, requests
    multiplexed by id.

    Each request has a queue; a reader task routes every message to its request's queue
    (None in each when the connection is gone). Replies under an id it does not know
    (stale answers from before a fork, restore or reconnect) are dropped; relay events
    under one are kept in `strays`.
    """

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: Path
    ) -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        # Ids start at a random point so a stale reply to another connection's request
        # (answered by a forked or restored guest) cannot match one of ours.
        self._next_id = secrets.randbelow(1 << 40) + 1
        self._pending: dict[int, _Queue] = {}
        self._write_lock = asyncio.Lock()
        self.closed = False
        self.failure = ""
        self._tasks: set[asyncio.Task[Any]] = set()
        self.strays = _StrayRelay()
        self._read_task = asyncio.create_task(self._read_loop(), name=f"agent-reader {name}")

    # Requests.

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def open(self, op: str, q: _Queue | None = None, /, **fields: Any) -> tuple[int, _Queue, _Msg]:
        """A new request: its id, the queue its replies come to (``q``, or a new one) and
        the message to send.

        Raises:
            MachineFailed: the connection is closed.
        """
        if self.closed:
            raise AgentLost(f"agent connection is closed ({self.failure})")
        req_id = self._new_id()
        q = asyncio.Queue() if q is None else q
        self._pending[req_id] = q
        return req_id, q, {"id": req_id, "op": op, **fields}

    def forget(self, req_id: int) -> None:
        """No more replies for ``req_id`` (it ended, or nobody waits for them any more)."""
        self._pending.pop(req_id, None)

    def waiting(self, req_id: int) -> bool:
        """True while replies for ``req_id`` are expected."""
        return req_id in self._pending

    def requeue(self, req_id: int, q: _Queue, early: list[_Msg]) -> _Queue:
        """The queue of request ``req_id`` with ``early`` (replies that overtook the one
        awaited) ahead of what ``q`` holds, in order; ``q`` itself when there are none."""
        if not early:
            return q
        fresh: _Queue = asyncio.Queue()
        for m in early:
            fresh.put_nowait(m)
        while not q.empty():
            fresh.put_nowait(q.get_nowait())
        self._pending[req_id] = fresh
        return fresh

    async def next(self, q: _Queue, timeout: float | None, what: str) -> _Msg:
        """The next reply in ``q``.

        Raises:
            MachineFailed: none within ``timeout``, or the connection was lost.
        """
        try:
            msg = await asyncio.wait_for(q.get(), timeout=timeout)
        except TimeoutError:
            raise MachineFailed(
                f"guest agent did not answer {what} within {timeout:g}s",
                hint="the machine may be overloaded or hung",
            ) from None
        if msg is None:
            raise AgentLost(f"lost the agent connection during {what} ({self.failure})")
        return msg

    async def send_raw(self, data: bytes) -> None:
        if self.closed:
            raise AgentLost(f"agent connection is closed ({self.failure})")
        try:
            async with self._write_lock:
                self._writer.write(data)
                await self._writer.drain()
        except (OSError, RuntimeError) as exc:
            self.fail_all(f"agent connection lost: {exc}")
            raise AgentLost(f"agent connection lost: {exc}") from exc

    async def send(self, msg: _Msg) -> None:
        await self.send_raw(json.dumps(msg, separators=(",", ":")).encode() + b"\n")

    async def call(self, op: str, timeout: float = REQUEST_TIMEOUT, **fields: Any) -> _Msg:
        """One request and its one reply.

        Raises:
            MachineFailed: no reply within ``timeout``, or the connection was lost.
            BoxdError: the agent's error (see `_agent_error`).
        """
        req_id, q, msg = self.open(op, **fields)
        try:
            await self.send(msg)
            reply = await self.next(q, timeout, op)
        finally:
            self.forget(req_id)
        if reply.get("ev") == P.EV_ERROR:
            raise _agent_error(reply)
        return reply

    async def ack(self, req: int, total: int) -> None:
        """Tell the agent ``total`` bytes of request ``req``'s output were consumed.

        Its answer is not awaited (it arrives under an id nobody waits for and is
        dropped): an ack only lets the agent send more.
        """
        await self.send({"id": self._new_id(), "op": P.OP_ACK, "req": req, "bytes": total})

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in a task of this connection's (cancelled when it is closed)."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def fire_and_forget(self, op: str, **fields: Any) -> None:
        """Send a request in the background (from cleanup paths); errors are only logged."""
        self.spawn(self._quiet(op, **fields))

    async def _quiet(self, op: str, **fields: Any) -> None:
        try:
            await self.call(op, timeout=10.0, **fields)
        except BoxdError as exc:
            log.debug("agent %s: %s failed: %s", self.name, op, exc)

    # The end.

    def fail_all(self, reason: str) -> None:
        """The connection is gone (``reason``): every request waiting gets None."""
        if not self.closed:
            self.closed = True
            self.failure = reason
        for q in self._pending.values():
            q.put_nowait(None)
        self._pending.clear()

    async def close(self) -> None:
        self.fail_all("connection closed by the host")
        self._read_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(BaseException):
            await self._read_task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    # The reader.

    async def _read_loop(self) -> None:
        reason = "agent closed the connection"
        try:
            while True:
                try:
                    line = await self._reader.readline()
                except ValueError:  # a line longer than the limit: skip what was buffered
                    log.warning("agent %s: oversized line dropped", self.name)
                    continue
                if not line.endswith(b"\n"):
                    break  # EOF (maybe in the middle of a line)
                msg = self._parse(line)
                if msg is not None:
                    self._route(msg)
        except (OSError, asyncio.IncompleteReadError) as exc:
            reason = f"agent connection lost: {exc}"
        finally:
            self.fail_all(reason)

    def _parse(self, line: bytes) -> _Msg | None:
        """The message on ``line``; None for a blank line or one that is not a message."""
        if not line.strip():
            return None
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        if isinstance(msg, dict) and "id" in msg:
            return msg
        # A partial line from before a reconnect/fork; the protocol resyncs at \n.
        log.debug("agent %s: malformed line dropped: %.80r", self.name, line)
        return None

    def _route(self, msg: _Msg) -> None:
        """Hand ``msg`` to its request (which ends with a terminal event)."""
        req_id = msg["id"]
        q = self._pending.get(req_id) if isinstance(req_id, int) else None
        if q is not None:
            q.put_nowait(msg)
            if msg.get("ev") in P.TERMINAL_EVENTS:
                self._pending.pop(req_id, None)
        elif msg.get("ev") in _RELAY_EVENTS:
            self.strays.add(msg)
        else:
            log.debug("agent %s: stale reply for id %r dropped", self.name, req_id)


# ---------------------------------------------------------------------- exec sessions


class _ExecSessions:
    """Commands in the guest, over a `_Channel`: an exec is a request whose events are
    its output, then its exit; the exec's id is its request's. Output is
    flow-controlled where the agent can (1.3); a started command's stdin is streamed
    (unacknowledged from 1.4)."""

    def __init__(self, channel: _Channel, supports: Callable[[int], bool]) -> None:
        self._channel = channel
        self._supports = supports

    def events(self, fields: _Msg) -> AsyncGenerator[ExecChunk, None]:
        """A new exec of ``fields``: its events. Its id is registered now and the request
        sent when they are first iterated, so the caller iterates them at once."""
        window = _window(self._supports)
        if window:
            fields["window"] = window
        req_id, q, msg = self._channel.open(P.OP_EXEC, **fields)
        return self._follow(req_id, q, msg, window)

    async def start(self, fields: _Msg) -> ExecProcess:
        """Start an exec of ``fields`` whose stdin stays open (`AgentClient.start`)."""
        fields["stdin_stream"] = True
        window = _window(self._supports)
        if window:
            fields["window"] = window
        req_id, q, msg = self._channel.open(P.OP_EXEC, **fields)
        try:
            await self._channel.send(msg)
            q = await self._started(req_id, q, fields["cmd"])
        except BaseException:
            self._channel.forget(req_id)
            raise
        return ExecProcess(self, req_id, self._follow(req_id, q, None, window))

    async def _started(self, req_id: int, q: _Queue, command: str | list[str]) -> _Queue:
        """Wait for exec ``req_id``'s ``started`` event; the queue to follow it with.

        Raises the exec's error, or one for a program that could not be executed (the
        agent answers those as a shell would: its message on stderr, then exit status
        127 or 126, without a ``started``).
        """
        early: list[_Msg] = []
        try:
            while True:
                reply = await self._channel.next(q, REQUEST_TIMEOUT, "exec")
                ev = reply.get("ev")
                if ev == P.EV_STARTED:
                    break
                if ev == P.EV_ERROR:
                    raise _agent_error(reply)
                if ev == P.EV_RESULT:
                    raise _cannot_start(command, reply, early)
                early.append(reply)
        except MachineFailed:
            if not self._channel.closed:  # no answer in time: it may run, unfollowed
                self._channel.fire_and_forget(P.OP_KILL, exec_id=req_id, signal=9)
            raise
        # Output overtook the answer: keep it, in order, ahead of what follows.
        return self._channel.requeue(req_id, q, early)

    async def attach(self, exec_id: int) -> ExecProcess:
        """Follow running exec ``exec_id`` (`AgentClient.attach`)."""
        req_id, q, msg = self._channel.open(P.OP_ATTACH, exec_id=exec_id)
        try:
            await self._channel.send(msg)
            first = await self._channel.next(q, REQUEST_TIMEOUT, "attach")
        except BaseException:
            self._channel.forget(req_id)
            raise
        if first.get("ev") == P.EV_ERROR:
            self._channel.forget(req_id)
            raise _agent_error(first)
        # Output that overtook the answer is kept, in order, ahead of what follows.
        early = [] if first.get("ev") == P.EV_STARTED else [first]
        q = self._channel.requeue(req_id, q, early)
        return ExecProcess(self, req_id, self._follow(req_id, q, None))

    async def _follow(
        self, req_id: int, q: _Queue, msg: _Msg | None, window: int = 0
    ) -> AsyncGenerator[ExecChunk, None]:
        """Exec ``req_id``'s output and exit (sending ``msg`` first, if given); closed
        before the exit, it kills the command."""
        finished = False
        consumed = acked = 0
        try:
            if msg is not None:
                await self._channel.send(msg)
            while True:
                # No idle limit: a command may legitimately be silent for a long time. The
                # agent enforces ``timeout``; a lost connection ends the wait.
                reply = await self._channel.next(q, None, "exec")
                ev = reply.get("ev")
                if ev in (P.EV_STDOUT, P.EV_STDERR):
                    data = _unb64(reply)
                    yield ExecOutput("stdout" if ev == P.EV_STDOUT else "stderr", data)
                    # Acknowledge what the consumer took (half a window at a time): the
                    # agent sends at most a window ahead, so a slow consumer holds the
                    # command, not this process's memory.
                    consumed += len(data)
                    if window and consumed - acked >= window // 2:
                        acked = consumed
                        await self._channel.ack(req_id, consumed)
                elif ev == P.EV_RESULT:
                    finished = True
                    yield ExecExit(
                        exit_code=int(reply["exit_code"]),
                        signal=reply.get("signal"),
                        timed_out=bool(reply.get("timed_out")),
                        duration=float(reply.get("duration", 0.0)),
                    )
                    return
                elif ev == P.EV_ERROR:
                    finished = True
                    raise _agent_error(reply)
                # "started" and unknown events (newer minor versions) are skipped.
        finally:
            self._channel.forget(req_id)
            if not finished and not self._channel.closed:
                self._channel.fire_and_forget(P.OP_KILL, exec_id=req_id, signal=9)

    async def stdin(self, exec_id: int, data: bytes, eof: bool) -> None:
        """Bytes (and/or EOF) for a started exec's stdin (`ExecProcess.write`)."""
        if not self._supports(UNACKED_STDIN_MINOR):
            await self._channel.call(P.OP_STDIN, exec_id=exec_id, data=_b64(data), eof=eof)
            return
        # The hot path of a process's stream: no answer to wait for. The request goes
        # under the exec's own id, so an error (the agent cannot take the bytes) ends the
        # exec's events with it; an exec that has ended was seen to end on this side.
        if not self._channel.waiting(exec_id):
            raise InvalidRequest(f"no running exec with id {exec_id}", errno=P.ERR_NO_EXEC)
        await self._channel.send({"id": exec_id, "op": P.OP_STDIN, "exec_id": exec_id,
                                  "data": _b64(data), "eof": eof, "reply": False})

    async def resize(self, exec_id: int, rows: int, cols: int) -> None:
        """A new terminal size for a pty exec (`ExecProcess.resize`)."""
        await self._channel.call(P.OP_RESIZE, exec_id=exec_id,
                                 size={"rows": rows, "cols": cols})

    async def kill(self, exec_id: int, signal: int) -> bool:
        """Signal an exec's process group (`AgentClient.kill`)."""
        try:
            reply = await self._channel.call(P.OP_KILL, exec_id=exec_id, signal=signal)
        except InvalidRequest as exc:
            if exc.details.get("errno") == P.ERR_NO_EXEC:
                return False
            raise
        return bool(reply.get("delivered"))


def _cannot_start(command: str | list[str], result: _Msg, early: list[_Msg]) -> BoxdError:
    """The error for a program the agent could not execute: it answered with the exit
    status ``result`` after ``early`` (its message on stderr)."""
    code = int(result.get("exit_code", 126))
    said = b"".join(_unb64(m) for m in early if m.get("ev") == P.EV_STDERR)
    text = said.decode(errors="replace").strip().removeprefix("boxd-agent: ")
    argv0 = command if isinstance(command, str) else command[0]
    message = f"cannot start {text or argv0} (exit status {code})"
    if code == 127:
        return GuestFileNotFound(message, path=argv0, exit_code=code)
    return InvalidRequest(message, field="argv", exit_code=code)


# ---------------------------------------------------------------------- files


class _FileTransfer:
    """Guest files, over a `_Channel`: a write is one request carrying the file in
    chunks, a read one whose ``data`` events come flow-controlled (1.3); both are checked
    end to end by sha256."""

    def __init__(self, channel: _Channel, supports: Callable[[int], bool]) -> None:
        self._channel = channel
        self._supports = supports

    async def write(
        self, path: str, data: bytes | AsyncIterable[bytes], mode: int, user: str | None
    ) -> FileStat:
        """`AgentClient.write_file`."""
        sha = hashlib.sha256()
        owner: _Msg = {"user": user} if user else {}
        req_id, q, first = self._channel.open(P.OP_WRITE, path=path, mode=mode, **owner)
        try:
            size = await self._send_chunks(req_id, q, first, data, sha)
            reply = await self._channel.next(q, STREAM_IDLE_TIMEOUT, "write")
        finally:
            self._channel.forget(req_id)
        if reply.get("ev") == P.EV_ERROR:
            raise _agent_error(reply)
        return _written(reply, path, size, sha.hexdigest())

    async def _send_chunks(
        self, req_id: int, q: _Queue, first: _Msg, data: bytes | AsyncIterable[bytes],
        sha: hashlib._Hash,
    ) -> int:
        """Send ``data`` as write request ``req_id`` (``first`` its opening message),
        hashing it into ``sha``; the bytes sent. Stops early when the agent answered
        already (an early error)."""
        offset = 0
        async with contextlib.aclosing(_chunks(data, P.FILE_CHUNK)) as chunks:
            chunk = await anext(chunks, b"")
            while True:
                following = await anext(chunks, None) if q.empty() else None
                eof = following is None
                msg: _Msg = first if offset == 0 else {"id": req_id, "op": P.OP_WRITE}
                msg.update(offset=offset, data=_b64(chunk), eof=eof)
                sha.update(chunk)
                await self._channel.send(msg)
                offset += len(chunk)
                if eof or not q.empty():  # an early error: stop sending
                    break
                chunk = following or b""
        return offset

    async def read(self, path: str) -> AsyncGenerator[bytes, None]:
        """`AgentClient.read_stream`."""
        window = _window(self._supports)
        fields: _Msg = {"path": path}
        if window:
            fields["window"] = window
        req_id, q, msg = self._channel.open(P.OP_READ, **fields)
        size = acked = 0
        sha = hashlib.sha256()
        finished = False
        try:
            await self._channel.send(msg)
            while True:
                reply = await self._channel.next(q, STREAM_IDLE_TIMEOUT, "read")
                ev = reply.get("ev")
                if ev == P.EV_DATA:
                    chunk = _unb64(reply)
                    if reply.get("offset") != size:
                        raise IntegrityError(
                            f"guest file {path}: chunk at offset {reply.get('offset')}, "
                            f"expected {size}",
                            path=path,
                        )
                    sha.update(chunk)
                    size += len(chunk)
                    yield chunk
                    if window and size - acked >= window // 2:
                        acked = size
                        await self._channel.ack(req_id, size)
                elif ev == P.EV_ERROR:
                    finished = True
                    raise _agent_error(reply)
                elif ev == P.EV_RESULT:
                    finished = True
                    break
        finally:
            self._channel.forget(req_id)
            if not finished and window and not self._channel.closed:
                # The consumer went away: the guest stops reading the file.
                self._channel.fire_and_forget(P.OP_CANCEL, req=req_id)
        _check_read(reply, path, size, sha.hexdigest())


def _written(reply: _Msg, path: str, size: int, digest: str) -> FileStat:
    """The guest file a write's ``reply`` describes, checked against what was sent.

    Raises:
        IntegrityError: it does not match (``size`` bytes, sha256 ``digest``).
    """
    stat = FileStat(
        path=str(reply.get("path", path)),
        size=int(reply["size"]),
        mode=int(reply["mode"]),
        sha256=str(reply["sha256"]),
    )
    if stat.size != size or stat.sha256 != digest:
        raise IntegrityError(
            f"guest file {path} does not match what was sent "
            f"({stat.size} bytes, sha256 {stat.sha256}; sent {size}, {digest})",
            digest=digest,
            path=path,
        )
    return stat


def _check_read(reply: _Msg, path: str, size: int, digest: str) -> None:
    """Check a read's closing ``reply`` against what arrived (``size`` bytes, sha256
    ``digest``).

    Raises:
        IntegrityError: it does not match.
    """
    if reply.get("size") != size or reply.get("sha256") != digest:
        raise IntegrityError(
            f"guest file {path} arrived corrupted ({size} bytes, sha256 {digest}; "
            f"agent says {reply.get('size')}, {reply.get('sha256')})",
            digest=str(reply.get("sha256")),
            path=path,
        )


# ---------------------------------------------------------------------- the dialer


async def _start_dialer(
    start: Callable[[list[str]], Awaitable[ExecProcess]], port: int, tree: str
) -> ExecProcess:
    """The guest's dialer for ``port`` (`AgentClient.dial`): boxd-init's, or agent.py's
    where boxd-init is not there.

    Raises:
        OSError: neither could start.
    """
    try:
        try:
            return await start([f"{tree}/boxd-init", "--dial", str(port)])
        except GuestFileNotFound:
            return await start(["python3", f"{tree}/agent.py", "--dial", str(port)])
    except BoxdError as exc:
        raise OSError(f"cannot start the guest's dialer: {exc.message}") from exc


async def _dialer_connected(
    proc: ExecProcess, events: AsyncIterator[ExecChunk], port: int
) -> bytes:
    """Wait for the dialer's ``+`` (connected to ``port``); what followed it on its
    stdout. The dialer is ended when it fails.

    Raises:
        ConnectionRefusedError: it exited (nothing answers on ``port``).
        OSError: it said something else, or did not answer.
    """
    said = b""
    try:
        while True:
            ev = await asyncio.wait_for(anext(events), DIAL_TIMEOUT)
            if isinstance(ev, ExecExit):
                text = said.decode(errors="replace").strip() or f"exit {ev.exit_code}"
                raise ConnectionRefusedError(f"guest port {port}: {text}")
            if ev.stream == "stderr":
                said = (said + ev.data)[-1024:]
                continue
            if ev.data[:1] == b"+":
                return ev.data[1:]
            raise OSError(f"guest port {port}: the dialer said {ev.data[:40]!r}")
    except BaseException as exc:
        await proc.aclose()
        if isinstance(exc, (TimeoutError, StopAsyncIteration, MachineFailed)):
            raise OSError(f"guest port {port}: the dialer did not answer ({exc!r})") \
                from exc
        raise


async def _bridge(
    sock: socket.socket, proc: ExecProcess, events: AsyncIterator[ExecChunk], first: bytes
) -> None:
    """Relay one end of a socket pair to a dialer process (`AgentClient.dial`) until
    either side ends: the socket's bytes to its stdin (its EOF as stdin's close), its
    stdout to the socket (its exit as the socket's write EOF). The other end closed
    altogether ends the dialer."""
    loop = asyncio.get_running_loop()

    async def to_guest() -> None:
        with contextlib.suppress(OSError, BoxdError):
            while data := await loop.sock_recv(sock, P.FILE_CHUNK):
                await proc.write(data)
            await proc.close_stdin()
        # Half-closed (the client may still read) or gone: wait until it is gone.
        poller = select.poll()
        poller.register(sock, select.POLLHUP)
        while not poller.poll(0):
            await asyncio.sleep(0.5)

    async def to_host() -> None:
        with contextlib.suppress(OSError, BoxdError):
            if first:
                await loop.sock_sendall(sock, first)
            async for ev in events:
                if isinstance(ev, ExecOutput) and ev.stream == "stdout":
                    await loop.sock_sendall(sock, ev.data)
            sock.shutdown(socket.SHUT_WR)

    tasks = [asyncio.ensure_future(to_guest()), asyncio.ensure_future(to_host())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if not tasks[1].done():  # the host's end is gone: the dialer is not needed
            tasks[1].cancel()
        else:
            await tasks[0]  # the guest's side ended: until the host's end is closed
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await proc.aclose()
        sock.close()



# ---------------------------------------------------------------------- the API socket's relay


class _RelayServer:
    """One `AgentClient.serve_relay`: the agent's ``relay_listen`` request and the guest
    streams its events open, feed and end."""

    def __init__(
        self, client: AgentClient, channel: _Channel, streams: dict[int, GuestStream],
        on_stream: Callable[[GuestStream], Awaitable[None]],
    ) -> None:
        self._client = client
        self._channel = channel
        self._streams = streams
        self._on_stream = on_stream
        self._id = 0  # the relay_listen request's, once it is made

    async def serve(self, key: str, on_started: Callable[[], None] | None) -> None:
        """Listen with ``key`` and serve until the connection ends (`AgentClient.serve_relay`).

        Raises:
            InvalidRequest: the agent refused the key.
        """
        strays = self._channel.strays.opened()
        keep = sorted(set(self._streams) | strays)
        req_id, q, msg = self._channel.open(P.OP_RELAY_LISTEN, key=key, keep=keep)
        self._id = req_id
        for stream in self._streams.values():
            stream._bind(self._client, req_id)
        try:
            await self._channel.send(msg)
            first = await self._channel.next(q, REQUEST_TIMEOUT, "relay_listen")
            if first.get("ev") == P.EV_ERROR:
                raise _agent_error(first)
            if on_started is not None:
                on_started()
            # Guest connections made before: served as if they had come on this relay.
            backlog = self._channel.strays.take(strays)
            while not q.empty():  # what came on this relay since goes after them
                backlog.append(q.get_nowait())
            for m in backlog:
                q.put_nowait(m)
            await self._route(q)
        except MachineFailed:
            return  # the connection is gone; its streams wait for the caller's decision
        finally:
            self._channel.forget(req_id)
            for stream in self._streams.values():
                stream.orphan(self._client)

    async def _route(self, q: _Queue) -> None:
        """Hand each relay event to its stream, until the relay ends."""
        while True:
            event = await q.get()
            if event is None or event.get("ev") in P.TERMINAL_EVENTS:
                return
            sid = event.get("stream")
            if not isinstance(sid, int):
                continue
            if event.get("ev") == P.EV_RELAY_OPEN:
                await self._open(sid)
            elif (stream := self._streams.get(sid)) is not None:
                stream._take(event)

    async def _open(self, sid: int) -> None:
        """A guest connection: its stream, served in a task of its own."""
        streams = self._streams
        if sid not in streams and len(streams) >= MAX_GUEST_STREAMS:
            # Each served stream costs the daemon a task and a connection to its API:
            # past the limit the guest's connection is closed.
            log.warning("agent %s: guest API connection %d refused: %d open (limit %d)",
                        self._channel.name, sid, len(streams), MAX_GUEST_STREAMS)
            await self._client._relay_send(self._id, sid, close=True)
            return
        stream = streams[sid] = GuestStream(self._client, self._id, sid)
        task = asyncio.ensure_future(self._run(stream))
        _STREAM_TASKS.add(task)
        task.add_done_callback(_STREAM_TASKS.discard)

    async def _run(self, stream: GuestStream) -> None:
        try:
            await self._on_stream(stream)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("agent %s: guest API stream %d failed", self._channel.name, stream.id)
        finally:
            if self._streams.get(stream.id) is stream:
                del self._streams[stream.id]
            await stream.close()


class GuestStream:
    """One guest process's connection to the in-guest API socket (`AgentClient.serve_relay`).

    `read` returns ``b""`` once the guest side shut down its sending half or the stream
    ended; `write` and `close` after that are ignored. While its agent connection is
    replaced (a RAM swap), writes wait for the next one (up to `STREAM_MOVE_WAIT`).
    """

    def __init__(self, client: AgentClient, relay_id: int, stream_id: int) -> None:
        self._client = client
        self._relay_id = relay_id
        self.id = stream_id
        self._incoming: asyncio.Queue[bytes] = asyncio.Queue()
        self._bound = asyncio.Event()
        self._bound.set()
        self._eof = False
        self._closed = False

    def _bind(self, client: AgentClient, relay_id: int) -> None:
        self._client, self._relay_id = client, relay_id
        self._bound.set()

    def orphan(self, client: AgentClient) -> None:
        """Its connection ``client`` is gone: wait for the next (unless moved already)."""
        if self._client is client:
            self._bound.clear()

    def end(self) -> None:
        """End it without a word to the guest (its connection is gone for good)."""
        self._closed = True
        self._bound.set()
        self._incoming.put_nowait(b"")

    def _take(self, event: _Msg) -> None:
        """A relay event of this stream's: bytes from the guest, or its EOF.

        Raises:
            MachineFailed: the agent sent corrupt data.
        """
        if event.get("ev") == P.EV_RELAY_DATA:
            self._incoming.put_nowait(_unb64(event))
        elif event.get("ev") == P.EV_RELAY_EOF:
            self._incoming.put_nowait(b"")

    async def _send(self, **fields: Any) -> None:
        while not self._closed:
            if not self._bound.is_set():
                try:
                    await asyncio.wait_for(self._bound.wait(), STREAM_MOVE_WAIT)
                except TimeoutError:
                    self.end()
                    return
                continue
            client = self._client
            try:
                await client._relay_send(self._relay_id, self.id, **fields)
                return
            except MachineFailed:
                self.orphan(client)

    async def read(self) -> bytes:
        """The next bytes the guest sent; ``b""`` at its end."""
        if self._eof:
            return b""
        data = await self._incoming.get()
        if not data:
            self._eof = True
        return data

    async def write(self, data: bytes) -> None:
        """Send bytes to the guest process (in chunks the agent channel carries well)."""
        for i in range(0, len(data), P.EXEC_CHUNK):
            await self._send(data=_b64(data[i:i + P.EXEC_CHUNK]))

    async def write_eof(self) -> None:
        """Shut down the guest process's reading half."""
        await self._send(eof=True)

    async def close(self) -> None:
        """End the stream on both sides."""
        if not self._closed:
            if self._bound.is_set():
                with contextlib.suppress(MachineFailed):
                    await self._client._relay_send(self._relay_id, self.id, close=True)
            self.end()


class ExecProcess:
    """A running command started with `AgentClient.start`: streamed stdin, output, exit.

    Iterate it (once) for `ExecOutput` chunks and the final `ExecExit`. Closing the
    iterator before the exit kills the command.
    """

    def __init__(
        self, sessions: _ExecSessions, exec_id: int, events: AsyncGenerator[ExecChunk, None]
    ) -> None:
        self._sessions = sessions
        self.exec_id = exec_id
        self._events = events

    def __aiter__(self) -> AsyncIterator[ExecChunk]:
        return self._events

    async def write(self, data: bytes) -> None:
        """Send bytes to the command's stdin.

        Raises:
            InvalidRequest: the command has already finished.
            MachineFailed: the connection was lost.
        """
        for i in range(0, len(data), P.FILE_CHUNK):
            await self._sessions.stdin(self.exec_id, data[i : i + P.FILE_CHUNK], False)

    async def close_stdin(self) -> None:
        """Close the command's stdin (it reads EOF).

        Raises:
            InvalidRequest: the command has already finished.
            MachineFailed: the connection was lost.
        """
        await self._sessions.stdin(self.exec_id, b"", True)

    async def resize(self, rows: int, cols: int) -> None:
        """Resize the terminal of a command started with ``pty``.

        Raises:
            InvalidRequest: it has finished, or does not run on a pty.
            MachineFailed: the connection was lost.
        """
        await self._sessions.resize(self.exec_id, rows, cols)

    async def kill(self, signal: int = 9) -> bool:
        """Signal the command's process group; False when it already finished."""
        return await self._sessions.kill(self.exec_id, signal)

    async def aclose(self) -> None:
        """Stop following the output; kills the command if it still runs."""
        await self._events.aclose()
