"""Picks and prepares the engines a node runs machines on (``BOXD_ENGINE``: the default).

The node runtime calls `open_engine` once the guest image exists; each engine checks
its own host requirements here and says what to install when one is missing.

``BOXD_ENGINE=auto`` resolves once per daemon (`resolve_auto`): QEMU where its probe
says KVM really works (a hardware boundary at full speed); else gVisor where a real
``runsc`` sandbox starts (near-native speed, a user-space kernel built as a boundary);
else QEMU under TCG. Both probes are cached per host. `describe_engines` says, for
``boxd info``, what each engine can do here and why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from boxd.config import Paths, Settings
from boxd.engine.base import Engine
from boxd.errors import HostSetupError
from boxd.images import GuestImage

log = logging.getLogger("boxd.engine")

ENGINES = ("qemu", "gvisor")
AUTO = "auto"


@dataclass(frozen=True)
class EngineStatus:
    """One engine on this host: ``status`` is ``ok`` or ``unavailable``, with the reason."""

    name: str
    status: str
    reason: str
    accelerator: str = ""


async def open_engine(name: str, settings: Settings, paths: Paths, image: GuestImage) -> Engine:
    """The engine called ``name``, ready to boot ``image``.

    Raises:
        HostSetupError: the engine is unknown or its binaries are missing.
    """
    if name == "qemu":
        return await asyncio.to_thread(_open_qemu, settings, paths, image)
    if name == "gvisor":
        return await asyncio.to_thread(_open_gvisor, settings, paths, image)
    if name == AUTO:
        chosen, _ = await asyncio.to_thread(resolve_auto, settings, paths, image)
        return await open_engine(chosen, settings, paths, image)
    raise HostSetupError(
        f"unknown engine {name!r}",
        hint=f"use one of {', '.join(ENGINES)} or {AUTO} (BOXD_ENGINE)",
    )


def _gvisor_cache(paths: Paths) -> Path:
    return paths.host_info.with_name("host-gvisor.json")


def _qemu_status(settings: Settings, paths: Paths, image: GuestImage) -> EngineStatus:
    from boxd.engine.qemu import probe_accelerator

    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        return EngineStatus("qemu", "unavailable", "qemu-system-x86_64 is not installed "
                            "(scripts/setup-host.sh installs it)")
    # Not paths.ensure(): it would reset the modes `resolve_run_as` gave the data dirs.
    paths.host_info.parent.mkdir(parents=True, exist_ok=True)
    accel = probe_accelerator(qemu, image.kernel, paths.host_info, forced=settings.accel)
    isolation = ("a hardware VM boundary" if accel.accelerator == "kvm" else
                 "TCG emulation: not a security boundary in QEMU's own policy")
    return EngineStatus("qemu", "ok", f"{accel.reason}; {isolation}", accel.accelerator)


def _runsc(settings: Settings) -> str | None:
    if settings.runsc:
        return settings.runsc if os.access(settings.runsc, os.X_OK) else None
    return shutil.which("runsc")


def _gvisor_status(settings: Settings, paths: Paths, image: GuestImage) -> EngineStatus:
    from boxd.engine.gvisor import probe_runsc
    from boxd.images import rootfs_tree

    runsc = _runsc(settings)
    if runsc is None:
        where = f"BOXD_RUNSC={settings.runsc} is not an executable" if settings.runsc else \
            "runsc is not installed"
        return EngineStatus("gvisor", "unavailable", f"{where} (apt-get install -t "
                            "bookworm-backports runsc; scripts/setup-host.sh does)")
    try:
        tree = rootfs_tree(image.rootfs)
    except HostSetupError as exc:
        return EngineStatus("gvisor", "unavailable", f"cannot unpack the guest root: {exc}")
    paths.host_info.parent.mkdir(parents=True, exist_ok=True)
    choice = probe_runsc(tree, _gvisor_cache(paths), runsc)
    if not choice.ok:
        return EngineStatus("gvisor", "unavailable", choice.reason)
    return EngineStatus("gvisor", "ok", f"{choice.reason}; a user-space kernel (gVisor) "
                        "between guest code and the host", "systrap")


def engine_status(name: str, settings: Settings, paths: Paths, image: GuestImage) -> EngineStatus:
    """What one engine can do on this host, and why.

    Raises:
        HostSetupError: the engine is unknown.
    """
    if name == "qemu":
        return _qemu_status(settings, paths, image)
    if name == "gvisor":
        return _gvisor_status(settings, paths, image)
    raise HostSetupError(f"unknown engine {name!r}", hint=f"use one of {', '.join(ENGINES)}")


def describe_engines(settings: Settings, paths: Paths, image: GuestImage) -> list[EngineStatus]:
    """What each engine can do on this host, and why (probes are cached)."""
    return [_qemu_status(settings, paths, image), _gvisor_status(settings, paths, image)]


def resolve_auto(settings: Settings, paths: Paths, image: GuestImage) -> tuple[str, str]:
    """The engine ``BOXD_ENGINE=auto`` means on this host, and why.

    Raises:
        HostSetupError: neither engine can run here.
    """
    qemu = _qemu_status(settings, paths, image)
    if qemu.status == "ok" and qemu.accelerator == "kvm":
        return "qemu", f"auto: QEMU with KVM ({qemu.reason})"
    gvisor = _gvisor_status(settings, paths, image)
    if gvisor.status == "ok":
        why = qemu.reason if qemu.status != "ok" else f"QEMU would run under TCG ({qemu.reason})"
        return "gvisor", f"auto: gVisor, because {why}; {gvisor.reason}"
    if qemu.status == "ok":
        return "qemu", f"auto: QEMU under TCG, because gVisor is unavailable: {gvisor.reason}"
    raise HostSetupError(
        f"no engine can run here: qemu: {qemu.reason}; gvisor: {gvisor.reason}",
        hint="run scripts/setup-host.sh (it installs QEMU and runsc)",
    )


def _open_qemu(settings: Settings, paths: Paths, image: GuestImage) -> Engine:
    from boxd.engine.cgroups import Cgroups
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
    cgroups = Cgroups.open(paths.shm.name, settings.cgroups)
    if cgroups.available:
        swept = cgroups.sweep()  # nothing runs yet in a cgroup this daemon will make
        log.info("event=cgroups limits=%r swept=%d", cgroups.summary(), len(swept))
    else:
        log.warning("event=cgroups_unavailable reason=%r", cgroups.summary())
    return QemuEngine(
        qemu, accel, readonly_rom=version >= (8, 2, 0), run_as=run_as,
        version=".".join(map(str, version)), net_user=settings.net_user,
        cgroups=cgroups, runtime=image.rootfs, image_disks=paths.image_disks,
        received_roots=paths.received_roots,
    )


def _open_gvisor(settings: Settings, paths: Paths, image: GuestImage) -> Engine:
    from boxd.engine.cgroups import Cgroups
    from boxd.engine.gvisor import GvisorEngine
    from boxd.images import agent_tree

    status = _gvisor_status(settings, paths, image)
    if status.status != "ok":
        raise HostSetupError(f"the gvisor engine cannot run here: {status.reason}",
                             hint="run scripts/setup-host.sh, or use BOXD_ENGINE=qemu")
    from boxd.engine.gvisor import runsc_version

    runsc = _runsc(settings)
    assert runsc is not None
    # The same parent as QEMU's cgroups (one per data directory). No sweep here: one
    # QEMU just made may be empty for a moment; the engine's own sweep removes its
    # dead sandboxes' cgroups.
    cgroups = Cgroups.open(paths.shm.name, settings.cgroups)
    if not cgroups.available:
        log.warning("event=cgroups_unavailable engine=gvisor reason=%r", cgroups.summary())
    engine = GvisorEngine(
        runsc, runsc_version(runsc), state_root=paths.shm / "gvisor",
        agent_tree=agent_tree(image.dir), reason=status.reason, fallback_rootfs=image.rootfs,
        net_user=settings.net_user, cgroups=cgroups, image_roots=paths.image_roots,
    )
    if swept := engine.sweep():
        log.info("event=gvisor_state_swept sandboxes=%d", len(swept))
    return engine


def end_networks_left(machines: Path) -> None:
    """End the network helpers each machine run directory under ``machines`` records
    (a gVisor machine's pasta and its holder, named by nothing of the data directory's):
    the clean-up after a daemon or node that is gone."""
    from boxd.engine.gvisor._net import end_recorded

    end_recorded(machines)


__all__ = ["AUTO", "ENGINES", "EngineStatus", "describe_engines", "end_networks_left",
           "engine_status", "open_engine", "resolve_auto"]
