"""boxd: microVMs with cheap fork, checkpoint and snapshot, for reproducible RL.

::

    from boxd import Boxd

    boxd = Boxd()                      # BOXD_URL / BOXD_API_KEY, else the local daemon
    fork = boxd.machines.fork("rl-base", "rollout-1")
    result = boxd.machines.exec(fork.id, "python3 rollout.py --seed 1")
"""

import importlib
from typing import TYPE_CHECKING, Any

from boxd._version import __version__
from boxd.errors import (
    AgentLost,
    AlreadyExists,
    AuthError,
    BodyTimeout,
    BoxdError,
    CheckpointNotFound,
    Conflict,
    ConnectionError,
    CorruptData,
    ExecIdConflict,
    ExecNotFound,
    ExecTimeout,
    Forbidden,
    GuestFileNotFound,
    HostSetupError,
    IdempotencyKeyReused,
    InfrastructureError,
    IntegrityError,
    InternalError,
    InvalidRequest,
    MachineFailed,
    MachineNotFound,
    NodeLost,
    NotFound,
    PayloadTooLarge,
    QuotaExceeded,
    ResourceExhausted,
    SnapshotNotFound,
    StateError,
)

# The models (pydantic) and the clients (httpx) load on first use, so that
# ``from boxd import Boxd`` pays for the sync client only (not the async one, the CLI or
# the daemon) and ``import boxd.errors`` for nothing but the errors.
_LAZY = {
    "ApiKey": "boxd.models",
    "ApiKeyCreated": "boxd.models",
    "AsyncBoxd": "boxd.sdk._async",
    "Boxd": "boxd.sdk._sync",
    "Checkpoint": "boxd.models",
    "ExecEvent": "boxd.models",
    "ExecResult": "boxd.models",
    "ExecStatus": "boxd.models",
    "ExecSummary": "boxd.models",
    "FileInfo": "boxd.models",
    "HostInfo": "boxd.models",
    "Lineage": "boxd.sdk._lineage",
    "Machine": "boxd.models",
    "MachineNode": "boxd.sdk._lineage",
    "MachineState": "boxd.models",
    "Snapshot": "boxd.models",
    "SnapshotNode": "boxd.sdk._lineage",
}

if TYPE_CHECKING:
    from boxd.models import (
        ApiKey,
        ApiKeyCreated,
        Checkpoint,
        ExecEvent,
        ExecResult,
        ExecStatus,
        ExecSummary,
        FileInfo,
        HostInfo,
        Machine,
        MachineState,
        Snapshot,
    )
    from boxd.sdk._async import AsyncBoxd
    from boxd.sdk._lineage import Lineage, MachineNode, SnapshotNode
    from boxd.sdk._sync import Boxd


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'boxd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AgentLost",
    "AlreadyExists",
    "ApiKey",
    "ApiKeyCreated",
    "AsyncBoxd",
    "AuthError",
    "BodyTimeout",
    "Boxd",
    "BoxdError",
    "Checkpoint",
    "CheckpointNotFound",
    "Conflict",
    "ConnectionError",
    "CorruptData",
    "ExecEvent",
    "ExecIdConflict",
    "ExecNotFound",
    "ExecResult",
    "ExecStatus",
    "ExecSummary",
    "ExecTimeout",
    "FileInfo",
    "Forbidden",
    "GuestFileNotFound",
    "HostInfo",
    "HostSetupError",
    "IdempotencyKeyReused",
    "InfrastructureError",
    "IntegrityError",
    "InternalError",
    "InvalidRequest",
    "Lineage",
    "Machine",
    "MachineFailed",
    "MachineNode",
    "MachineNotFound",
    "MachineState",
    "NodeLost",
    "NotFound",
    "PayloadTooLarge",
    "QuotaExceeded",
    "ResourceExhausted",
    "Snapshot",
    "SnapshotNode",
    "SnapshotNotFound",
    "StateError",
    "__version__",
]
