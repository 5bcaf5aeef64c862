"""Guest image builder: Debian kernel + busybox initramfs + mmdebstrap ext4 rootfs.

``ensure_image(paths, Recipe(...))`` returns a cached `GuestImage` or builds it; see
docs/images.md for the layout, the QEMU flags it boots with and measured timings.
"""

from __future__ import annotations

from ._build import CACHE_ENV, GuestImage, Recipe, cache_dir, ensure_image, list_images
from ._collect import collect_unpacked, images_in_use
from ._disk import (
    check_disk_name,
    disk_chain,
    disk_format,
    disk_name,
    find_disk,
    image_disk,
    place_disk,
    qcow2_backing,
    unused_received,
    virtual_size,
)
from ._rootfs import GUEST_CLIENT_DIR
from ._tree import AGENT_MOUNT, CLIENT_DIR, RELAY_ENV, agent_tree, native_relay, rootfs_tree

__all__ = [
    "AGENT_MOUNT",
    "CACHE_ENV",
    "CLIENT_DIR",
    "GUEST_CLIENT_DIR",
    "RELAY_ENV",
    "GuestImage",
    "Recipe",
    "agent_tree",
    "cache_dir",
    "check_disk_name",
    "collect_unpacked",
    "disk_chain",
    "disk_format",
    "disk_name",
    "ensure_image",
    "find_disk",
    "image_disk",
    "images_in_use",
    "list_images",
    "native_relay",
    "place_disk",
    "qcow2_backing",
    "rootfs_tree",
    "unused_received",
    "virtual_size",
]
