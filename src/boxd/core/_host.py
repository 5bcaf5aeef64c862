"""The host side of the runtime: guest image, QEMU binary, accelerator, engine."""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass

from boxd import __version__, models
from boxd.config import Paths
from boxd.engine.qemu import QemuEngine, probe_accelerator, qemu_version
from boxd.errors import HostSetupError
from boxd.images import GuestImage, ensure_image

log = logging.getLogger("boxd.core")


@dataclass
class Host:
    """Lazily prepared host resources, shared by every machine of the daemon."""

    paths: Paths
    image: GuestImage | None = None
    engine: QemuEngine | None = None
    qemu: str | None = None

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()

    async def ready(self) -> tuple[GuestImage, QemuEngine]:
        """Build the guest image (first time only) and choose the accelerator.

        Raises:
            HostSetupError: QEMU or an image-building tool is missing.
        """
        async with self._lock:
            if self.image is not None and self.engine is not None:
                return self.image, self.engine
            qemu = shutil.which("qemu-system-x86_64")
            if qemu is None:
                raise HostSetupError(
                    "QEMU (qemu-system-x86_64) is not installed",
                    hint="run scripts/setup-host.sh, or apt-get install qemu-system-x86 qemu-utils",
                )
            version = qemu_version(qemu)
            if version < (8, 2, 0):
                log.warning("event=old_qemu version=%s: templates are mapped writable", version)
            image = await asyncio.to_thread(ensure_image, self.paths)
            accel = await asyncio.to_thread(
                probe_accelerator, qemu, image.kernel, self.paths.host_info
            )
            log.info("event=accelerator accel=%s reason=%r", accel.accelerator, accel.reason)
            self.qemu, self.image = qemu, image
            self.engine = QemuEngine(qemu, accel, readonly_rom=version >= (8, 2, 0))
            return image, self.engine

    async def info(self) -> models.HostInfo:
        _, engine = await self.ready()
        assert self.qemu is not None and self.image is not None
        v = qemu_version(self.qemu)
        return models.HostInfo(
            version=__version__, engine=engine.name, qemu=self.qemu,
            qemu_version=".".join(map(str, v)), accelerator=engine.accelerator,
            accelerator_reason=engine.accelerator_reason, cpu_model=engine.cpu_model,
            data_dir=str(self.paths.home), image=self.image.key,
        )
