"""The engine interface: what boxd needs from an isolation technology.

The node runtime imports this module (and `boxd.engine.registry`) and nothing else of
``engine/``. An engine boots machines from an image or from a frozen memory image,
gives an agent channel into each, pauses/resumes them, captures their memory + device
state to files, makes and flattens disk layers in its own format, and destroys them.
The QEMU engine (`boxd.engine.qemu`) is the reference; `boxd.engine.fake` is an
in-memory engine for unit tests of the runtime. ``engine/_conformance.py`` assigns
both to these protocols so ``mypy --strict`` proves they satisfy them.
"""

from __future__ import annotations

from asyncio import StreamReader, StreamWriter
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from boxd.engine.agent import (
    ExecChunk,
    ExecExit,
    ExecOutcome,
    ExecOutput,
    FileStat,
    GuestStream,
    GuestUsage,
)
from boxd.net_policy import DEFAULT as DEFAULT_POLICY
from boxd.net_policy import NetPolicy


@dataclass(frozen=True)
class MachineConfig:
    """What a machine is: fixed for its whole life (forks inherit all but identity).

    ``id`` is the engine's id of the VM (its run directory and process name); it is
    the machine's id except for a standby fork child, which is prepared under its own.
    """

    id: str
    hostname: str
    vcpus: int
    memory_mib: int
    isolated: bool
    port: int | None  # loopback port forwarded to the guest's HTTP port; None when isolated
    kernel: Path
    initrd: Path
    cmdline: str  # extra kernel command line of the image (timing hints)
    # The disk's root is a container image's files (`Engine.image_roots`): the engine
    # brings the agent's runtime beside it (QEMU: boxd's guest root as a second,
    # read-only disk). Part of what the machine is: its forks and restores keep it.
    image_root: bool = False
    # host loopback ports it reaches and its egress allow-list (boxd.net_policy)
    net: NetPolicy = DEFAULT_POLICY


@dataclass(frozen=True)
class MemoryImage:
    """Frozen guest RAM plus device state at one instant (a template or a checkpoint).

    ``mem_path`` is a raw RAM file that machines map copy-on-write and ``state_path`` a
    stream of device state only; when ``mem_path`` is None the RAM is inside
    ``state_path`` (taken from a machine whose RAM is private).
    """

    mem_path: Path | None
    state_path: Path
    memory_mib: int


@dataclass(frozen=True)
class RootFile:
    """A file a machine's disk sits on, under a name of its exact bytes on every node."""

    name: str
    path: Path


#: Fetches a peer's file into the path given; returns the bytes received.
Fetcher = Callable[[Path], Awaitable[int]]


@dataclass(frozen=True)
class BootDisk:
    """The machine's writable disk layer (its backing chain is already in its header)."""

    path: Path


@dataclass(frozen=True)
class EngineInfo:
    """What ``boxd info`` shows of an engine."""

    name: str
    binary: str
    version: str
    accelerator: str
    accelerator_reason: str
    cpu_model: str
    limits: str = ""  # per-machine resource limits here (cgroups), or why there are none


