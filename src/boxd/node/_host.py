"""The host side of a node: the guest image and its engines, prepared once, lazily;
and the trees of the container images its machines boot on, unpacked once each."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from boxd.config import Paths, Settings
from boxd.engine.base import Engine
from boxd.engine.registry import AUTO, EngineStatus, describe_engines, open_engine, resolve_auto
from boxd.errors import InvalidRequest
from boxd.images import GuestImage, Recipe, ensure_image
from boxd.images.oci import image_by_digest, unpack_image
from boxd.state import RunImage
from boxd.storage.oci import ImageStore

log = logging.getLogger("boxd.node")


class Host:
    """Builds the guest image (first time only) and opens engines by name.

    ``settings.engine`` names the engine new machines get by default. Tests pass
    ready ``engines`` and an ``image`` (the fake engine needs no image build).
    """

    def __init__(
        self, paths: Paths, settings: Settings, *, engine: Engine | None = None,
        image: GuestImage | None = None,
    ) -> None:
        self.paths = paths
        self.settings = settings
        self.engines: dict[str, Engine] = {}
        if engine is not None:
            self.engines[engine.name] = engine
        self.default = engine.name if engine is not None else settings.engine
        self.default_reason: str | None = None  # why, when BOXD_ENGINE=auto chose it
        self.image = image
        self._lock = asyncio.Lock()

    @property
    def engine(self) -> Engine | None:
        """The default engine, if it is open already."""
        return self.engines.get(self.default)

    async def ready(self, engine: str | None = None) -> tuple[GuestImage, Engine]:
        """The image and the engine named ``engine`` (default: the node's), prepared on
        first call.

        Raises:
            HostSetupError: the engine is unknown, or its binaries or an image-building
                tool are missing.
        """
        async with self._lock:
            if self.image is None:
                self.image = await asyncio.to_thread(
                    ensure_image, self.paths, Recipe.for_machines(self.settings))
            if self.default == AUTO:
                self.default, self.default_reason = await asyncio.to_thread(
                    resolve_auto, self.settings, self.paths, self.image)
                log.info("event=engine_auto engine=%s reason=%r", self.default,
                         self.default_reason)
            name = engine or self.default
            if name not in self.engines:
                self.engines[name] = await open_engine(name, self.settings, self.paths,
                                                       self.image)
            return self.image, self.engines[name]

    async def image_root(self, run: RunImage, engine: Engine) -> Path:
        """This node's root tree of the imported image ``run`` (unpacked once per
        digest from the node's image store): what a machine of it boots on, and what a
        fork template of one received from another node is re-pointed at.

        Raises:
            InvalidRequest: ``engine`` cannot boot on an image's tree.
            NotFound: the node's store lacks the image (removed, or never pushed here).
        """
        if not engine.image_roots:
            raise InvalidRequest(
                "this machine's engine cannot run container images", field="engine",
                hint=f"boxd machine new NAME --image {run.name} --engine ENGINE, naming an "
                "engine that runs them (`boxd info` lists the engines)")
        store = ImageStore(self.paths.images_store)

        def unpack() -> Path:
            return unpack_image(store, image_by_digest(store, run.name, run.digest),
                                self.paths.image_roots)

        return await asyncio.to_thread(unpack)

    async def describe(self) -> list[EngineStatus]:
        """Every engine's status here (for ``boxd info``)."""
        image, _ = await self.ready()
        return await asyncio.to_thread(describe_engines, self.settings, self.paths, image)


__all__ = ["Host"]
