"""Snapshot services: durable, named, versioned machine images. No HTTP types here.

INTERFACE STUB: the engine-backed implementation lands with the snapshot work. The API
routes code against exactly these signatures. A snapshot ``ref`` is ``NAME`` (latest
version), ``NAME@N`` or ``sha256:DIGEST``.
"""

from __future__ import annotations

from pathlib import Path

from boxd import models


class SnapshotService:
    """Save, list, inspect, delete, export and import snapshots."""

    async def save(
        self, account: str, machine_ref: str, name: str, *, new_version: bool = False
    ) -> models.Snapshot:
        """Raises: MachineNotFound, AlreadyExists (name taken and new_version false)."""
        raise NotImplementedError

    async def list(self, account: str) -> list[models.Snapshot]:
        raise NotImplementedError

    async def get(self, account: str, ref: str) -> models.Snapshot:
        """Raises: SnapshotNotFound."""
        raise NotImplementedError

    async def delete(self, account: str, ref: str) -> None:
        raise NotImplementedError

    async def export(self, account: str, ref: str) -> Path:
        """Write the snapshot to one file and return its path (the caller streams it, then
        deletes it)."""
        raise NotImplementedError

    async def import_(self, account: str, path: Path, name: str | None = None) -> models.Snapshot:
        """Import a file written by export. Raises: IntegrityError, InvalidRequest."""
        raise NotImplementedError
