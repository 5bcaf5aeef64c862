"""Every file boxd keeps: disk layers, memory images and the snapshot store."""

from boxd.storage.snapshots import (
    FORMAT_VERSION,
    BlobEntry,
    BlobRef,
    GcReport,
    Manifest,
    SnapshotStore,
    Staging,
)

__all__ = [
    "FORMAT_VERSION",
    "BlobEntry",
    "BlobRef",
    "GcReport",
    "Manifest",
    "SnapshotStore",
    "Staging",
]
