"""Guest image builder: Debian kernel + busybox initramfs + mmdebstrap ext4 rootfs.

``ensure_image(paths, Recipe(...))`` returns a cached `GuestImage` or builds it; see
docs/images.md for the layout, the QEMU flags it boots with and measured timings.
"""

from __future__ import annotations

from ._build import CACHE_ENV, GuestImage, Recipe, cache_dir, ensure_image, list_images

__all__ = ["CACHE_ENV", "GuestImage", "Recipe", "cache_dir", "ensure_image", "list_images"]
