"""What the control plane asks of nodes beyond the `Node` protocol: its capabilities.

`Node` (node/base.py) is what every node does. A node of this host also serves the
in-guest API (`LocalNode`); a node of a cluster has a liveness and an address, holds
snapshot blobs of its own and talks to its peers (`ClusterNode`), and a `Cluster`
keeps the cluster's nodes. The control plane calls these capabilities; it never asks
what kind of node it holds (`control/ray.py` implements the cluster ones on Ray).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from boxd.node.base import Boot, FromSnapshot, Node
from boxd.services import GuestApi
from boxd.storage import SnapshotStore
from boxd.storage.oci import ImageStore


class LocalNode(Node, Protocol):
    """A node in the control plane's own process (a single host's `NodeRuntime`)."""

    def serve_guests(self, handler: GuestApi) -> None:
        """Serve each machine's in-guest API socket with ``handler``."""
        ...


class ClusterNode(Node, Protocol):
    """A node of a cluster: it may die, has an address, and holds blobs of its own."""

    @property
    def alive(self) -> bool:
        """False once the cluster reported it dead (its machines are then ``lost``)."""
        ...

    @property
    def address(self) -> str:
        """The host its machines' URLs are served on."""
        ...

    @property
    def peer(self) -> object:
        """What another node of the same cluster reaches this one by (node to node)."""
        ...

    async def create(self, machine_id: str, source: Boot | FromSnapshot,
                     holder: ClusterNode | None = None) -> None:
        """`Node.create`; a snapshot's blobs this node lacks come from ``holder``."""
        ...

    async def fork_from(self, source: ClusterNode, source_id: str,
                        child_ids: list[str]) -> list[Exception | None]:
        """Children here of a machine on ``source`` (its template streams node to node);
        per child None or its error (a failed child's record is gone)."""
        ...

    async def portable_templates(self, engine: str, image: bool = False) -> bool:
        """True when this node's templates of ``engine``'s machines (``image``: of a
        machine that runs a container image) can stream to a peer (the engine's
        capability): a fork batch may then spread past this node."""
        ...

    async def snapshot_digests(self) -> set[str]:
        """The snapshots whose blobs this node's store holds."""
        ...

    async def manifest(self, digest: str) -> bytes:
        """The raw manifest of a snapshot this node holds (the registry keeps it)."""
        ...

    async def fetch_snapshot(self, digest: str, store: SnapshotStore) -> None:
        """Copy a snapshot this node holds into ``store`` (blobs it lacks, verified)."""
        ...

    async def receive_image(self, store: ImageStore, digests: list[str]) -> None:
        """Copy the blobs of ``digests`` (an image's: manifest first) this node lacks
        from ``store`` (before a machine of it is created or forked here); a node known
        to hold them is not asked again."""
        ...

    async def drop_snapshot(self, digest: str) -> None:
        """Remove a snapshot the registry no longer has (blobs in use there stay)."""
        ...

    async def drop_received(self, source_id: str) -> None:
        """The machine ``source_id`` (on another node) was deleted: this node lets go of
        the template of it it received (a cross-node fork) and kept for further forks."""
        ...

    async def collect_images(self, keep: Callable[[], set[str]]) -> int:
        """Remove this node's copies (blobs, unpacked trees, disks) of every image that
        neither ``keep()`` (asked when no push to this node is under way) nor a machine
        or snapshot of the node names; return how many entries went."""
        ...


class Cluster(Protocol):
    """The nodes of a cluster, as they join and die."""

    @property
    def nodes(self) -> Mapping[str, ClusterNode]: ...

    async def start(self) -> None:
        """Join the cluster; its nodes recover their machines."""
        ...

    async def close(self) -> None:
        """Stop watching the cluster (its nodes and machines keep running)."""
        ...


__all__ = ["Cluster", "ClusterNode", "LocalNode"]
