"""The host side of the runtime: guest image, QEMU binary, accelerator, engine."""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import shutil
import stat
from dataclasses import dataclass

from boxd import __version__, models
from boxd.config import Paths
from boxd.engine.qemu import QemuEngine, RunAs, probe_accelerator, qemu_version
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
        self._run_as: RunAs | None = None
        self._run_as_known = False

    def run_as(self) -> RunAs | None:
        """The unprivileged user QEMU drops to, when the daemon runs as root.

        ``BOXD_QEMU_USER`` names it (default ``boxd-qemu``, created by
        scripts/setup-host.sh; empty disables). The directories QEMU writes into after
        dropping (disk layers, capture directories) are made writable for its group.
        """
        if self._run_as_known:
            return self._run_as
        self._run_as_known = True
        name = os.environ.get("BOXD_QEMU_USER", "boxd-qemu")
        if os.geteuid() != 0 or not name:
            return None
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            log.warning("event=qemu_runs_as_root reason=%r", f"no user {name!r}")
            return None
        run_as = RunAs(name, pw.pw_uid, pw.pw_gid)
        paths = self.paths
        paths.ensure()
        # QEMU reopens disk layers by path after dropping privileges: every directory
        # above the data directory must let that user through.
        for d in (*paths.home.parents, *paths.shm.parents):
            st = d.stat()
            if not (st.st_mode & stat.S_IXOTH or (st.st_gid == pw.pw_gid
                                                  and st.st_mode & stat.S_IXGRP)):
                log.warning(
                    "event=qemu_runs_as_root reason=%r",
                    f"{d} is not traversable by {name} (use a data directory such as "
                    "/var/lib/boxd)",
                )
                return None
        for d in (paths.home, paths.shm):
            os.chmod(d, 0o711)  # traversable, not listable: QEMU reopens layers by path
        for d in (paths.disks, paths.templates, paths.checkpoints):
            os.chown(d, 0, run_as.gid)
            os.chmod(d, 0o2770)
        self._run_as = run_as
        return run_as

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
            self.engine = QemuEngine(
                qemu, accel, readonly_rom=version >= (8, 2, 0), run_as=self.run_as()
            )
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
