"""SQLite state: schema migrations, a thread-safe connection, repositories of records."""

from boxd.state._db import Database, new_id
from boxd.state.records import (
    AccountRecord,
    CheckpointRecord,
    Garbage,
    IdempotencyRecord,
    KeyRecord,
    LayerRecord,
    MachineRecord,
    RunImage,
    SnapshotRecord,
    TemplateRecord,
)
from boxd.state.repos import Repos

__all__ = [
    "AccountRecord",
    "CheckpointRecord",
    "Database",
    "Garbage",
    "IdempotencyRecord",
    "KeyRecord",
    "LayerRecord",
    "MachineRecord",
    "Repos",
    "RunImage",
    "SnapshotRecord",
    "TemplateRecord",
    "new_id",
]
