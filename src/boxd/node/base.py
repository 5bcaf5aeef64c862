"""The `Node` protocol: what the control plane asks of one host's node runtime.

Narrow on purpose: the control plane owns accounts, names, quotas, the snapshot
registry and placement, and inserts a machine's record (state ``starting``) before it
asks a node to launch it; the node owns everything on its host (VM processes, disk
layers, templates, spares, recovery) and every state change of its machines. Today
one in-process node (`boxd.node.runtime.NodeRuntime`); a Ray-backed node implements
the same protocol. Batches return per-item results.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from boxd import models
from boxd import process_models as pm
from boxd.state import CheckpointRecord


@dataclass(frozen=True)
class Boot:
    """Launch a new machine from the guest image (cold boot)."""


@dataclass(frozen=True)
class FromSnapshot:
    """Launch a new machine that continues from a snapshot's stored blobs."""

    digest: str
    memory: Path
    state: Path
    disk: Path


class Node(Protocol):
    """One host's machines. Each method names machines by id (records exist)."""

    @property
    def id(self) -> str: ...

    async def host_info(self) -> models.HostInfo: ...

    async def info(self) -> models.NodeInfo:
        """Its id, address, health, machines, cap and free memory (`boxd nodes list`)."""
        ...

    async def image_key(self) -> str:
        """The guest image new machines boot (built on first use)."""
        ...

    async def engine_name(self) -> str: ...

    async def create(self, machine_id: str, source: Boot | FromSnapshot) -> None:
        """Launch a recorded machine; on failure its record is gone and the error raised."""
        ...

    async def fork(self, source_id: str, child_ids: list[str]) -> list[Exception | None]:
        """Start recorded children of ``source_id``; per child None or its error (a
        failed child's record is gone)."""
        ...

    async def warm(self, source_id: str, forks: int,
                   claimable: int | None = None) -> models.Standby:
        """Keep ``forks`` standby children of the source's current state ready (0
        releases them); returns once they are. ``claimable`` bounds the standby children
        of the source's account (the machines its quota still lets it start). Raises:
        MachineNotFound, StateError, ResourceExhausted (fewer could be made, with why
        and what to do)."""
        ...

    async def wait_until_ready(self, machine_id: str, timeout: float) -> None: ...

    async def exec(self, machine_id: str, req: models.ExecRequest) -> models.ExecResult:
        """Run a command in a task of the node's, keeping its record by its exec id."""
        ...

    async def exec_result(self, machine_id: str, exec_id: str, wait: float) -> models.ExecStatus:
        """A kept exec's output and exit, waiting up to ``wait`` seconds for a running
        one. Raises: MachineNotFound, ExecNotFound."""
        ...

    async def exec_list(self, machine_id: str, limit: int) -> list[models.ExecSummary]:
        """The machine's last ``limit`` kept execs, newest first, without their output.
        Raises: MachineNotFound."""
        ...

    async def machine_metrics(self, machine_id: str, start: float | None,
                              end: float | None) -> list[models.MetricSample]:
        """The machine's kept resource samples in [start, end] (Unix times; None: no
        bound), oldest first, one taken now if it runs (a sleeping machine is not woken).
        Raises: MachineNotFound, InvalidRequest (an agent before protocol 1.8)."""
        ...

    def exec_stream(
        self, machine_id: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]: ...

    def exec_interactive(
        self, machine_id: str, req: models.ExecRequest, inputs: AsyncIterator[pm.ExecInput],
        pty: tuple[int, int] | None,
    ) -> AsyncIterator[pm.ExecBytes | models.ExecEvent]: ...

    async def upload(
        self, machine_id: str, path: str, data: bytes | AsyncIterable[bytes], mode: int,
        user: str | None = None,
    ) -> models.FileInfo:
        """Write a guest file, owned by ``user`` (None: root) with the parents it makes."""
        ...

    def download(self, machine_id: str, path: str) -> AsyncGenerator[bytes, None]:
        """The file's chunks as the consumer takes them (closing stops the guest's read)."""
        ...

    async def checkpoint_save(self, machine_id: str, name: str) -> CheckpointRecord: ...

    async def checkpoint_restore(self, machine_id: str, name: str) -> None: ...

    async def checkpoint_list(self, machine_id: str) -> list[CheckpointRecord]: ...

    async def checkpoint_delete(self, machine_id: str, name: str) -> None: ...

    async def save_snapshot(self, machine_id: str, meta: dict[str, object]) -> str:
        """Capture memory, device state and a flattened disk into the node's snapshot
        store (with ``meta`` and the engine's facts); return the manifest digest."""
        ...

    async def delete(self, machine_id: str) -> None: ...

    def snapshot_digests_in_use(self) -> set[str]: ...

    async def recover(self) -> None:
        """After a daemon (re)start: find the VMs of recorded machines again."""
        ...

    async def close(self) -> None:
        """Detach from running machines (they keep running)."""
        ...

    async def suspend(self, machine_id: str) -> None:
        """Stop its vCPUs (memory stays resident)."""
        ...

    async def hibernate(self, machine_id: str) -> None:
        """Memory and device state to disk; the VM process ends."""
        ...

    async def resume(self, machine_id: str) -> None:
        """Wake a suspended or hibernated machine."""
        ...

    # Processes with a framed stream (``machines.spawn``, boxd.rl).

    async def spawn(self, machine_id: str, req: pm.SpawnRequest) -> pm.Process:
        """Start a long-lived process whose stdin/stdout carry frames."""
        ...

    async def processes(self, machine_id: str) -> list[pm.Process]:
        """The machine's processes (a fork child lists its copies of its source's)."""
        ...

    async def process_kill(self, machine_id: str, process_id: str, signal: int) -> pm.Process:
        ...

    async def process_output(self, machine_id: str, process_id: str, after: int | None,
                             wait: float) -> pm.ProcessOutput:
        """The process's stderr the node keeps after offset ``after`` (None: all of it),
        waiting up to ``wait`` seconds for more. Raises: NotFound (process)."""
        ...

    def process_attach(
        self, machine_id: str, process_id: str
    ) -> AbstractAsyncContextManager[ProcessStream]:
        """Hold the process's stream (one client at a time); re-attaches a detached one.

        Raises: NotFound (no such process), Conflict (another client holds it).
        """
        ...


class ProcessStream(Protocol):
    """A client's end of a process's frame stream."""

    @property
    def process(self) -> pm.Process: ...

    async def send(self, data: bytes) -> None: ...

    async def recv(self) -> bytes | bytearray | None:
        """The next frame, or None once the process has exited."""
        ...


__all__ = ["Boot", "FromSnapshot", "Node", "ProcessStream"]
