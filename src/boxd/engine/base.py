"""The engine interface: what boxd needs from an isolation technology.

The QEMU engine (`boxd.engine.qemu`) is the reference implementation. An engine
boots machines from an image or from a frozen memory image, gives an agent channel
into each, pauses/resumes them, captures their memory + device state to files, and
destroys them. Disk layers and memory files are owned by `boxd.storage`; the engine
only receives paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from boxd.engine.agent import AgentClient


@dataclass(frozen=True)
class MachineConfig:
    """What a machine is: fixed for its whole life (forks inherit all but identity)."""

    id: str
    hostname: str
    vcpus: int
    memory_mib: int
    isolated: bool
    port: int | None  # host port forwarded to the guest's HTTP port; None when isolated
    kernel: Path
    initrd: Path
    cmdline: str  # extra kernel command line of the image (timing hints)


@dataclass(frozen=True)
class MemoryImage:
    """Frozen guest RAM plus device state at one instant (a template or a checkpoint).

    ``mem_path`` is a raw RAM file that machines map copy-on-write and ``state_path`` a
    migration stream of device state only; when ``mem_path`` is None the RAM is inside
    ``state_path`` (a mapped-ram stream, taken from a machine whose RAM is private).
    """

    mem_path: Path | None
    state_path: Path
    memory_mib: int


@dataclass(frozen=True)
class BootDisk:
    """The machine's writable qcow2 layer (its backing chain is already in its header)."""

    path: Path


class MachineHandle(Protocol):
    """A live machine as the engine sees it."""

    config: MachineConfig
    pid: int

    @property
    def ram_shared(self) -> bool:
        """True when the machine owns its RAM file (share=on), so capture is cheap."""
        ...

    async def agent(self, timeout: float = 60.0) -> AgentClient: ...

    def alive(self) -> bool: ...

    def exit_reason(self) -> str: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def freeze_disk(self, new_active: Path) -> Path:
        """Make the current active layer read-only; the machine now writes ``new_active``.

        Returns the path of the frozen layer.
        """
        ...

    async def capture(self, dest_dir: Path) -> MemoryImage:
        """Write RAM + device state of the (paused) machine to ``dest_dir``."""
        ...

    async def destroy(self) -> None: ...

    async def detach(self) -> None:
        """Drop host-side connections; the VM keeps running (daemon restart)."""
        ...


class Engine(Protocol):
    """Boots and re-attaches machines."""

    name: str
    accelerator: str
    accelerator_reason: str
    cpu_model: str

    async def boot(
        self, config: MachineConfig, disk: BootDisk, run_dir: Path, log_path: Path
    ) -> MachineHandle: ...

    async def start_from(
        self,
        config: MachineConfig,
        disk: BootDisk,
        image: MemoryImage,
        run_dir: Path,
        log_path: Path,
        *,
        copy_memory: bool,
        paused: bool = False,
    ) -> MachineHandle:
        """Start a machine that continues from ``image``.

        With ``copy_memory`` the machine gets its own RAM file (a sparse copy: it can be
        forked and checkpointed cheaply); otherwise it maps ``image.mem_path``
        copy-on-write (cheap to start, costs only the pages it changes). With ``paused``
        the state is loaded but the guest has not run an instruction: ``resume()``
        starts it (a standby fork child, prepared before anyone asks for it).
        """
        ...

    async def attach(
        self, config: MachineConfig, run_dir: Path, pid: int
    ) -> MachineHandle: ...
