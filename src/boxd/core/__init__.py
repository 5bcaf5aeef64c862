"""The domain layer: machines, forks, checkpoints and snapshots on the QEMU engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from boxd import models
from boxd.config import Paths
from boxd.core._host import Host
from boxd.core.machines import Machines
from boxd.core.snapshots import Snapshots
from boxd.state import Database
from boxd.storage import SnapshotStore

__all__ = ["Host", "Machines", "Snapshots", "build_services"]


def build_services(
    paths: Paths, db: Database
) -> tuple[Machines, Snapshots, Callable[[], Awaitable[models.HostInfo]]]:
    """The services a daemon serves, on one host, one database and one snapshot store."""
    paths.ensure()
    host = Host(paths)
    machines = Machines(paths, db, host)
    store = SnapshotStore(paths.snapshots)
    snapshots = Snapshots(machines, store)
    machines.snapshots = snapshots
    return machines, snapshots, host.info
