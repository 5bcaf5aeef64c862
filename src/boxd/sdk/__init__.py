"""Python SDK: ``Boxd`` (sync) and ``AsyncBoxd`` (async), thin clients of the HTTP API."""

from boxd.sdk._async import (
    AsyncBoxd,
    AsyncCheckpoints,
    AsyncFiles,
    AsyncKeys,
    AsyncMachines,
    AsyncSnapshots,
)
from boxd.sdk._sync import Boxd, Checkpoints, Files, Keys, Machines, Snapshots

__all__ = [
    "AsyncBoxd",
    "AsyncCheckpoints",
    "AsyncFiles",
    "AsyncKeys",
    "AsyncMachines",
    "AsyncSnapshots",
    "Boxd",
    "Checkpoints",
    "Files",
    "Keys",
    "Machines",
    "Snapshots",
]
