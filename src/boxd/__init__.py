"""boxd: microVMs with cheap fork, checkpoint and snapshot, for reproducible RL.

::

    from boxd import Boxd

    boxd = Boxd()                      # BOXD_URL / BOXD_API_KEY, else the local daemon
    fork = boxd.machines.fork("rl-base", "rollout-1")
    result = boxd.machines.exec(fork.id, "python3 rollout.py --seed 1")
"""

from boxd._version import __version__
from boxd.errors import (
    AlreadyExists,
    AuthError,
    BoxdError,
    CheckpointNotFound,
    Conflict,
    ConnectionError,
    ExecTimeout,
    GuestFileNotFound,
    HostSetupError,
    IntegrityError,
    InternalError,
    InvalidRequest,
    MachineFailed,
    MachineNotFound,
    NotFound,
    QuotaExceeded,
    ResourceExhausted,
    SnapshotNotFound,
    StateError,
)
from boxd.models import (
    ApiKey,
    ApiKeyCreated,
    Checkpoint,
    ExecEvent,
    ExecResult,
    FileInfo,
    HostInfo,
    Machine,
    MachineState,
    Snapshot,
)
from boxd.sdk import AsyncBoxd, Boxd

__all__ = [
    "AlreadyExists",
    "ApiKey",
    "ApiKeyCreated",
    "AsyncBoxd",
    "AuthError",
    "Boxd",
    "BoxdError",
    "Checkpoint",
    "CheckpointNotFound",
    "Conflict",
    "ConnectionError",
    "ExecEvent",
    "ExecResult",
    "ExecTimeout",
    "FileInfo",
    "GuestFileNotFound",
    "HostInfo",
    "HostSetupError",
    "IntegrityError",
    "InternalError",
    "InvalidRequest",
    "Machine",
    "MachineFailed",
    "MachineNotFound",
    "MachineState",
    "NotFound",
    "QuotaExceeded",
    "ResourceExhausted",
    "Snapshot",
    "SnapshotNotFound",
    "StateError",
    "__version__",
]
