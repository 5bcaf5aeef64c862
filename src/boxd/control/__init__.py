"""The control plane: accounts, names, quotas, the snapshot registry, placement."""

from __future__ import annotations

from boxd import models
from boxd.config import Paths, Settings
from boxd.control.accounts import Accounts
from boxd.control.plane import Machines, Snapshots, machine_model, validate_name
from boxd.control.ray import RayCluster
from boxd.errors import HostSetupError
from boxd.node import Host, NodeRuntime
from boxd.services import HostInfoFn
from boxd.state import Database, Repos
from boxd.storage import SnapshotStore
from boxd.storage.oci import ImageStore

__all__ = [
    "Accounts", "Machines", "Snapshots", "build_services", "machine_model", "validate_name",
]


def build_services(
    paths: Paths, db: Database, settings: Settings | None = None
) -> tuple[Machines, Snapshots, HostInfoFn]:
    """The services a daemon serves: one local node, one database, one snapshot store."""
    settings = settings or Settings.from_env()
    paths.ensure()
    repos = Repos(db)
    store = SnapshotStore(paths.snapshots)
    if settings.ray_address:
        return _cluster_services(paths, repos, store, settings)
    node = NodeRuntime(paths, repos, Host(paths, settings), settings, store)
    machines = Machines(repos, {node.id: node}, store,
                        default_quota=settings.default_max_machines,
                        images=ImageStore(paths.images_store))
    snapshots = Snapshots(machines, store)
    machines.snapshots = snapshots

    async def host_info() -> models.HostInfo:
        return await node.host_info()

    return machines, snapshots, host_info


def _cluster_services(
    paths: Paths, repos: Repos, store: SnapshotStore, settings: Settings
) -> tuple[Machines, Snapshots, HostInfoFn]:
    """The control plane of a Ray cluster: its nodes join as Ray reports them (see
    `boxd.control.ray`); this process runs no machines itself."""
    machines = Machines(repos, {}, store, default_quota=settings.default_max_machines,
                        images=ImageStore(paths.images_store))  # pushed to nodes as used
    cluster = RayCluster(settings.ray_address, paths, settings, repos, machines.quota_of)
    machines.cluster = cluster
    snapshots = Snapshots(machines, store)
    machines.snapshots = snapshots

    async def host_info() -> models.HostInfo:
        for node in cluster.nodes.values():
            if node.alive:
                info = await node.host_info()
                return info.model_copy(update={"data_dir": str(paths.home)})
        raise HostSetupError("no boxd node has joined the Ray cluster yet",
                             hint="start Ray nodes with --resources '{\"boxd\": 1}'")

    return machines, snapshots, host_info
