"""Machine services: the domain operations behind the API. No HTTP types here.

INTERFACE STUB: the engine-backed implementation lands with the runtime work. The
API routes code against exactly these signatures. ``account`` is the id of the
account that owns the resource; a ``ref`` is a machine name or id.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator

from boxd import models


class MachineService:
    """Create, inspect, run commands in, fork, checkpoint and delete machines."""

    async def create(self, account: str, req: models.MachineCreate) -> models.Machine:
        """Create and boot a machine; returns once the QEMU process runs (state starting).

        Raises:
            InvalidRequest, AlreadyExists, QuotaExceeded, SnapshotNotFound, HostSetupError.
        """
        raise NotImplementedError

    async def get(self, account: str, ref: str) -> models.Machine:
        """Raises: MachineNotFound."""
        raise NotImplementedError

    async def list(self, account: str) -> list[models.Machine]:
        raise NotImplementedError

    async def delete(self, account: str, ref: str) -> None:
        """Stop the VM and remove every file of the machine. Raises: MachineNotFound."""
        raise NotImplementedError

    async def wait_until_ready(self, account: str, ref: str, timeout: float) -> models.Machine:
        """Wait until the in-guest agent answers. Raises: MachineNotFound, MachineFailed."""
        raise NotImplementedError

    async def exec(self, account: str, ref: str, req: models.ExecRequest) -> models.ExecResult:
        """Run a command to completion. Raises: MachineNotFound, MachineFailed, ExecTimeout."""
        raise NotImplementedError

    def exec_stream(
        self, account: str, ref: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        """Run a command, yielding stdout/stderr events as they arrive, then one exit event."""
        raise NotImplementedError

    async def upload(
        self, account: str, ref: str, path: str, data: bytes, mode: int = 0o644
    ) -> models.FileInfo:
        """Write a file in the guest (parents created). Raises: MachineNotFound, InvalidRequest."""
        raise NotImplementedError

    async def download(self, account: str, ref: str, path: str) -> bytes:
        """Read a file from the guest. Raises: MachineNotFound, GuestFileNotFound."""
        raise NotImplementedError

    async def fork(
        self, account: str, ref: str, names: builtins.list[str | None]
    ) -> builtins.list[models.Machine | Exception]:
        """Fork ``ref`` into ``len(names)`` children (None = generated name), per item."""
        raise NotImplementedError

    async def checkpoint_save(self, account: str, ref: str, name: str) -> models.Checkpoint:
        raise NotImplementedError

    async def checkpoint_restore(self, account: str, ref: str, name: str) -> models.Machine:
        raise NotImplementedError

    async def checkpoint_list(
        self, account: str, ref: str
    ) -> builtins.list[models.Checkpoint]:
        raise NotImplementedError

    async def checkpoint_delete(self, account: str, ref: str, name: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Detach from running machines (they keep running) and release resources."""
        raise NotImplementedError
