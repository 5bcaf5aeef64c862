"""The service contracts the API serves: Protocols owned below the API.

``boxd.control`` implements them on real machines; the API's routes code against
exactly these signatures and its unit tests against in-memory fakes. ``account`` is
the id of the account that owns the resource; a machine ``ref`` is a name or id and a
snapshot ``ref`` is ``NAME`` (latest version), ``NAME@N`` or ``sha256:DIGEST``. No
HTTP types here.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from boxd import models
from boxd import process_models as pm

HostInfoFn = Callable[[], models.HostInfo | Awaitable[models.HostInfo]]


class ByteStream(Protocol):
    """A two-way byte stream (a guest process's connection to its in-guest API socket)."""

    async def read(self) -> bytes:
        """The next bytes; ``b""`` at the end."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class GuestCaller:
    """Who is on the other end of a relayed in-guest API connection (docs/lifecycle.md).

    ``key_hash()`` is the sha256 of the one credential such a connection accepts, the
    machine's current one (None once the machine is deleted or has no VM).
    """

    machine_id: str
    account_id: str
    key_hash: Callable[[], str | None]


GuestApi = Callable[[GuestCaller, ByteStream], Awaitable[None]]
"""Serves one relayed in-guest API connection (the daemon's HTTP app behind it)."""


class MachineService(Protocol):
    """Create, inspect, run commands in, fork, checkpoint and delete machines."""

    async def nodes_list(self) -> list[models.NodeInfo]:
        """The nodes machines run on (one on a single host; each Ray node of a cluster)."""
        ...

    def queue(self, account: str) -> models.AdmissionQueue:
        """The account's creates and forks waiting for room (``wait``)."""
        ...

    async def create(
        self, account: str, req: models.MachineCreate, idempotency_key: str | None = None,
    ) -> models.Machine:
        """Create and boot a machine; returns once the QEMU process runs (state starting).
        A retry with the same ``idempotency_key`` returns the first request's machine.

        Raises:
            InvalidRequest, AlreadyExists, QuotaExceeded, SnapshotNotFound, HostSetupError;
            IdempotencyKeyReused: the key named another request.
        """
        ...

    async def get(self, account: str, ref: str) -> models.Machine:
        """Raises: MachineNotFound."""
        ...

    async def list(self, account: str) -> list[models.Machine]:
        ...

    async def list_page(
        self, account: str, *, labels: Mapping[str, str] | None = None,
        state: models.MachineState | None = None, limit: int = models.DEFAULT_LIST_LIMIT,
        cursor: str | None = None,
    ) -> models.MachineList:
        """One page of the machines carrying every label of ``labels`` (in ``state``),
        oldest first, after ``cursor`` (a page's ``next_cursor``).
        Raises: InvalidRequest (labels, limit, cursor)."""
        ...

    async def delete(self, account: str, ref: str) -> None:
        """Stop the VM and remove every file of the machine. Raises: MachineNotFound."""
        ...

    async def delete_many(
        self, account: str, labels: Mapping[str, str],
        state: models.MachineState | None = None,
    ) -> builtins.list[tuple[models.MachineRef, Exception | None]]:
        """Delete every machine carrying all of ``labels`` (in ``state``): each machine
        with the error that stopped its delete, or None.
        Raises: InvalidRequest (no label, a bad one)."""
        ...

    async def wait_until_ready(self, account: str, ref: str, timeout: float) -> models.Machine:
        """Wait until the in-guest agent answers. Raises: MachineNotFound, MachineFailed."""
        ...

    async def exec(self, account: str, ref: str, req: models.ExecRequest) -> models.ExecResult:
        """Run a command to completion. Raises: MachineNotFound, MachineFailed, ExecTimeout."""
        ...

    async def logs(self, account: str, ref: str, after: int | None,
                   wait: float) -> models.ServiceLog:
        """The machine's service output after offset ``after`` (None: all that is
        kept), waiting up to ``wait`` seconds for more. Raises: MachineNotFound,
        NotFound (no service)."""
        ...

    async def metrics(self, account: str, ref: str, start: float | None = None,
                      end: float | None = None) -> models.MachineMetrics:
        """The machine's recent CPU, memory and disk samples from ``start`` to ``end``
        (Unix times; None: no bound), one taken now if it runs; a machine that does not
        run is not woken (its kept samples, maybe none). Raises: MachineNotFound,
        InvalidRequest (``start`` after ``end``; an agent before protocol 1.8),
        MachineFailed."""
        ...

    async def exec_result(
        self, account: str, ref: str, exec_id: str, wait: float = 0.0
    ) -> models.ExecStatus:
        """A durable exec's output (its last MiB per stream) and exit, waiting up to
        ``wait`` seconds for a running one to end. Raises: MachineNotFound, ExecNotFound."""
        ...

    async def exec_list(
        self, account: str, ref: str, limit: int = models.DEFAULT_EXEC_LIST
    ) -> builtins.list[models.ExecSummary]:
        """The machine's last ``limit`` kept execs (those `exec_result` reads), newest
        first, without their output. Raises: MachineNotFound, InvalidRequest (``limit``
        outside 1-MAX_EXEC_LIST)."""
        ...

    def exec_stream(
        self, account: str, ref: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        """Run a command, yielding stdout/stderr events as they arrive, then one exit event."""
        ...

    def exec_interactive(
        self, account: str, ref: str, req: models.ExecRequest,
        inputs: AsyncIterator[pm.ExecInput], pty: tuple[int, int] | None = None,
    ) -> AsyncIterator[pm.ExecBytes | models.ExecEvent]:
        """Run a command whose stdin stays open, fed by ``inputs`` (on a terminal of
        ``pty``'s (rows, cols) if given), yielding its output as it comes, then one exit
        event; closing the iterator kills it. Raises: MachineNotFound, InvalidRequest,
        GuestFileNotFound (the program or cwd)."""
        ...

    async def upload(
        self, account: str, ref: str, path: str, data: bytes | AsyncIterable[bytes],
        mode: int = 0o644, user: str | None = None,
    ) -> models.FileInfo:
        """Write a file in the guest from bytes or streamed chunks (parents created), the
        file and the parents it makes owned by ``user`` (``NAME[:GROUP]`` or
        ``UID[:GID]``; None: root). Raises: MachineNotFound, InvalidRequest (field
        ``user``: a user the guest lacks, or an agent too old to set an owner)."""
        ...

    def download(self, account: str, ref: str, path: str) -> AsyncIterator[bytes]:
        """A regular file's chunks, streamed (closing the iterator stops the read).
        Raises: MachineNotFound, GuestFileNotFound, InvalidRequest (a directory, device
        or fifo)."""
        ...

    async def fork(
        self, account: str, ref: str, names: builtins.list[str | None],
        node_hint: str | None = None, labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None, timeout: int | None = None,
        on_timeout: str = "delete", wait: float | None = None,
    ) -> builtins.list[models.Machine | Exception]:
        """Fork ``ref`` into ``len(names)`` children (None = generated name), per item,
        on node ``node_hint`` if given, with the source's labels merged with
        ``labels``, each with a lifetime of ``timeout`` seconds (None: none; never the
        source's); a retry with the same ``idempotency_key`` returns the first
        request's items; children without room wait up to ``wait`` seconds for it
        (then their items are 429s). Raises: InvalidRequest (labels, timeout), MachineNotFound,
        NotFound (no such node), InvalidRequest (the source's forks cannot go to that
        node), IdempotencyKeyReused (the key named another request)."""
        ...

    async def set_timeout(
        self, account: str, ref: str, timeout: int | None, on_timeout: str | None = None,
    ) -> models.Machine:
        """A new end, ``timeout`` seconds from now (None: no lifetime); ``on_timeout``
        None keeps the current action. Raises: InvalidRequest, MachineNotFound."""
        ...

    async def warm(self, account: str, ref: str, forks: int) -> models.Standby:
        """Keep ``forks`` standby forks of ``ref``'s current state ready (0 releases
        them). Raises: MachineNotFound, StateError, ResourceExhausted."""
        ...

    async def suspend(self, account: str, ref: str) -> models.Machine:
        """Stop its vCPUs; memory stays resident. Raises: MachineNotFound, StateError."""
        ...

    async def hibernate(self, account: str, ref: str) -> models.Machine:
        """Memory to disk, VM process ends. Raises: MachineNotFound, StateError."""
        ...

    async def resume(self, account: str, ref: str) -> models.Machine:
        """Wake it. Raises: MachineNotFound, MachineFailed, QuotaExceeded."""
        ...

    async def checkpoint_save(self, account: str, ref: str, name: str) -> models.Checkpoint:
        ...

    async def checkpoint_restore(self, account: str, ref: str, name: str) -> models.Machine:
        ...

    async def checkpoint_list(
        self, account: str, ref: str
    ) -> builtins.list[models.Checkpoint]:
        ...

    async def checkpoint_delete(self, account: str, ref: str, name: str) -> None:
        ...

    async def recover(self) -> None:
        """After a daemon (re)start: find the VMs of recorded machines again."""
        ...

    async def close(self) -> None:
        """Detach from running machines (they keep running) and release resources."""
        ...


class ReportService(Protocol):
    """Reproducibility reports an account saved (``boxd rl verify --save``)."""

    async def save(self, account: str, req: models.ReportSave) -> models.Report:
        """Save (or replace) a report. Raises: InvalidRequest."""
        ...

    async def list(self, account: str) -> builtins.list[models.Report]:
        """The account's reports, newest first."""
        ...

    async def get(self, account: str, name: str) -> models.ReportData:
        """A report whole. Raises: NotFound."""
        ...

    async def delete(self, account: str, name: str) -> None:
        """Delete a report. Raises: NotFound."""
        ...


class SnapshotService(Protocol):
    """Save, list, inspect, delete, export and import snapshots."""

    async def save(
        self, account: str, machine_ref: str, name: str, *, new_version: bool = False
    ) -> models.Snapshot:
        """Raises: MachineNotFound, AlreadyExists (name taken and new_version false)."""
        ...

    async def list(self, account: str) -> list[models.Snapshot]:
        ...

    async def get(self, account: str, ref: str) -> models.Snapshot:
        """Raises: SnapshotNotFound."""
        ...

    async def delete(self, account: str, ref: str) -> None:
        ...

    async def export(self, account: str, ref: str) -> Path:
        """Write the snapshot to one file and return its path (the caller streams it, then
        deletes it)."""
        ...

    async def import_(self, account: str, path: Path, name: str | None = None) -> models.Snapshot:
        """Import a file written by export. Raises: IntegrityError, InvalidRequest."""
        ...


class AccountService(Protocol):
    """Accounts and their limits (the operator, account ``local``, changes them)."""

    async def list(self, account: str) -> builtins.list[models.Account]:
        """The operator sees every account; others only their own."""
        ...

    async def get(self, account: str, name: str) -> models.Account:
        """Raises: NotFound (another account's, unless the caller is the operator)."""
        ...

    async def update(self, account: str, name: str, req: models.AccountUpdate) -> models.Account:
        """Raises: AuthError (not the operator), NotFound."""
        ...


class ProcessStream(Protocol):
    """A client's end of a process's frame stream (see `ProcessService.attach`)."""

    @property
    def process(self) -> pm.Process: ...

    async def send(self, data: bytes) -> None: ...

    async def recv(self) -> bytes | bytearray | None:
        """The next frame, or None once the process has exited."""
        ...


class ProcessService(Protocol):
    """Long-lived processes in machines with a framed message stream (boxd.rl)."""

    async def spawn(self, account: str, ref: str, req: pm.SpawnRequest) -> pm.Process:
        """Raises: MachineNotFound, MachineFailed, InvalidRequest, GuestFileNotFound."""
        ...

    async def processes(self, account: str, ref: str) -> list[pm.Process]:
        ...

    async def process_kill(
        self, account: str, ref: str, process_id: str, signal: int
    ) -> pm.Process:
        ...

    def process_attach(
        self, account: str, ref: str, process_id: str
    ) -> AbstractAsyncContextManager[ProcessStream]:
        """Raises: MachineNotFound, NotFound (process), Conflict (already attached)."""
        ...

    async def process_output(
        self, account: str, ref: str, process_id: str, after: int | None = None,
        wait: float = 0.0,
    ) -> pm.ProcessOutput:
        """The process's stderr kept after offset ``after`` (None: all that is kept, its
        last 64 KiB), waiting up to ``wait`` seconds for more: a reader that follows it
        (the web console's live tail) without taking its client's frames.
        Raises: MachineNotFound, NotFound (process)."""
        ...


__all__ = [
    "AccountService", "ByteStream", "GuestApi", "GuestCaller", "HostInfoFn", "MachineService",
    "ProcessService", "ProcessStream", "ReportService",
    "SnapshotService",
]
