"""The gVisor engine: machines as ``runsc`` sandboxes (systrap), a user-space kernel.

Near-native guest speed on hosts without usable KVM; forks are checkpoint restores (no
memory sharing between copies). See ``docs/engines.md``.
"""

from boxd.engine.gvisor._engine import GvisorEngine, GvisorMachine, layer_base, write_layer
from boxd.engine.gvisor._probe import RunscChoice, probe_runsc, runsc_version

__all__ = [
    "GvisorEngine",
    "GvisorMachine",
    "RunscChoice",
    "layer_base",
    "probe_runsc",
    "runsc_version",
    "write_layer",
]
