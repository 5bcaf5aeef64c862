"""Picks and prepares the engines a node runs machines on (``BOXD_ENGINE``: the default).

The node runtime calls `open_engine` once the guest image exists; each engine checks
its own host requirements here and says what to install when one is missing.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

from boxd.config import Paths, Settings
from boxd.engine.base import Engine
from boxd.errors import HostSetupError
from boxd.images import GuestImage

log = logging.getLogger("boxd.engine")

ENGINES = ("qemu",)


async def open_engine(name: str, settings: Settings, paths: Paths, image: GuestImage) -> Engine:
    """The engine called ``name``, ready to boot ``image``.

    Raises:
        HostSetupError: the engine is unknown or its binaries are missing.
    """
    if name == "qemu":
        return await asyncio.to_thread(_open_qemu, settings, paths, image)
    raise HostSetupError(
        f"unknown engine {name!r}", hint=f"use one of {', '.join(ENGINES)} (BOXD_ENGINE)"
    )


def _open_qemu(settings: Settings, paths: Paths, image: GuestImage) -> Engine:
    from boxd.engine.qemu import QemuEngine, probe_accelerator, qemu_version, resolve_run_as

    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise HostSetupError(
            "QEMU (qemu-system-x86_64) is not installed",
            hint="run scripts/setup-host.sh, or apt-get install qemu-system-x86 qemu-utils",
        )
    version = qemu_version(qemu)
    if version < (8, 2, 0):
        log.warning("event=old_qemu version=%s: templates are mapped writable", version)
    accel = probe_accelerator(qemu, image.kernel, paths.host_info, forced=settings.accel)
    log.info("event=accelerator accel=%s reason=%r", accel.accelerator, accel.reason)
    paths.ensure()
    run_as = resolve_run_as(
        settings.qemu_user, traversed=(paths.home, paths.shm),
        writable=(paths.disks, paths.templates, paths.checkpoints, paths.hibernated,
                  paths.shm / "tmp"),
        listable=(paths.home, paths.shm),
    )
    return QemuEngine(
        qemu, accel, readonly_rom=version >= (8, 2, 0), run_as=run_as,
        version=".".join(map(str, version)),
    )


__all__ = ["ENGINES", "open_engine"]
