"""The host side of a node: the guest image and the engine, prepared once, lazily."""

from __future__ import annotations

import asyncio
import logging

from boxd.config import Paths, Settings
from boxd.engine.base import Engine
from boxd.engine.registry import open_engine
from boxd.images import GuestImage, ensure_image

log = logging.getLogger("boxd.node")


class Host:
    """Builds the guest image (first time only) and opens the engine.

    Tests pass a ready ``engine`` and ``image`` (the fake engine needs no image build).
    """

    def __init__(
        self, paths: Paths, settings: Settings, *, engine: Engine | None = None,
        image: GuestImage | None = None,
    ) -> None:
        self.paths = paths
        self.settings = settings
        self.engine = engine
        self.image = image
        self._lock = asyncio.Lock()

    async def ready(self) -> tuple[GuestImage, Engine]:
        """The image and engine, prepared on first call.

        Raises:
            HostSetupError: the engine's binaries or an image-building tool is missing.
        """
        async with self._lock:
            if self.image is None:
                self.image = await asyncio.to_thread(ensure_image, self.paths)
            if self.engine is None:
                self.engine = await open_engine(self.settings, self.paths, self.image)
            return self.image, self.engine


__all__ = ["Host"]