class Process(Protocol):
    """A long-lived command started with `Agent.start` (stdin stays open): iterate it
    once for its output chunks and its exit."""

    exec_id: int

    def __aiter__(self) -> AsyncIterator[ExecChunk]: ...

    async def write(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def resize(self, rows: int, cols: int) -> None:
        """A new terminal size (a command started with ``pty``)."""
        ...

    async def kill(self, signal: int = 9) -> bool: ...

    async def aclose(self) -> None: ...


class Agent(Protocol):
    """The in-guest agent channel (one connection): the same protocol on every engine."""

    @property
    def connected(self) -> bool: ...

    def exec(
        self, command: str | list[str], *, env: Mapping[str, str | None] | None = None,
        cwd: str | None = None, timeout: float | None = None, stdin: bytes | None = None,
        user: str | None = None,
    ) -> AsyncIterator[ExecChunk]:
        """``user``: ``NAME[:GROUP]`` or ``UID[:GID]`` to run as (the guest's
        /etc/passwd and /etc/group name them); None: root."""
        ...

    async def run(
        self, command: str | list[str], *, env: Mapping[str, str | None] | None = None,
        cwd: str | None = None, timeout: float | None = None, stdin: bytes | None = None,
        max_output: int | None = None, user: str | None = None,
    ) -> ExecOutcome:
        """Run to the end; each stream keeps its first ``max_output`` bytes (None: all)."""
        ...

    async def start(
        self, command: str | list[str], *, env: Mapping[str, str | None] | None = None,
        cwd: str | None = None, timeout: float | None = None, user: str | None = None,
        pty: tuple[int, int] | None = None,
    ) -> Process:
        """A long-lived command whose stdin stays open (``machines.spawn``); with
        ``pty`` (rows, cols) it runs on a terminal of that size."""
        ...

    async def attach(self, exec_id: int) -> Process:
        """Follow a running long-lived command again on this connection (after a fork,
        restore or reconnect). Raises InvalidRequest when there is no such command."""
        ...

    async def write_file(
        self, path: str, data: bytes | AsyncIterable[bytes], mode: int = 0o644,
        user: str | None = None,
    ) -> FileStat:
        """Write a file from bytes or streamed chunks (atomic, digest checked), owned by
        ``user`` (with the parents it makes; None: root). Raises InvalidRequest (field
        ``user``) for a user the guest lacks or an agent too old to set an owner."""
        ...

    async def read_file(self, path: str) -> bytes: ...

    def read_stream(self, path: str) -> AsyncGenerator[bytes, None]:
        """A regular file's chunks as the consumer takes them (closing it stops the read)."""
        ...

    async def identity(
        self, *, hostname: str, machine_id: str, seed: bytes, now: float,
        api_key: str | None = None,
    ) -> None: ...

    async def set_api_key(self, api_key: str) -> None:
        """Write the in-guest API credential (protocol 1.5; cheap: boxd-init answers)."""
        ...

    def on_guest_connect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when a guest process connects to the API socket before this
        connection serves it."""
        ...

    async def sync(self, timeout: float = 60.0) -> None: ...

    async def metrics(self) -> GuestUsage:
        """The guest's CPU counters, memory and root disk use now (protocol 1.8)."""
        ...

    async def clock(self, now: float) -> None:
        """Step the guest's wall clock to ``now`` (after a wake)."""
        ...

    def supports(self, minor: int) -> bool:
        """True when the agent speaks at least protocol ``1.minor``."""
        ...

    async def serve_relay(
        self, key: str, on_stream: Callable[[GuestStream], Awaitable[None]], *,
        streams: dict[int, GuestStream] | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        """Serve the in-guest API socket with credential ``key`` until the connection
        ends, handing each guest connection to ``on_stream`` (protocol 1.5); streams
        already in ``streams`` move to this connection (see `boxd.engine.agent`)."""
        ...

    async def close(self) -> None: ...


class MachineHandle(Protocol):
    """A live machine as the engine sees it. Only the handle mutates."""

    @property
    def config(self) -> MachineConfig: ...

    @property
    def pid(self) -> int: ...

    @property
    def disk(self) -> Path:
        """The active (writable) disk layer."""
        ...

    @property
    def ram_shared(self) -> bool:
        """True when the machine owns its RAM file, so capture is cheap."""
        ...

    async def agent(self, timeout: float = 60.0) -> Agent: ...

    def alive(self) -> bool: ...

    def exit_reason(self) -> str: ...

    async def wait_exit(self) -> str:
        """Return when the VM process has ended, with the reason (for the watcher)."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def recover(self) -> str | None:
        """After a daemon restart: undo what a killed daemon left half-done (a capture
        still streaming, vCPUs left paused). Returns what was undone, or None."""
        ...

    async def freeze_disk(self, new_active: Path) -> Path:
        """Make the active layer read-only; the machine now writes ``new_active``.

        Returns the path of the frozen layer.
        """
        ...

    async def collapse_disk(self, base: Path) -> None:
        """Copy every layer between the active one and ``base`` into the active layer,
        while the guest runs; afterwards the active layer is backed by ``base``."""
        ...

    async def capture(self, dest_dir: Path) -> MemoryImage:
        """Write RAM + device state of the (paused) machine to ``dest_dir``."""
        ...

    async def destroy(self) -> None: ...

    async def detach(self) -> None:
        """Drop host-side connections; the VM keeps running (daemon restart)."""
        ...

    async def open_http(self, port: int = 8080) -> tuple[StreamReader, StreamWriter]:
        """A new connection to a guest TCP port, for the machine's URL (8080 unless the
        URL's path names another port).

        Raises:
            OSError: the machine has no network, or nothing in the guest answers on
                ``port`` (``ConnectionRefusedError``), or the engine's forward does not.
        """
        ...


class Engine(Protocol):
    """Boots, restarts and re-attaches machines; owns the disk layer format."""

    @property
    def name(self) -> str: ...

    @property
    def accelerator(self) -> str: ...

    @property
    def accelerator_reason(self) -> str: ...

    @property
    def cpu_model(self) -> str: ...

    @property
    def file_owner(self) -> tuple[int, int] | None:
        """(uid, gid) the files the VM process reopens must belong to, if not ours."""
        ...

    @property
    def portable_templates(self) -> bool:
        """True when what this engine captures for a fork (a `MemoryImage`'s two files
        and the disk layers under it) can be copied to another node that runs the same
        engine version and guest image, and started there (`receive_image`,
        `retarget_disk`): a cluster then spreads a fork batch over its nodes."""
        ...

    @property
    def portable_image_templates(self) -> bool:
        """True when a template of a machine that boots on a container image's tree
        (`image_roots`) can move as well (`portable_templates`): the receiving node's
        own root of the same image (unpacked from the same digest) stands in for the
        sender's, re-pointed by `retarget_disk` like the guest image's root. False when
        the engine's form of that root differs byte for byte between nodes while the
        template's layers sit on it block by block."""
        ...

    @property
    def image_roots(self) -> bool:
        """True when a machine can boot on a directory tree (an imported container
        image, unpacked): `create_disk` then takes that directory as a raw backing (in
        whatever form the engine boots: gVisor serves the tree, QEMU makes it a disk
        once per layer chain, a qcow2 chain on the base's ext4), and the engine brings
        its own agent runtime to a machine whose config says ``image_root``, whatever
        the tree holds."""
        ...

    def info(self) -> EngineInfo: ...

    async def boot(
        self, config: MachineConfig, disk: BootDisk, run_dir: Path, log_path: Path
    ) -> MachineHandle: ...

    async def start_from(
        self, config: MachineConfig, disk: BootDisk, image: MemoryImage, run_dir: Path,
        log_path: Path, *, copy_memory: bool, paused: bool = False,
    ) -> MachineHandle:
        """Start a machine that continues from ``image``.

        With ``copy_memory`` the machine gets its own RAM file (a sparse copy: it can be
        forked and checkpointed cheaply); otherwise it maps ``image.mem_path``
        copy-on-write (cheap to start, costs only the pages it changes). With ``paused``
        it is a standby fork child, prepared before anyone asks for it, and ``resume()``
        claims it: QEMU loads the state and the guest runs no instruction until then;
        gVisor restores the sandbox at idle CPU priority, lets it run until its agent
        answers (and its Sentry's post-restore work is done) and freezes it.
        """
        ...

    def attach(
        self, config: MachineConfig, run_dir: Path, pid: int, disk: Path, ram_shared: bool,
        log_path: Path,
    ) -> MachineHandle:
        """Find a machine's VM process again after a daemon restart.

        Raises:
            MachineFailed: the process is gone.
        """
        ...

    def kill_stray(self, vm_id: str, run_dir: Path, pid: int | None = None) -> bool:
        """Kill the VM process of ``vm_id`` that no handle owns, found by ``pid`` (the
        record's), else the run directory's pid file, else the command lines (a pid is
        trusted only while its process is that VM's). True if one was killed."""
        ...

    async def create_disk(
        self, path: Path, backing: Path, backing_format: str, size_gib: int
    ) -> None:
        """A new writable layer on ``backing`` (``raw`` image or a ``layer``)."""
        ...

    async def flatten_disk(self, layer: Path, dest: Path) -> None:
        """Write ``layer`` with its whole backing chain as one standalone disk."""
        ...

    def remove_disk(self, path: Path) -> None: ...

    async def retarget_disk(self, path: Path, backing: Path, backing_format: str) -> None:
        """Point a frozen layer copied from another node at this node's copy of its
        backing (same content, another path): the ``raw`` image or a ``layer``."""
        ...

    async def receive_image(self, image: MemoryImage, disk: Path) -> MemoryImage:
        """Make a memory image copied from another node's `capture` (its two files, as
        written there) startable here on ``disk`` (its frozen layer, retargeted);
        returns the image to start from.

        Raises:
            HostSetupError: this node lacks what the image was captured on.
        """
        ...

    def root_files(self, layer: Path, image: MemoryImage) -> tuple[RootFile, ...]:
        """The files the bottom frozen ``layer`` of a template (``image``) sits on block
        by block whose bytes another node may not have, bottom first, each named by its
        bytes (QEMU: a container image's disk chain and the guest root its agent runs
        from, or the guest root itself, or a snapshot's disk); () when every node's
        root is the same by construction (gVisor: trees, by content). A cross-node fork
        sends them along (`receive_root`)."""
        ...

    async def receive_root(self, files: Sequence[tuple[str, Fetcher]],
                           into: Path) -> Path | None:
        """The roots another node's `root_files` named (``files``: each one's name, and
        how to fetch it into a path), made here: this node's own when the bytes are the
        same, one kept from an earlier fork, or fetched once and kept. Returns what the
        bottom layer is re-pointed at (None: nothing named); what else the template
        needs goes into its directory ``into`` (QEMU: the guest root to attach).

        Raises:
            InvalidRequest: a name is not one `root_files` gives.
        """
        ...


__all__ = [
    "Agent",
    "BootDisk",
    "Engine",
    "EngineInfo",
    "ExecChunk",
    "ExecExit",
    "ExecOutcome",
    "ExecOutput",
    "Fetcher",
    "FileStat",
    "GuestStream",
    "GuestUsage",
    "MachineConfig",
    "MachineHandle",
    "MemoryImage",
    "Process",
    "RootFile",
]
