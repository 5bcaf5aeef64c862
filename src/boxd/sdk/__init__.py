"""Python SDK: ``Boxd`` (sync) and ``AsyncBoxd`` (async), thin clients of the HTTP API.

Each twin loads on first use: the sync client does not import asyncio's client, nor
the async one the sync one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from boxd.sdk._async import (
        AsyncAccounts,
        AsyncBoxd,
        AsyncCheckpoints,
        AsyncFiles,
        AsyncKeys,
        AsyncMachines,
        AsyncReports,
        AsyncSnapshots,
    )
    from boxd.sdk._sync import (
        Accounts,
        Boxd,
        Checkpoints,
        Files,
        Keys,
        Machines,
        Reports,
        Snapshots,
    )

__all__ = [
    "Accounts",
    "AsyncAccounts",
    "AsyncBoxd",
    "AsyncCheckpoints",
    "AsyncFiles",
    "AsyncKeys",
    "AsyncMachines",
    "AsyncReports",
    "AsyncSnapshots",
    "Boxd",
    "Checkpoints",
    "Files",
    "Keys",
    "Machines",
    "Reports",
    "Snapshots",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'boxd.sdk' has no attribute {name!r}")
    twin = "boxd.sdk._async" if name.startswith("Async") else "boxd.sdk._sync"
    value = getattr(importlib.import_module(twin), name)
    globals()[name] = value
    return value
