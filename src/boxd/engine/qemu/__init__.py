"""The QEMU engine: microVMs under KVM where it really works, TCG otherwise."""

from boxd.engine.qemu._engine import QemuEngine, QemuMachine, RunAs, attach, resolve_run_as
from boxd.engine.qemu._probe import AccelChoice, probe_accelerator, qemu_version

__all__ = [
    "AccelChoice",
    "QemuEngine",
    "QemuMachine",
    "RunAs",
    "attach",
    "probe_accelerator",
    "qemu_version",
    "resolve_run_as",
]
