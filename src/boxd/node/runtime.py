"""The node runtime: one host's machines, on one engine, through one launch path.

Records (the control plane inserted them) name what a machine is; this module owns
what happens on the host: VM processes, disk layers and templates, standby fork
children, checkpoints, recovery after a daemon restart and sweeping what no record
knows. Every state change goes through `Lifecycle`; a watcher per VM process marks
the machine failed when it exits; reads never write.

Fork (VM templating): the source is paused once, its writable disk layer is frozen
(it gets a fresh overlay on top), its device state is written and its RAM file copied
sparsely into a *template*; the source resumes. Children map the template's RAM
privately (copy-on-write) and get their own overlay on the frozen layer. Forks asked
for while a template is being made share it; a later fork of an unchanged source
(same generation: no exec, upload or restore since) reuses it. A machine that maps an
image privately (a fork child, a machine from a snapshot) first gets RAM of its own
(`_own_ram`: state ``swapping``).

The one launch path (`_launch`) starts a VM process for all six cases — create, fork
child, start from snapshot, checkpoint restore, RAM swap and standby child — and has
one failure behaviour: the new process and the new layer are removed and the machine
is marked failed with the reason; for a machine that never ran (create, fork child,
snapshot start) the caller then removes its record, so the request fails cleanly and
the quota slot is free again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import secrets
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boxd import models
from boxd import process_models as pm
from boxd._version import __version__
from boxd.config import DEFAULT_MEMORY_MIB, Paths, Settings
from boxd.engine.base import (
    Agent,
    BootDisk,
    Engine,
    ExecOutput,
    GuestStream,
    MachineConfig,
    MachineHandle,
    MemoryImage,
)
from boxd.errors import (
    AlreadyExists,
    BoxdError,
    CheckpointNotFound,
    Conflict,
    ExecTimeout,
    HostSetupError,
    InvalidRequest,
    MachineFailed,
    MachineNotFound,
    NotFound,
    ResourceExhausted,
)
from boxd.models import MachineState
from boxd.node import _transfer as transfer
from boxd.node._host import Host
from boxd.node._ports import free_port
from boxd.node._processes import ProcessStream, ProcessTable, Relay
from boxd.node._proxy import PortProxy, Upstream, record_access
from boxd.node._spares import Spare, SparePool
from boxd.node._standby import tree_pss
from boxd.node._transfer import Fetch, FileOffer, LayerOffer, TemplateOffer
from boxd.node.base import Boot, FromSnapshot
from boxd.node.lifecycle import ASLEEP, HAS_VM, LIVE, TRANSIENT, Lease, Lifecycle, require
from boxd.services import GuestApi, GuestCaller
from boxd.state import CheckpointRecord, MachineRecord, Repos, TemplateRecord, new_id
from boxd.storage import Manifest, SnapshotStore, disks
from boxd.storage.memory import ensure_space, is_sealed, remove_tree, seal

log = logging.getLogger("boxd.node")

S = MachineState

# Backing chains longer than this are collapsed in the background (see `_collapse`).
MAX_CHAIN = 8
# Seconds past an exec's own timeout before the host gives up on a silent guest.
HOST_GRACE = 30.0
# Seconds a RAM swap waits for requests in flight on the machine to finish.
SWAP_DRAIN = 30.0
# Seconds forks of a template must pause before its taken spares are replaced (see
# `SparePool`): a burst of forks runs its work before the refill competes for the CPU.
SPARE_SETTLE = 1.0
# The agent protocol minor version that serves the in-guest API socket.
GUEST_API_MINOR = 5
# A machine's in-guest API credential (docs/lifecycle.md#in-machine-auth): told apart from
# account keys, which are "boxd_" + 32 characters.
GUEST_KEY_PREFIX = "boxdm_"
# Seconds a cold boot waits for the in-guest API socket before it answers.
GUEST_API_WAIT = 30.0
# Seconds a fork child, restored or woken machine waits before serving its API socket
# unless a guest process connects sooner (`_serve_guest_api`).
GUEST_API_DELAY = 2.0
# How long a fork waits for a standby child that is being prepared (a gVisor restore
# takes ~0.3-0.7 s here) before it starts its child from scratch.
SPARE_WAIT = 5.0


def _in_flight(rec: MachineRecord) -> Conflict:
    return Conflict(f"machine {rec.name!r} has requests in flight",
                    hint="retry when they have finished")


def host_memory_mib() -> tuple[int, int]:
    """This host's memory: (total, available) MiB, from /proc/meminfo."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) // 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return fields.get("MemTotal", 0), fields.get("MemAvailable", 0)


def node_cap(settings: Settings, total_mib: int) -> int:
    """Machines a cluster node takes: BOXD_NODE_MAX_MACHINES, else one per default-sized
    guest that fits in host memory (fork children share their template's pages, so
    this is conservative)."""
    if settings.node_max_machines > 0:
        return settings.node_max_machines
    return max(1, total_mib // DEFAULT_MEMORY_MIB)


@dataclass(frozen=True)
class Launch:
    """How to start one VM process (see the module docstring for the six cases).

    ``backing`` gets a new writable layer on top (``parent_layer`` is its layer id, or
    None when it is a base image); without it the VM keeps writing ``keep_disk``.
    ``image`` None is a cold boot.
    """

    image: MemoryImage | None
    backing: Path | None = None
    backing_format: str = "layer"
    parent_layer: str | None = None
    keep_disk: Path | None = None
    copy_memory: bool = False
    paused: bool = False
    disk_gib: int = 8


class NodeRuntime:
    """The in-process node: implements `boxd.node.base.Node`."""

    def __init__(
        self, paths: Paths, repos: Repos, host: Host, settings: Settings,
        store: SnapshotStore, *, node_id: str = "local",
    ) -> None:
        self.paths = paths
        self.store = store
        self.repos = repos
        self.host = host
        self.settings = settings
        self._id = node_id
        self.lifecycle = Lifecycle(repos.machines)
        self.live: dict[str, MachineHandle] = {}
        self._leases: dict[str, Lease] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._preparing: dict[str, asyncio.Future[TemplateRecord]] = {}
        # Fork children being started per template right now: N one-child forks in
        # flight together (the spec's rollout threads) ask for N standby children, as
        # one fork of count N does.
        self._forking: dict[str, int] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._recovered = False
        self._active: dict[str, float] = {}  # machine id -> last activity (seconds)
        self._active_written: dict[str, float] = {}
        self._idle_ops: set[str] = set()
        self._idle_task: asyncio.Task[None] | None = None
        # Layers recorded by a launch or freeze in flight that no machine points at yet:
        # a concurrent gc (a sibling's delete, a background collapse) must keep them.
        self._unreferenced: set[str] = set()
        # Templates a launch in flight maps (a fork child, a standby child being
        # prepared), counted: gc keeps them, with their layers, until the last one let go
        # (`_pin`). A stale template nothing else keeps is collected at that moment.
        self._pins: dict[str, int] = {}
        # Templates other nodes sent (cross-node forks): source id -> template id. Kept
        # while current, so further forks of that source here are copy-on-write again.
        self._received: dict[str, str] = {}
        self._receiving: dict[str, asyncio.Future[TemplateRecord]] = {}
        self._offered: dict[str, TemplateRecord] = {}  # templates peers may fetch
        self._offers: dict[str, TemplateOffer] = {}  # ... and how they were described
        self.idle_interval = 1.0
        self.procs = ProcessTable()  # spawned processes (boxd.rl): see "processes" below
        self.spares = SparePool(self, per_template=settings.fork_spares,
                                total=settings.fork_spares_total, settle=SPARE_SETTLE)
        self.proxy = PortProxy(self.connect, record_access(self.repos.machines.get))
        # The in-guest API (`serve_guests`): the handler the daemon serves relayed guest
        # connections with, each machine's current credential (sha256) and relay task.
        self.guest_api: GuestApi | None = None
        self._guest_keys: dict[str, str] = {}
        self._guest_relays: dict[str, asyncio.Task[None]] = {}
        # Relayed guest connections by machine; a RAM swap (`_own_ram`) moves them to the
        # new VM process (`_guest_keep`): the guest, the fork call it made included, runs on.
        self._guest_streams: dict[str, dict[int, GuestStream]] = {}
        self._guest_keep: set[str] = set()

    @property
    def id(self) -> str:
        return self._id

    # ------------------------------------------------------------------ helpers

    def lease(self, machine_id: str) -> Lease:
        return self._leases.setdefault(machine_id, Lease())

    def _rec(self, machine_id: str) -> MachineRecord:
        rec = self.repos.machines.get(machine_id)
        if rec is None or rec.state == S.DELETING:
            raise MachineNotFound(
                f"no machine {machine_id!r}", machine=machine_id,
                hint="`boxd machine list` shows your machines",
            )
        return rec

    def layer_path(self, layer_id: str) -> Path:
        return disks.layer_path(self.paths.disks, layer_id)

    def run_dir(self, vm_id: str) -> Path:
        return self.paths.run_dir(vm_id)

    def log_path(self, vm_id: str) -> Path:
        return self.paths.machines / vm_id / "qemu.log"

    def config_for(
        self, vm_id: str, hostname: str, *, vcpus: int, memory_mib: int, isolated: bool,
        port: int | None,
    ) -> MachineConfig:
        image = self.host.image
        return MachineConfig(
            id=vm_id, hostname=hostname, vcpus=vcpus, memory_mib=memory_mib,
            isolated=isolated, port=port,
            kernel=image.kernel if image else Path(), initrd=image.initrd if image else Path(),
            cmdline=image.cmdline_hint if image else "",
        )

    def _config(self, rec: MachineRecord) -> MachineConfig:
        return self.config_for(
            rec.vm_id, rec.name, vcpus=rec.vcpus, memory_mib=rec.memory_mib,
            isolated=rec.isolated, port=rec.fwd_port,
        )

    @staticmethod
    def failed_error(rec: MachineRecord, reason: str | None) -> MachineFailed:
        return MachineFailed(
            f"machine {rec.name!r} failed: {reason or 'unknown reason'}", machine=rec.name,
            hint=f"restore a checkpoint, or delete it (`boxd machine delete {rec.name}`) and "
            "create it again",
        )

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ----------------------------------------------------- handles and watchers

    def _install(self, machine_id: str, handle: MachineHandle) -> None:
        """Make ``handle`` the machine's VM and watch its process."""
        self.procs.detach_all(machine_id, "its VM process was replaced")
        self.live[machine_id] = handle
        old = self._watchers.pop(machine_id, None)
        if old is not None:
            old.cancel()
        self._watchers[machine_id] = asyncio.create_task(
            self._watch(machine_id, handle), name=f"watch {machine_id}"
        )

    def _retire(self, machine_id: str) -> MachineHandle | None:
        """Take the machine's VM out of service (before a deliberate destroy)."""
        self._stop_guest_api(machine_id)
        watcher = self._watchers.pop(machine_id, None)
        if watcher is not None:
            watcher.cancel()
        return self.live.pop(machine_id, None)

    async def _watch(self, machine_id: str, handle: MachineHandle) -> None:
        try:
            reason = await handle.wait_exit()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a watcher must never die silently
            reason = f"its VM process could not be watched: {exc!r}"
        self._on_exit(machine_id, handle, reason)

    def _on_exit(self, machine_id: str, handle: MachineHandle, reason: str) -> None:
        """The VM process of a machine ended: failed, unless it was replaced meanwhile."""
        if self.live.get(machine_id) is not handle:
            return  # replaced or retired on purpose: not a failure
        self._stop_guest_api(machine_id)
        self.live.pop(machine_id, None)
        self._watchers.pop(machine_id, None)
        if self.lifecycle.fail(machine_id, reason):
            log.warning("machine=%s event=failed reason=%r", machine_id, reason)
        self._spawn(handle.detach(), f"detach {machine_id}")

    # -------------------------------------------------------------- launching

    async def _launch(
        self, config: MachineConfig, launch: Launch, engine_name: str, *,
        record_layer: bool = True,
    ) -> tuple[MachineHandle, str | None]:
        """Start one VM process (the one launch path). Returns it and its new layer id.

        The new layer is recorded unless ``record_layer`` is false (a standby child's
        layer is recorded when a fork claims it). On failure nothing of the launch is
        left: no process, no new layer.
        """
        _, engine = await self.host.ready(engine_name)
        layer_id: str | None = None
        disk = launch.keep_disk
        try:
            if launch.backing is not None:
                layer_id = new_id("l")
                disk = self.layer_path(layer_id)
                await engine.create_disk(disk, launch.backing, launch.backing_format,
                                         launch.disk_gib)
                if record_layer:
                    # Recorded before anything refers to it: gc leaves it alone until
                    # `_start` has pointed the machine at it (see `_unreferenced`).
                    self._unreferenced.add(layer_id)
                    self.repos.layers.new(
                        launch.parent_layer,
                        "" if launch.parent_layer else str(launch.backing), layer_id=layer_id,
                    )
            assert disk is not None
            if launch.image is None or launch.copy_memory or launch.image.mem_path is None:
                # Its own RAM file on tmpfs: a full one would kill the guest later (SIGBUS).
                # A child mapping a template pays only for the pages it changes.
                ensure_space(self.paths.shm, config.memory_mib << 20)
            run_dir, log_path = self.run_dir(config.id), self.log_path(config.id)
            if launch.image is None:
                handle = await engine.boot(config, BootDisk(disk), run_dir, log_path)
            else:
                handle = await engine.start_from(
                    config, BootDisk(disk), launch.image, run_dir, log_path,
                    copy_memory=launch.copy_memory, paused=launch.paused,
                )
        except BaseException:
            if layer_id is not None:
                engine.remove_disk(self.layer_path(layer_id))
                self.repos.layers.drop(layer_id)
                self._unreferenced.discard(layer_id)
            raise
        return handle, layer_id

    async def _start(
        self, rec: MachineRecord, launch: Launch, *, template_id: str | None = None,
        spare: Spare | None = None, identity: bool = True, to_running: bool = True,
    ) -> MachineHandle:
        """Launch (or claim ``spare`` for) a recorded machine and put it in service.

        The record gets its layer, pid and VM id before the guest runs; the machine
        moves to ``running`` once identity is set (``identity``), or stays ``starting``
        for a cold boot (its first agent answer sets identity).

        Raises:
            BoxdError: the launch failed; the machine is failed with the reason and the
                new process and layer are gone.
        """
        handle: MachineHandle | None = None
        layer_id: str | None = None
        try:
            if spare is not None:
                handle, layer_id = spare.handle, spare.layer_id
                self._unreferenced.add(layer_id)
                self.repos.layers.new(launch.parent_layer, "", layer_id=layer_id)
                self.repos.machines.update(rec.id, vm_id=spare.vm_id, fwd_port=spare.port)
            else:
                # Each VM process gets a fresh forward; the URL's port stays the daemon's.
                self.repos.machines.update(rec.id, fwd_port=None if rec.isolated else free_port())
                rec = self._rec(rec.id)
                handle, layer_id = await self._launch(self._config(rec), launch, rec.engine)
            _, engine = await self.host.ready(rec.engine)
            fields: dict[str, object] = {"pid": handle.pid, "ram_shared": handle.ram_shared,
                                         "template_id": template_id,
                                         "accel": engine.accelerator}
            if layer_id is not None:
                fields["layer_id"] = layer_id
            self.repos.machines.update(rec.id, **fields)
            if layer_id is not None:
                self._unreferenced.discard(layer_id)
            self._install(rec.id, handle)
            if spare is not None:
                await handle.resume()
            # A new VM process, a new in-guest credential, in place before it answers:
            # in identity for a fork child or a snapshot start; else one cheap op.
            key = self._new_guest_key(rec) if identity or to_running else None
            if identity:
                await self._set_identity(rec.name, handle, api_key=key)
            elif key is not None:
                await (await handle.agent(timeout=60.0)).set_api_key(key)
        except BaseException as exc:
            reason = exc.message if isinstance(exc, BoxdError) else repr(exc)
            if handle is not None:
                self._retire(rec.id)
                with contextlib.suppress(Exception):
                    await handle.destroy()
            if layer_id is not None:
                self._unreferenced.discard(layer_id)
                _, engine = await self.host.ready(rec.engine)
                engine.remove_disk(self.layer_path(layer_id))
                if launch.keep_disk is None:
                    self.repos.machines.update(rec.id, layer_id=None)
                self.repos.layers.drop(layer_id)
            self.lifecycle.fail(rec.id, f"launch failed: {reason}")
            raise
        if to_running and not self.lifecycle.move(rec.id, S.RUNNING, expect=(rec.state,)):
            fresh = self._rec(rec.id)  # its new process died at once: the watcher said why
            raise self.failed_error(fresh, fresh.error)
        if rec.port and not self.proxy.is_open(rec.id):
            await self.proxy.open(rec.id, rec.port)
        self._serve_guest_api(rec, handle, key, lazy=True)  # a cold boot's: its first answer
        return handle

    async def _set_identity(
        self, hostname: str, handle: MachineHandle, timeout: float = 60.0,
        api_key: str | None = None,
    ) -> None:
        """A new machine-id, a reseeded RNG and the host's clock (and the hostname; and
        the in-guest API credential when given)."""
        agent = await handle.agent(timeout=timeout)
        await agent.identity(
            hostname=hostname, machine_id=secrets.token_hex(16), seed=os.urandom(64),
            now=time.time(), api_key=api_key,
        )

    # ------------------------------------------------------------------ create

    async def host_info(self) -> models.HostInfo:
        image, engine = await self.host.ready()
        info = engine.info()
        engines = [
            models.EngineInfo(name=e.name, status=e.status, reason=e.reason,
                              accelerator=e.accelerator or None, default=e.name == info.name)
            for e in await self.host.describe()
        ]
        return models.HostInfo(
            version=__version__, engine=info.name, qemu=info.binary, qemu_version=info.version,
            accelerator=info.accelerator, accelerator_reason=info.accelerator_reason,
            cpu_model=info.cpu_model, data_dir=str(self.paths.home), image=image.key,
            engines=engines, engine_reason=self.host.default_reason,
            limits=info.limits or None, standby_forks=len(standby := self.spares.ready()),
            standby_memory_bytes=tree_pss(s.handle.pid for s in standby),
        )

    async def info(self) -> models.NodeInfo:
        total, free = host_memory_mib()
        return models.NodeInfo(
            id=self.id, address="127.0.0.1", health="alive",
            machines=len(self.repos.machines.on_node(self.id)),
            max_machines=node_cap(self.settings, total), memory_total_mib=total,
            memory_free_mib=free, engine=self.settings.engine, error=None,
        )

    async def image_key(self) -> str:
        image, _ = await self.host.ready()
        return image.key

    async def engine_name(self) -> str:
        """The engine new machines get unless they ask for one."""
        _, engine = await self.host.ready()
        return engine.name

    async def create(self, machine_id: str, source: Boot | FromSnapshot) -> None:
        rec = self._rec(machine_id)
        try:
            image, _ = await self.host.ready(rec.engine)
        except BaseException:
            await self.purge(machine_id)  # its engine cannot run here: no record is left
            raise
        port = None if rec.isolated else free_port()
        self.repos.machines.update(machine_id, port=port)
        rec = self._rec(machine_id)
        try:
            async with self.lease(machine_id).op():
                if isinstance(source, Boot):
                    await self._start(
                        rec, Launch(None, backing=image.rootfs, backing_format="raw",
                                    disk_gib=rec.disk_gib),
                        identity=False, to_running=False,
                    )
                else:
                    await self._start(rec, Launch(
                        MemoryImage(source.memory, source.state, rec.memory_mib),
                        backing=source.disk, backing_format="layer", disk_gib=rec.disk_gib,
                    ))
        except BaseException:
            await self.purge(machine_id)
            raise
        log.info("machine=%s event=created name=%s", machine_id, rec.name)

    # -------------------------------------------------------------- agent use

    @contextlib.asynccontextmanager
    async def _using(
        self, machine_id: str, timeout: float = 120.0
    ) -> AsyncIterator[tuple[MachineRecord, MachineHandle, Agent]]:
        """The machine's VM and agent for one request, held against a swap or suspend.

        A request that finds the machine in a transient state waits for the operation
        in progress; one that finds it suspended or hibernated wakes it (concurrent
        requests share one wake: the first wakes, the others wait for its lease); the
        first request to a cold-booted machine sets its identity. The request counts
        as activity for the idle timers.
        """
        lease = self.lease(machine_id)
        while True:
            rec = self._rec(machine_id)
            if rec.state != S.RUNNING:
                if rec.state == S.FAILED:
                    raise self.failed_error(rec, rec.error)
                async with lease.op():
                    await self._awake(self._rec(machine_id), timeout)
            async with lease.use():
                rec = self._rec(machine_id)
                self.lifecycle.saw(rec)
                if rec.state != S.RUNNING:
                    continue  # suspended or replaced between the wake and the gate
                handle = self.live.get(machine_id)
                if handle is None:
                    raise self.failed_error(rec, "its VM process is not running")
                self._touch(machine_id)
                try:
                    agent = await handle.agent(timeout=timeout)
                    yield rec, handle, agent
                except MachineFailed as exc:
                    self._rec(machine_id)  # deleted meanwhile: MachineNotFound, not a 503
                    await self._raise_if_died(rec, handle, exc)
                    raise
                finally:
                    self._touch(machine_id)
                return

    async def _awake(self, rec: MachineRecord, timeout: float = 120.0) -> MachineRecord:
        """Bring a machine to ``running`` (the caller holds its lease): set a cold-booted
        one's identity, resume a suspended one, restore a hibernated one.

        Raises:
            MachineFailed: it is failed, or waking it failed (it is failed now).
            QuotaExceeded: waking a hibernated machine would exceed its account's quota.
            StateError: it is in a state nothing wakes it from.
        """
        if rec.state == S.FAILED:
            raise self.failed_error(rec, rec.error)
        if rec.state == S.STARTING:
            await self._first_answer(rec, timeout)
        elif rec.state == S.SUSPENDED:
            await self._resume(rec)
        elif rec.state == S.HIBERNATED:
            await self._wake(rec)
        fresh = self._rec(rec.id)
        if fresh.state == S.FAILED:
            raise self.failed_error(fresh, fresh.error)
        return require(fresh, S.RUNNING)

    async def _raise_if_died(
        self, rec: MachineRecord, handle: MachineHandle, exc: MachineFailed
    ) -> None:
        """After the agent channel broke: if the VM died, fail the machine and say why.

        A dying VM closes its sockets before it is gone: give it a moment, so the answer
        names the cause (a signal, the log's last lines), not only the broken channel.
        """
        if handle.alive():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handle.wait_exit(), timeout=2.0)
        if not handle.alive():
            self._on_exit(rec.id, handle, handle.exit_reason())
            raise self.failed_error(rec, handle.exit_reason()) from exc

    async def _first_answer(self, rec: MachineRecord, timeout: float) -> None:
        """A cold-booted machine's agent answered: its own machine-id, a reseeded RNG
        and the host's wall clock (the RTC only has seconds); then it is running."""
        handle = self.live.get(rec.id)
        if handle is None:
            raise self.failed_error(rec, "its VM process is not running")
        try:
            key = self._new_guest_key(rec)
            await self._set_identity(rec.name, handle, timeout, api_key=key)
        except MachineFailed as exc:
            await self._raise_if_died(rec, handle, exc)
            raise
        self.lifecycle.move(rec.id, S.RUNNING, expect=(S.STARTING,))
        # Not on a hot path: `wait_until_ready` answers once the socket is served.
        await self._guest_api_started(self._serve_guest_api(rec, handle, key))

    # ------------------------------------------------------- the in-guest API

    def serve_guests(self, handler: GuestApi) -> None:
        """Serve each non-isolated machine's in-guest API socket with ``handler``.

        Every VM process (boot, fork child, restore, wake, a RAM swap, a daemon restart)
        gets its own credential, in the guest before the start answers; nothing is
        served without a handler.
        """
        self.guest_api = handler

    def guest_key_hash(self, machine_id: str) -> str | None:
        """The sha256 of a machine's current in-guest credential (None: it has none)."""
        return self._guest_keys.get(machine_id)

    def _new_guest_key(self, rec: MachineRecord) -> str | None:
        """A new credential for the machine's new VM process (None: it gets none)."""
        if self.guest_api is None or rec.isolated:
            return None  # an isolated machine gets no credential and no route
        secret = GUEST_KEY_PREFIX + secrets.token_urlsafe(24)
        self._guest_keys[rec.id] = hashlib.sha256(secret.encode()).hexdigest()
        return secret

    def _serve_guest_api(
        self, rec: MachineRecord, handle: MachineHandle, secret: str | None, *,
        lazy: bool = False,
    ) -> asyncio.Future[None] | None:
        """Serve the machine's API socket on its (new) VM process, in the background; the
        future is done once the agent serves it.

        ``lazy`` (a fork child, a restore, a wake): the guest holds its credential
        already; serving the socket runs Python in the guest, which a fresh VM process
        under TCG pays for in translation, so it waits until a guest process connects or
        `GUEST_API_DELAY` has passed (which also cuts copies of calls in flight then)."""
        if secret is None or self.guest_api is None:
            return None
        task = self._guest_relays.pop(rec.id, None)
        if task is not None:
            task.cancel()
        if rec.id in self._guest_keep:
            self._guest_keep.discard(rec.id)
            lazy = not self._guest_streams.get(rec.id)  # calls in flight wait for it
        else:
            self._end_guest_streams(rec.id)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._guest_relays[rec.id] = asyncio.create_task(
            self._guest_relay(rec.id, rec.account_id, handle, started, secret,
                              GUEST_API_DELAY if lazy else 0.0),
            name=f"guest-api {rec.id}")
        return started

    async def _guest_api_started(self, started: asyncio.Future[None] | None) -> None:
        """Wait (briefly) until the agent serves the socket."""
        if started is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(started), GUEST_API_WAIT)

    def _stop_guest_api(self, machine_id: str) -> None:
        """Revoke the machine's credential and stop serving its socket."""
        self._guest_keys.pop(machine_id, None)
        task = self._guest_relays.pop(machine_id, None)
        if task is not None:
            task.cancel()
        if machine_id not in self._guest_keep:
            self._end_guest_streams(machine_id)

    def _end_guest_streams(self, machine_id: str) -> None:
        for stream in self._guest_streams.pop(machine_id, {}).values():
            stream.end()

    async def _guest_relay(self, machine_id: str, account_id: str, handle: MachineHandle,
                           started: asyncio.Future[None], secret: str, delay: float) -> None:
        """Serve one VM's API socket, with its credential, on each of its agent
        connections while that VM is the machine's (after ``delay``, or sooner when a
        guest process connects)."""
        if delay > 0:
            wanted = asyncio.Event()
            try:
                (await handle.agent(timeout=60.0)).on_guest_connect(wanted.set)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wanted.wait(), delay)
            except BoxdError:
                pass  # the loop below finds out
        streams = self._guest_streams.setdefault(machine_id, {})
        caller = GuestCaller(machine_id, account_id,
                             functools.partial(self.guest_key_hash, machine_id))

        def on_started() -> None:
            if not started.done():
                started.set_result(None)

        try:
            while self.live.get(machine_id) is handle and self.guest_api is not None:
                try:
                    agent = await handle.agent(timeout=60.0)
                    if not agent.supports(GUEST_API_MINOR):
                        log.info("machine=%s event=no_guest_api reason=old_agent", machine_id)
                        return
                    await agent.serve_relay(secret, functools.partial(self.guest_api, caller),
                                            streams=streams, on_started=on_started)
                except BoxdError as exc:
                    log.info("machine=%s event=guest_api_stopped reason=%r", machine_id,
                             exc.message)
                    if not handle.alive():
                        return
                await asyncio.sleep(0.5)  # the connection broke: serve the next one
        finally:
            on_started()  # nobody waits for a relay that is not coming

    @contextlib.asynccontextmanager
    async def connect(self, machine_id: str) -> AsyncIterator[Upstream]:
        """For the URL proxy: wake the machine, hold it awake, yield how to open a
        connection to its port 8080 (the engine's forward)."""
        async with self._using(machine_id) as (rec, handle, _agent):
            if rec.fwd_port is None:
                raise InvalidRequest(f"machine {rec.name!r} has no network (isolated)")
            yield handle.open_http

    async def wait_until_ready(self, machine_id: str, timeout: float) -> None:
        async with self._using(machine_id, timeout=timeout):
            pass

    @staticmethod
    def _exec_kwargs(req: models.ExecRequest) -> dict[str, Any]:
        return {
            "env": req.env or None, "cwd": req.cwd, "timeout": req.timeout,
            "stdin": req.stdin.encode() if req.stdin is not None else None,
        }

    def _changed(self, machine_id: str) -> None:
        """The guest may change: the next fork needs a new template."""
        self.repos.machines.bump_generation(machine_id)
        self.spares.prune()  # a changed source's standby children are stale

    async def exec(self, machine_id: str, req: models.ExecRequest) -> models.ExecResult:
        async with self._using(machine_id) as (rec, _handle, agent):
            self._changed(machine_id)
            # The guest enforces the timeout; the host deadline only catches a guest that
            # stopped answering altogether (a VM left paused, a hung kernel).
            deadline = req.timeout + HOST_GRACE if req.timeout else None
            try:
                out = await asyncio.wait_for(
                    agent.run(req.command, **self._exec_kwargs(req),
                              max_output=self.settings.max_exec_output),
                    timeout=deadline,
                )
            except TimeoutError as exc:
                raise MachineFailed(
                    f"machine {rec.name!r} stopped answering: the command's {req.timeout}s "
                    f"timeout passed {HOST_GRACE:.0f}s ago with no word from the guest",
                    machine=rec.name, hint="check `boxd machine info`; delete and recreate it",
                ) from exc
        result = models.ExecResult(
            stdout=out.stdout.decode(errors="replace"), stderr=out.stderr.decode(errors="replace"),
            exit_code=out.exit_code, signal=out.signal, timed_out=out.timed_out,
            duration=out.duration, stdout_truncated=out.stdout_truncated,
            stderr_truncated=out.stderr_truncated,
        )
        if result.timed_out:
            raise ExecTimeout(
                f"command timed out after {req.timeout}s and was killed",
                timeout=req.timeout, stdout=result.stdout, stderr=result.stderr,
                hint="raise the timeout or make the command finish sooner",
            )
        return result

    async def exec_stream(
        self, machine_id: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        async with self._using(machine_id) as (_, _handle, agent):
            self._changed(machine_id)
            async for item in agent.exec(req.command, **self._exec_kwargs(req)):
                if isinstance(item, ExecOutput):
                    yield models.ExecEvent(
                        type=item.stream, data=item.data.decode(errors="replace"), error=None
                    )
                else:
                    yield models.ExecEvent(
                        type="exit", exit_code=item.exit_code, signal=item.signal,
                        timed_out=item.timed_out, duration=item.duration, error=None,
                    )

    async def upload(
        self, machine_id: str, path: str, data: bytes | AsyncIterable[bytes], mode: int
    ) -> models.FileInfo:
        if not path.startswith("/"):
            raise InvalidRequest(f"guest path must be absolute: {path!r}", field="path")
        async with self._using(machine_id) as (_, _handle, agent):
            self._changed(machine_id)
            st = await agent.write_file(path, data, mode)
        return models.FileInfo(path=path, size=st.size, mode=st.mode, sha256=st.sha256)

    async def download(self, machine_id: str, path: str) -> AsyncGenerator[bytes, None]:
        if not path.startswith("/"):
            raise InvalidRequest(f"guest path must be absolute: {path!r}", field="path")
        # The machine stays awake (and leased) while the consumer reads; closing this
        # iterator stops the read in the guest.
        async with (
            self._using(machine_id) as (_, _handle, agent),
            contextlib.aclosing(agent.read_stream(path)) as chunks,
        ):
            async for chunk in chunks:
                yield chunk

    # ---------------------------------------------------- processes (boxd.rl)
    # A spawned process keeps running between requests; its frames are relayed by
    # `boxd.node._processes`. Sends go through `_using` (they wake a sleeping machine
    # and count as activity); a frame sent and not yet answered keeps the idle timers
    # off. The first send after a template was taken bumps the generation, so a later
    # fork never reuses a template from before the process changed the guest.

    async def spawn(self, machine_id: str, req: pm.SpawnRequest) -> pm.Process:
        if req.cwd is not None and not req.cwd.startswith("/"):
            raise InvalidRequest(f"cwd must be absolute: {req.cwd!r}", field="cwd")
        async with self._using(machine_id) as (_, _handle, agent):
            self._changed(machine_id)
            proc = await agent.start(req.argv, env=req.env or None, cwd=req.cwd)
            relay = self.procs.add(machine_id, list(req.argv), proc,
                                   lambda: self._touch(machine_id))
        relay.dirty = True
        log.info("machine=%s event=spawned process=%s argv0=%s", machine_id, relay.id,
                 req.argv[0])
        return relay.model()

    async def processes(self, machine_id: str) -> list[pm.Process]:
        self._rec(machine_id)
        return [r.model() for r in self.procs.list(machine_id)]

    async def process_kill(self, machine_id: str, process_id: str, signal: int) -> pm.Process:
        relay = self.procs.get(machine_id, process_id)
        if relay.state == "detached":
            await self._reattach_process(relay)
        if relay.process is not None:
            async with self._using(machine_id):
                await relay.process.kill(signal)
        return relay.model()

    @contextlib.asynccontextmanager
    async def process_attach(
        self, machine_id: str, process_id: str
    ) -> AsyncIterator[ProcessStream]:
        relay = self.procs.get(machine_id, process_id)
        if relay.attached:
            raise Conflict(f"process {process_id} already has a client attached",
                           machine=machine_id, hint="close the other handle first")
        if relay.state == "detached":
            await self._reattach_process(relay)
        relay.attached = True
        try:
            yield ProcessStream(relay, self.process_send, self._reattach_process)
        finally:
            relay.attached = False

    async def _reattach_process(self, relay: Relay) -> None:
        """Follow a detached process again on the machine's current agent connection.

        The guest keys the process by the exec id it had when the guest's memory was
        captured (a restore brings back an older one than the last attach), so the ids
        are tried newest first.
        """
        async with relay.attaching, self._using(relay.machine_id) as (_, _handle, agent):
            if relay.state == "running" and relay.process is not None:
                return  # another request re-attached it meanwhile
            last: BoxdError | None = None
            for exec_id in reversed(relay.exec_ids or [relay.exec_id]):
                try:
                    proc = await agent.attach(exec_id)
                except InvalidRequest as exc:  # not this id (or an agent too old)
                    last = exc
                    continue
                relay.bind(proc, lambda: self._touch(relay.machine_id))
                return
            relay.failure = last.message if last is not None else "no exec id"
            raise relay.not_running()

    async def process_send(self, relay: Relay, data: bytes) -> None:
        if relay.state == "detached":
            await self._reattach_process(relay)
        machine_id = relay.machine_id
        if relay.dirty and self.lifecycle.is_running(machine_id):
            # The hot path (boxd.rl's steps): a running machine as this node last saw it,
            # so no database read per frame; the lease still holds it against a swap.
            async with self.lease(machine_id).use():
                if self.lifecycle.is_running(machine_id) and relay.state == "running":
                    self._touch(machine_id)
                    try:
                        await relay.send(data)
                    except MachineFailed as exc:
                        handle = self.live.get(machine_id)
                        if handle is not None:
                            await self._raise_if_died(self._rec(machine_id), handle, exc)
                        raise
                    return
        async with self._using(machine_id):
            if not relay.dirty:
                self._changed(relay.machine_id)
                relay.dirty = True
            await relay.send(data)

    def _processes_captured(self, machine_id: str) -> None:
        """A template of the machine is being taken: the next send changes it again."""
        for r in self.procs.list(machine_id):
            r.dirty = False

    # ------------------------------------------------------------------ delete

    async def delete(self, machine_id: str) -> None:
        rec = self._rec(machine_id)
        lease = self.lease(machine_id)
        async with lease.op(), lease.replace():
            if not self.lifecycle.move(machine_id, S.DELETING):
                self._rec(machine_id)  # gone meanwhile: MachineNotFound
            await self.purge(machine_id)
        log.info("machine=%s event=deleted name=%s", machine_id, rec.name)

    async def purge(self, machine_id: str) -> None:
        """Stop the VM and remove every file and record of a machine."""
        rec = self.repos.machines.get(machine_id)
        await self.proxy.close(machine_id)
        handle = self._retire(machine_id)
        if handle is not None:
            await handle.destroy()
        if handle is None and rec is not None and rec.pid:
            _, engine = await self.host.ready(rec.engine)
            engine.kill_stray(rec.vm_id, self.run_dir(rec.vm_id), rec.pid)
        for ck_id in self.repos.checkpoints.delete_for(machine_id):
            remove_tree(self.paths.checkpoints / ck_id)
        self.repos.machines.delete(machine_id)
        # In a thread: a RAM file or a hibernation image is GiBs to free, which would
        # hold every other request up for as long.
        dirs = [self.paths.hibernated / machine_id]
        if rec is not None:
            dirs += [self.run_dir(rec.vm_id), self.paths.machines / rec.vm_id]
        for d in dirs:
            await asyncio.to_thread(remove_tree, d)
        self._leases.pop(machine_id, None)
        self._active.pop(machine_id, None)
        await self.procs.drop(machine_id)
        self.gc()

    def gc(self) -> None:
        """Remove templates and disk layers nothing refers to any more."""
        garbage = self.repos.layers.collect(
            keep=self._unreferenced, keep_templates={*self._received.values(), *self._pins}
        )
        for tid in [t for t in self._offered if self.repos.layers.template(t) is None]:
            del self._offered[tid]
            self._offers.pop(tid, None)
        for d in garbage.template_dirs:
            remove_tree(d)
        for lid in garbage.layer_ids:
            disks.remove(self.layer_path(lid))
        self.spares.prune()

    def _pin(self, tpl: TemplateRecord) -> None:
        """Keep ``tpl`` (its row, files and layers) while a launch from it is in flight.

        Raises:
            Conflict: it was collected already (its source changed or was deleted, and
                nothing mapped it): the caller takes the source's current one, or fails.
        """
        if self.repos.layers.template(tpl.id) is None or not tpl.state_path.exists():
            raise Conflict(f"template {tpl.id} was collected meanwhile",
                           hint="its source changed or was deleted; fork again")
        self._pins[tpl.id] = self._pins.get(tpl.id, 0) + 1

    def _unpin(self, template_id: str) -> None:
        """One launch from the template finished; the last one collects it if stale."""
        left = self._pins.get(template_id, 0) - 1
        if left > 0:
            self._pins[template_id] = left
            return
        self._pins.pop(template_id, None)
        if not self.repos.layers.template_is_current(template_id):
            self.gc()

    @contextlib.contextmanager
    def _pinned(self, tpl: TemplateRecord) -> Iterator[None]:
        self._pin(tpl)
        try:
            yield
        finally:
            self._unpin(tpl.id)

    # -------------------------------------------------------------------- fork

    async def _freeze_and_capture(
        self, rec: MachineRecord, handle: MachineHandle, dest: Path, *, resume: bool = True
    ) -> tuple[str, MemoryImage]:
        """Pause, freeze the disk, capture memory + device state into ``dest``, resume.

        Returns the frozen layer id and the memory image. The source is resumed
        whatever happens, unless ``resume`` is false (hibernate: the VM ends next, and
        on failure the caller resumes it).
        """
        assert rec.layer_id is not None
        frozen_id = rec.layer_id
        new_layer = new_id("l")
        self._unreferenced.add(new_layer)
        self.repos.layers.new(frozen_id, "", layer_id=new_layer)
        t0 = time.monotonic()
        await handle.pause()
        try:
            try:
                await handle.freeze_disk(self.layer_path(new_layer))
                self.repos.layers.freeze(rec.id, frozen_id, new_layer)
            finally:
                self._unreferenced.discard(new_layer)
            image = await handle.capture(dest)
        finally:
            if resume and handle.alive():
                await handle.resume()
        log.info("machine=%s event=captured downtime=%.3f", rec.id, time.monotonic() - t0)
        if len(self.repos.layers.chain(new_layer)) > MAX_CHAIN:
            self._spawn(self._collapse(rec.id), f"collapse {rec.id}")
        return frozen_id, image

    async def _collapse(self, machine_id: str) -> None:
        """Shorten a machine's backing chain to active layer → base (in the background).

        Each fork of a changed source and each checkpoint adds a frozen layer under the
        machine's active one; long chains slow every disk read. The layers stay as long
        as children, templates or checkpoints use them, and are collected after.
        """
        try:
            async with self.lease(machine_id).op():
                rec = self.repos.machines.get(machine_id)
                handle = self.live.get(machine_id)
                if rec is None or rec.state != S.RUNNING or handle is None:
                    return
                chain = self.repos.layers.chain(rec.layer_id)
                if len(chain) <= MAX_CHAIN or rec.layer_id is None:
                    return
                base = chain[-1].base
                t0 = time.monotonic()
                await handle.collapse_disk(Path(base))
                self.repos.layers.rebase(rec.layer_id, base)
                self.gc()
                log.info("machine=%s event=collapsed layers=%d seconds=%.2f",
                         machine_id, len(chain), time.monotonic() - t0)
        except BoxdError as exc:
            log.warning("machine=%s event=collapse_failed error=%s", machine_id, exc)

    async def _own_ram(self, rec: MachineRecord) -> MachineHandle:
        """Give a machine that maps an image privately a RAM file of its own.

        Needed once before such a machine is forked or saved: its whole RAM is streamed
        to a file and a new VM process (same id, name, port and disk) loads it. The
        caller holds the machine's lease; the machine is ``swapping`` meanwhile and
        requests that need it wait.
        """
        handle = self.live.get(rec.id)
        if handle is None:
            raise self.failed_error(rec, "its VM process is not running")
        if handle.ram_shared:
            return handle
        tmp = self.paths.shm / "tmp" / new_id("p")
        async with self.lease(rec.id).replace(drain=SWAP_DRAIN):
            rec = self.lifecycle.begin(rec, S.SWAPPING, S.RUNNING)
            try:
                try:
                    await handle.pause()
                    image = await handle.capture(tmp)
                except BaseException:
                    if handle.alive():
                        await handle.resume()
                    self.lifecycle.move(rec.id, S.RUNNING, expect=(S.SWAPPING,))
                    raise
                self._guest_keep.add(rec.id)  # the same guest runs on: so do its calls
                self._retire(rec.id)
                await handle.destroy()
                new = await self._start(
                    rec, Launch(image, keep_disk=handle.disk, copy_memory=True,
                                disk_gib=rec.disk_gib),
                    identity=False,
                )
            finally:
                remove_tree(tmp)
                if rec.id in self._guest_keep:  # the new process did not start
                    self._guest_keep.discard(rec.id)
                    self._end_guest_streams(rec.id)
        self.gc()
        return new

    async def _template(self, source_id: str) -> TemplateRecord:
        """The template children of this source start from, pinned (the caller unpins
        it, see `_pin`): reused or made once.

        A fork that waited for a template being made may find it collected by the time
        it runs (the source changed and a gc ran in between): it takes the source's
        current one instead, made anew if need be.

        Raises:
            MachineNotFound: the source is gone (deleted meanwhile).
            Conflict: the source kept changing under the fork.
        """
        for _ in range(3):
            tpl = await self._template_once(source_id)
            with contextlib.suppress(Conflict):
                self._pin(tpl)  # no await since it was read: a gc cannot come between
                return tpl
            self._rec(source_id)  # deleted: MachineNotFound
        raise Conflict(f"machine {self._rec(source_id).name!r} changed while it was forked",
                       hint="retry the fork")

    async def _template_once(self, source_id: str) -> TemplateRecord:
        rec = self._rec(source_id)
        existing = self.repos.layers.template_for(source_id, rec.generation)
        if existing is not None and existing.mem_path.exists():
            return existing
        pending = self._preparing.get(source_id)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[TemplateRecord] = asyncio.get_running_loop().create_future()
        self._preparing[source_id] = fut
        try:
            async with self.lease(source_id).op():
                rec = await self._awake(self._rec(source_id))
                handle = await self._own_ram(rec)
                rec = self._rec(source_id)
                self._processes_captured(source_id)
                await self._flush_page_cache(handle)
                template_id = new_id("t")
                frozen_id, image = await self._freeze_and_capture(
                    rec, handle, self.paths.templates / template_id
                )
                assert image.mem_path is not None
                tpl = self.repos.layers.add_template(
                    source_id, frozen_id, image.mem_path, image.state_path, rec.generation,
                    template_id=template_id,
                )
            fut.set_result(tpl)
            return tpl
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            self._preparing.pop(source_id, None)

    async def _flush_page_cache(self, handle: MachineHandle) -> None:
        """Write the source's dirty page cache to its disk before it is frozen.

        Otherwise every child inherits the same dirty pages and writes each of them
        into its own overlay. Only kernel state changes; best effort.
        """
        try:
            agent = await handle.agent(timeout=30)
            await agent.sync(timeout=60)
        except BoxdError as exc:
            log.warning("machine=%s event=sync_failed error=%s", handle.config.id, exc)

    def template_image(self, tpl: TemplateRecord, memory_mib: int) -> MemoryImage:
        return MemoryImage(tpl.mem_path, tpl.state_path, memory_mib)

    async def _fork_source(self, source_id: str) -> tuple[MachineRecord, TemplateRecord]:
        """Check a fork's source, wake it if needed, and get its template (pinned: the
        caller unpins it)."""
        src = self._rec(source_id)
        if src.state == S.FAILED:
            raise self.failed_error(src, src.error)
        if src.state in TRANSIENT:
            async with self.lease(source_id).op():
                pass
            src = self._rec(source_id)
        require(src, *LIVE, *ASLEEP)
        if src.state == S.STARTING:
            await self.wait_until_ready(source_id, timeout=120)
        self._touch(source_id)
        tpl = await self._template(source_id)
        try:
            return self._rec(source_id), tpl
        except BaseException:
            self._unpin(tpl.id)
            raise

    async def fork(self, source_id: str, child_ids: list[str]) -> list[Exception | None]:
        # The template stays pinned until every child is started (each then maps it:
        # its record names it) or gone: a delete of the source or a change and a gc
        # meanwhile leave its files and layers alone.
        src, tpl = await self._fork_source(source_id)
        try:
            demand = self._forking[tpl.id] = self._forking.get(tpl.id, 0) + len(child_ids)
            try:
                results = await asyncio.gather(
                    *(self._start_child(src, tpl, cid) for cid in child_ids),
                    return_exceptions=True,
                )
            finally:
                self._forking[tpl.id] -= len(child_ids)
                if not self._forking[tpl.id]:
                    del self._forking[tpl.id]
            self.spares.want(source_id, tpl, demand)
        finally:
            self._unpin(tpl.id)
        out: list[Exception | None] = []
        for cid, r in zip(child_ids, results, strict=True):
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            out.append(r if isinstance(r, Exception) else None)
            if r is None:
                self.procs.inherit(source_id, cid)
        return out

    async def warm(self, source_id: str, forks: int) -> models.Standby:
        """Keep ``forks`` standby children of the source's current state (see
        `SparePool.warm`); 0 releases them without making a template."""
        src = self._rec(source_id)
        if forks == 0:
            tpl = self.repos.layers.template_for(source_id, src.generation)
            if tpl is not None:
                await self.spares.warm(source_id, tpl, 0)
            return self._standby(src, tpl)
        if self.spares.total == 0:
            raise ResourceExhausted("standby forks are off on this node "
                                    "(BOXD_FORK_SPARES_TOTAL=0)",
                                    hint="set BOXD_FORK_SPARES_TOTAL above 0")
        src, tpl = await self._fork_source(source_id)
        try:
            count, why = await self.spares.warm(source_id, tpl, forks)
        finally:
            self._unpin(tpl.id)
        log.info("machine=%s event=warmed template=%s forks=%d of=%d", source_id, tpl.id,
                 count, forks)
        if count < forks:
            raise ResourceExhausted(
                f"{count} of {forks} standby forks of {src.name!r} are ready: {why}",
                hint="ask for fewer, or free host memory (BOXD_FORK_SPARES_TOTAL caps the "
                "standby forks of a node)")
        return self._standby(src, tpl)

    def _standby(self, src: MachineRecord, tpl: TemplateRecord | None) -> models.Standby:
        ready = self.spares.ready(tpl.id) if tpl is not None else []
        return models.Standby(machine_id=src.id, forks=len(ready), engine=src.engine,
                              memory_bytes=tree_pss(s.handle.pid for s in ready))

    async def _start_child(self, src: MachineRecord, tpl: TemplateRecord, child_id: str) -> None:
        if not src.isolated:
            self.repos.machines.update(child_id, port=free_port())  # its URL
        rec = self._rec(child_id)
        t0 = time.monotonic()
        spare = await self.spares.claim(tpl.id, timeout=SPARE_WAIT)
        launch = Launch(
            self.template_image(tpl, src.memory_mib), backing=self.layer_path(tpl.layer_id),
            parent_layer=tpl.layer_id, disk_gib=src.disk_gib,
        )
        try:
            async with self.lease(child_id).op():
                await self._start(rec, launch, template_id=tpl.id, spare=spare)
        except BaseException as exc:
            await self.purge(child_id)
            if isinstance(exc, BoxdError):
                exc.message = f"fork child {rec.name!r} failed: {exc.message}"
                exc.args = (exc.message,)
            raise
        log.info("machine=%s event=forked source=%s spare=%s seconds=%.3f", child_id, src.id,
                 spare is not None, time.monotonic() - t0)

    async def prepare_spare(self, source_id: str, tpl: TemplateRecord) -> Spare:
        """A standby child of ``tpl``: launched paused, no record (see `SparePool`)."""
        src = self._rec(source_id)
        await self.host.ready(src.engine)
        vm_id = new_id("m")
        port = None if src.isolated else free_port()
        config = self.config_for(vm_id, src.name, vcpus=src.vcpus, memory_mib=src.memory_mib,
                                 isolated=src.isolated, port=port)
        try:
            # Pinned while it launches (it maps the template's files); once prepared it
            # lives only while the template is current (`SparePool.prune`).
            with self._pinned(tpl):
                handle, layer_id = await self._launch(config, Launch(
                    self.template_image(tpl, src.memory_mib),
                    backing=self.layer_path(tpl.layer_id), parent_layer=tpl.layer_id,
                    paused=True, disk_gib=src.disk_gib,
                ), src.engine, record_layer=False)
        except BaseException:
            remove_tree(self.run_dir(vm_id))
            remove_tree(self.paths.machines / vm_id)
            raise
        assert layer_id is not None
        return Spare(vm_id, layer_id, port, handle)

    def remove_spare_files(self, spare: Spare) -> None:
        disks.remove(self.layer_path(spare.layer_id))
        remove_tree(self.run_dir(spare.vm_id))
        remove_tree(self.paths.machines / spare.vm_id)

    def template_is_current(self, template_id: str) -> bool:
        return self.repos.layers.template_is_current(template_id)

    # ------------------------------------------- cross-node transfer (boxd.node.ray)

    async def offer_template(self, source_id: str) -> TemplateOffer:
        """The source's template (made if needed), described for a peer node to fetch
        (see `boxd.node._transfer`). A cross-node fork writes nothing else here."""
        src, tpl = await self._fork_source(source_id)
        try:  # pinned while described; a peer fetching a template collected since: NotFound
            return await self._offer(src, tpl)
        finally:
            self._unpin(tpl.id)

    async def _offer(self, src: MachineRecord, tpl: TemplateRecord) -> TemplateOffer:
        if src.engine != "qemu":
            raise InvalidRequest(
                f"machine {src.name!r} runs on the {src.engine} engine; only qemu machines "
                "fork across nodes", field="node",
                hint="fork it on its own node (leave the node out)",
            )
        self._offered[tpl.id] = tpl
        cached = self._offers.get(tpl.id)
        if cached is not None:
            return cached

        def describe() -> TemplateOffer:
            layers = tuple(
                LayerOffer(layer.id, layer.parent_id,
                           transfer.offer("layer", layer.id, self.layer_path(layer.id)))
                for layer in self.repos.layers.chain(tpl.layer_id)
            )
            return TemplateOffer(
                template_id=tpl.id, source_id=src.id, generation=tpl.generation,
                image=src.image, engine=src.engine, memory_mib=src.memory_mib,
                mem=transfer.offer("mem", tpl.id, tpl.mem_path),
                state=transfer.offer("state", tpl.id, tpl.state_path), layers=layers,
            )

        self._offers[tpl.id] = await asyncio.to_thread(describe)
        return self._offers[tpl.id]

    def _offered_path(self, kind: str, key: str) -> Path:
        tpl = self._offered.get(key)
        if kind in ("mem", "state") and tpl is not None:
            return tpl.mem_path if kind == "mem" else tpl.state_path
        if kind == "layer":
            layer = self.repos.layers.get(key)
            if layer is not None and layer.frozen:
                return self.layer_path(key)
        if kind == "blob" and self.store.has_blob(key):
            return self.store.blob_path(key)
        raise NotFound(f"this node offers no {kind} {key!r}",
                       hint="the source changed or was deleted meanwhile; fork again")

    async def read_chunk(self, kind: str, key: str, offset: int, length: int) -> bytes:
        """A chunk of a file this node offered (a template's, a frozen layer, a blob)."""
        return await asyncio.to_thread(
            transfer.read_chunk, self._offered_path(kind, key), offset, length
        )

    async def receive_template(self, tpl_offer: TemplateOffer, fetch: Fetch) -> TemplateRecord:
        """Make another node's template a local one (once per template; kept while its
        source is unchanged, so later forks here map it copy-on-write)."""
        existing = self.repos.layers.template(tpl_offer.template_id)
        if existing is not None and existing.mem_path.exists():
            return existing
        pending = self._receiving.get(tpl_offer.template_id)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[TemplateRecord] = asyncio.get_running_loop().create_future()
        self._receiving[tpl_offer.template_id] = fut
        try:
            tpl = await self._receive_template(tpl_offer, fetch)
            fut.set_result(tpl)
            return tpl
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()
            raise
        finally:
            self._receiving.pop(tpl_offer.template_id, None)

    async def _receive_template(self, o: TemplateOffer, fetch: Fetch) -> TemplateRecord:
        image, engine = await self.host.ready(o.engine)
        if image.key != o.image:
            raise HostSetupError(
                f"node {self.id} runs guest image {image.key}, the source runs {o.image}",
                hint="run the same boxd version (and image recipe) on every node",
            )
        ensure_space(self.paths.shm, o.mem.data_bytes + o.state.size)
        t0 = time.monotonic()
        dest = self.paths.templates / o.template_id
        dest.mkdir(parents=True, exist_ok=True, mode=0o700)
        made: list[str] = []
        try:
            received = await transfer.receive(fetch, o.mem, dest / "mem")
            received += await transfer.receive(fetch, o.state, dest / "state")
            if engine.file_owner is not None:
                # As a template made here: QEMU reads the state file as its own user.
                for p in (dest, dest / "mem", dest / "state"):
                    os.chown(p, *engine.file_owner)
            for layer in reversed(o.layers):  # the base image's layer first
                if self.repos.layers.get(layer.id) is not None:
                    continue  # sent before, with an earlier template of this source
                path = self.layer_path(layer.id)
                received += await transfer.receive(fetch, layer.file, path)
                made.append(layer.id)
                backing = image.rootfs if layer.parent is None else self.layer_path(layer.parent)
                await disks.retarget(path, backing, "raw" if layer.parent is None else "qcow2")
                if engine.file_owner is not None:
                    os.chown(path, *engine.file_owner)
                self.repos.layers.received(
                    layer.id, layer.parent, str(image.rootfs) if layer.parent is None else ""
                )
            tpl = self.repos.layers.add_template(
                o.source_id, o.layers[0].id, dest / "mem", dest / "state", o.generation,
                template_id=o.template_id,
            )
        except BaseException:
            remove_tree(dest)
            for lid in made:
                disks.remove(self.layer_path(lid))
            self._sweep_received(made)
            raise
        self._received[o.source_id] = tpl.id  # an older one of that source may go now
        self.gc()
        log.info("template=%s event=received source=%s bytes=%d seconds=%.3f", tpl.id,
                 o.source_id, received, time.monotonic() - t0)
        return tpl

    def _sweep_received(self, layer_ids: list[str]) -> None:
        for lid in reversed(layer_ids):  # children first
            self.repos.layers.drop(lid)

    async def fork_received(
        self, src: MachineRecord, tpl: TemplateRecord, child_ids: list[str]
    ) -> list[Exception | None]:
        """Start recorded children of another node's machine ``src`` from ``tpl``."""
        with self._pinned(tpl):
            results = await asyncio.gather(
                *(self._start_child(src, tpl, cid) for cid in child_ids),
                return_exceptions=True,
            )
        out: list[Exception | None] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            out.append(r if isinstance(r, Exception) else None)
        return out

    async def receive_snapshot(self, digest: str, raw: bytes, offers: list[FileOffer],
                               fetch: Fetch) -> Manifest:
        """Store another node's snapshot here: fetch the blobs this store lacks (by
        digest) and verify them. A no-op when every blob is here."""
        if self.store.exists(digest):
            return self.store.get(digest)
        return await transfer.receive_snapshot(self.store, digest, raw, offers, fetch)

    async def offer_snapshot(self, digest: str) -> tuple[bytes, list[FileOffer]]:
        """A stored snapshot's manifest and its blobs, for a peer node to fetch."""
        manifest = self.store.get(digest)
        raw = self.store.manifest_bytes(digest)
        offers = [await asyncio.to_thread(transfer.offer, "blob", e.digest,
                                          self.store.blob_path(e.digest))
                  for e in manifest.blobs.values()]
        return raw, offers

    # ------------------------------------------------------------- checkpoints

    def _checkpoint(self, rec: MachineRecord, name: str) -> CheckpointRecord:
        ck = self.repos.checkpoints.get(rec.id, name)
        if ck is None:
            raise CheckpointNotFound(
                f"machine {rec.name!r} has no checkpoint named {name!r}",
                machine=rec.name, checkpoint=name,
                hint=f"`boxd machine checkpoint list {rec.name}` shows them",
            )
        return ck

    async def checkpoint_save(self, machine_id: str, name: str) -> CheckpointRecord:
        async with self.lease(machine_id).op():
            rec = self._rec(machine_id)
            if self.repos.checkpoints.get(rec.id, name) is not None:
                raise AlreadyExists(
                    f"machine {rec.name!r} already has a checkpoint named {name!r}",
                    kind="checkpoint", name=name, hint="delete it first or pick another name",
                )
            rec = await self._awake(rec)
            self._touch(rec.id)
            handle = self.live.get(rec.id)
            if handle is None:
                raise self.failed_error(rec, "its VM process is not running")
            ck_id = new_id("c")
            dest = self.paths.checkpoints / ck_id
            try:
                frozen_id, image = await self._freeze_and_capture(rec, handle, dest)
                return self.repos.checkpoints.add(
                    ck_id, rec.id, name, frozen_id, image.mem_path, image.state_path
                )
            except BaseException:
                remove_tree(dest)
                raise

    async def checkpoint_restore(self, machine_id: str, name: str) -> None:
        lease = self.lease(machine_id)
        async with lease.op():
            rec = self._rec(machine_id)
            ck = self._checkpoint(rec, name)
            await self.host.ready(rec.engine)
            if rec.state in ASLEEP:
                rec = await self._awake(rec)  # takes its quota slot again if hibernated
            self._touch(rec.id)
            async with lease.replace():
                rec = self.lifecycle.begin(rec, S.RESTORING, S.RUNNING, S.FAILED)
                old = self._retire(rec.id)
                if old is not None:
                    await old.destroy()
                self.repos.machines.bump_generation(rec.id)
                image = MemoryImage(ck.mem_path, ck.state_path, rec.memory_mib)
                await self._start(
                    rec, Launch(image, backing=self.layer_path(ck.layer_id),
                                parent_layer=ck.layer_id, copy_memory=True,
                                disk_gib=rec.disk_gib),
                    identity=False,
                )
                self.repos.machines.update(rec.id, error=None)
            self.gc()
        log.info("machine=%s event=restored checkpoint=%s", machine_id, name)

    async def checkpoint_list(self, machine_id: str) -> list[CheckpointRecord]:
        return self.repos.checkpoints.list(self._rec(machine_id).id)

    async def checkpoint_delete(self, machine_id: str, name: str) -> None:
        async with self.lease(machine_id).op():
            rec = self._rec(machine_id)
            ck = self._checkpoint(rec, name)
            self.repos.checkpoints.delete(ck.id)
            remove_tree(self.paths.checkpoints / ck.id)
            self.gc()

    # --------------------------------------------------------------- snapshots

    async def save_snapshot(self, machine_id: str, meta: dict[str, object]) -> str:
        """Capture a machine into the snapshot store; return the manifest's digest.

        The capture goes to tmpfs (fast: the machine is paused meanwhile); the store
        then copies and hashes it into its own filesystem while the machine runs again.
        """
        _, engine = await self.host.ready(self._rec(machine_id).engine)
        # In the store's staging area: an interrupted save is collected at next start.
        work = Path(tempfile.mkdtemp(prefix="save-", dir=self.store.staging_dir))
        capture = self.paths.shm / "tmp" / new_id("save")
        try:
            async with self.lease(machine_id).op():
                rec = await self._awake(self._rec(machine_id))
                self._touch(rec.id)
                handle = await self._own_ram(rec)
                rec = self._rec(machine_id)
                frozen_id, image = await self._freeze_and_capture(rec, handle, capture)
            # The machine runs again; the frozen layer and captured files are immutable.
            disk = work / "disk.qcow2"
            await engine.flatten_disk(self.layer_path(frozen_id), disk)
            memory = image.mem_path
            assert memory is not None
            full = {**meta, "engine": engine.name, "accelerator": engine.accelerator,
                    "cpu_model": engine.cpu_model, "image": rec.image}

            def stage() -> Manifest:
                with self.store.stage() as st:
                    st.add_blob("memory", memory, move=True)
                    st.add_blob("state", image.state_path, move=True)
                    st.add_blob("disk", disk, move=True)
                    return st.commit(full)

            manifest = await asyncio.to_thread(stage)
        finally:
            remove_tree(work)
            remove_tree(capture)
            self.gc()
        return manifest.digest

    def snapshot_digests_in_use(self) -> set[str]:
        return self.repos.machines.snapshot_digests()

    # ------------------------------------------------- suspend, hibernate, wake

    def _touch(self, machine_id: str) -> None:
        """Activity: a request needed the machine (status reads never call this)."""
        now = time.time()
        self._active[machine_id] = now
        if now - self._active_written.get(machine_id, 0.0) >= 1.0:  # at most 1 write/s
            self._active_written[machine_id] = now
            self.repos.machines.touch(machine_id, now)

    def last_active(self, rec: MachineRecord) -> float:
        return max(rec.last_active, self._active.get(rec.id, 0.0))

    def timers(self, rec: MachineRecord) -> tuple[float, float]:
        """(suspend_after, hibernate_after) in seconds for this machine; 0 is never."""
        sus = rec.suspend_after if rec.suspend_after is not None else self.settings.suspend_after
        hib = (rec.hibernate_after if rec.hibernate_after is not None
               else self.settings.hibernate_after)
        return sus, hib

    async def _step_clock(self, rec: MachineRecord, handle: MachineHandle) -> None:
        """After a wake: step the guest's wall clock to the host's (best effort)."""
        try:
            agent = await handle.agent(timeout=30)
            await agent.clock(time.time())
        except BoxdError as exc:
            log.warning("machine=%s event=clock_step_failed error=%s", rec.id, exc)

    async def _resume(self, rec: MachineRecord) -> None:
        """Suspended → running (lease held): resume the vCPUs, step the clock."""
        handle = self.live.get(rec.id)
        if handle is None:
            self.lifecycle.fail(rec.id, "its VM process is not running")
            raise self.failed_error(rec, "its VM process is not running")
        t0 = time.perf_counter()
        await handle.resume()
        self.lifecycle.move(rec.id, S.RUNNING, expect=(S.SUSPENDED,))
        t1 = time.perf_counter()
        await self._step_clock(rec, handle)
        self._touch(rec.id)
        log.info("machine=%s event=woke from=suspended resume_ms=%.3f clock_ms=%.3f",
                 rec.id, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)

    async def _wake(self, rec: MachineRecord) -> None:
        """Hibernated → running (lease held): restore the VM from its image on disk.

        Raises:
            QuotaExceeded: the account has no free slot (the machine stays hibernated).
            MachineFailed: the image is missing or does not load (the machine is failed).
        """
        image_dir = self.paths.hibernated / rec.id
        if not is_sealed(image_dir) or not (image_dir / "state").is_file():
            reason = "its hibernation image is missing or incomplete"
            self.lifecycle.fail(rec.id, reason)
            raise self.failed_error(rec, reason)
        if not self.lifecycle.move(
            rec.id, S.WAKING, expect=(S.HIBERNATED,),
            quota=(rec.account_id, self.settings.default_max_machines),
        ):
            self._rec(rec.id)
            return
        t0 = time.perf_counter()
        rec = self._rec(rec.id)
        mem = image_dir / "mem"
        image = MemoryImage(mem if mem.is_file() else None, image_dir / "state", rec.memory_mib)
        assert rec.layer_id is not None
        try:
            handle = await self._start(
                rec, Launch(image, keep_disk=self.layer_path(rec.layer_id), copy_memory=True,
                            disk_gib=rec.disk_gib),
                identity=False,
            )
        except BoxdError as exc:
            raise self.failed_error(self._rec(rec.id), exc.message) from exc
        remove_tree(image_dir)
        await self._step_clock(rec, handle)
        self._touch(rec.id)
        log.info("machine=%s event=woke from=hibernated seconds=%.3f", rec.id,
                 time.perf_counter() - t0)

    async def suspend(self, machine_id: str, *, idle: bool = False) -> None:
        """Stop a running machine's vCPUs; its memory stays resident.

        Raises:
            StateError: it is not running (e.g. hibernated, failed).
            Conflict: requests are in flight on it (only when asked for explicitly).
        """
        lease = self.lease(machine_id)
        async with lease.op():
            rec = self._rec(machine_id)
            if rec.state == S.SUSPENDED:
                return
            if idle and rec.state != S.RUNNING:
                return
            if rec.state == S.FAILED:
                raise self.failed_error(rec, rec.error)
            require(rec, S.RUNNING)
            async with lease.replace(drain=0.0 if idle else SWAP_DRAIN):
                if lease.users:
                    if idle:
                        return  # a request slipped in: not idle after all
                    raise _in_flight(rec)
                handle = self.live.get(machine_id)
                if handle is None:
                    raise self.failed_error(rec, "its VM process is not running")
                await handle.pause()
                self.lifecycle.move(machine_id, S.SUSPENDED, expect=(S.RUNNING,))
        log.info("machine=%s event=suspended idle=%s", machine_id, idle)

    async def hibernate(self, machine_id: str, *, idle: bool = False) -> None:
        """Write memory and device state to disk and end the VM process.

        Raises:
            StateError: it is neither running nor suspended.
            Conflict: requests are in flight on it (only when asked for explicitly).
        """
        lease = self.lease(machine_id)
        async with lease.op():
            rec = self._rec(machine_id)
            if rec.state == S.HIBERNATED:
                return
            if idle and rec.state not in (S.RUNNING, S.SUSPENDED):
                return
            if rec.state == S.FAILED:
                raise self.failed_error(rec, rec.error)
            require(rec, S.RUNNING, S.SUSPENDED)
            async with lease.replace(drain=0.0 if idle else SWAP_DRAIN):
                if lease.users:
                    if idle:
                        return
                    raise _in_flight(rec)
                handle = self.live.get(machine_id)
                if handle is None:
                    raise self.failed_error(rec, "its VM process is not running")
                was = rec.state
                rec = self.lifecycle.begin(rec, S.HIBERNATING, S.RUNNING, S.SUSPENDED)
                dest = self.paths.hibernated / machine_id
                remove_tree(dest)
                t0 = time.perf_counter()
                try:
                    await self._freeze_and_capture(rec, handle, dest, resume=False)
                    await asyncio.to_thread(seal, dest)
                except BaseException:
                    remove_tree(dest)
                    if handle.alive():
                        if was == S.RUNNING:
                            await handle.resume()
                        self.lifecycle.move(machine_id, was, expect=(S.HIBERNATING,))
                    else:
                        self.lifecycle.fail(machine_id, handle.exit_reason())
                    raise
                # Recorded first: a daemon killed now finds the machine hibernated (and
                # kills the VM process left over); never neither.
                self.lifecycle.move(machine_id, S.HIBERNATED, expect=(S.HIBERNATING,))
                self._retire(machine_id)
                await handle.destroy()
                self.repos.machines.update(machine_id, pid=None, template_id=None)
                log.info("machine=%s event=hibernated idle=%s seconds=%.3f", machine_id, idle,
                         time.perf_counter() - t0)
        self.gc()

    async def resume(self, machine_id: str) -> None:
        """Wake a suspended or hibernated machine (a running one: nothing to do)."""
        async with self.lease(machine_id).op():
            await self._awake(self._rec(machine_id))

    async def idle_tick(self, now: float | None = None) -> None:
        """Suspend and hibernate the machines idle past their timers (one pass)."""
        now = time.time() if now is None else now
        for rec in self.repos.machines.in_states((S.RUNNING, S.SUSPENDED), self._id):
            lease = self.lease(rec.id)
            if rec.id in self._idle_ops or lease.busy or lease.users or self.procs.busy(rec.id):
                continue
            idle = now - self.last_active(rec)
            sus, hib = self.timers(rec)
            if hib > 0 and idle >= hib:
                op = self.hibernate(rec.id, idle=True)
            elif rec.state == S.RUNNING and sus > 0 and idle >= sus:
                op = self.suspend(rec.id, idle=True)
            else:
                continue
            self._idle_ops.add(rec.id)
            self._spawn(self._idle_op(rec.id, op), f"idle {rec.id}")

    async def _idle_op(self, machine_id: str, op: Any) -> None:
        try:
            await op
        except asyncio.CancelledError:
            raise
        except BoxdError as exc:  # gone meanwhile, or failed: the record says so
            log.warning("machine=%s event=idle_op_failed error=%s", machine_id, exc)
        finally:
            self._idle_ops.discard(machine_id)

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(self.idle_interval)
            try:
                await self.idle_tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the timer must outlive a bad pass
                log.exception("event=idle_tick_failed")

    # ---------------------------------------------------------------- recovery

    async def recover(self) -> None:
        """After a daemon (re)start: find the VMs of recorded machines again.

        A machine whose process is gone is failed with the reason; one left mid-launch
        (``starting`` without a process) is failed; one left hibernating or waking
        ends hibernated (its image is complete) or running (its VM still runs), never
        neither; a suspended one stays suspended; ``deleting`` records are finished
        off. Then files and processes no record knows are swept, and the idle timers
        start.
        """
        if self._recovered:
            return
        self._recovered = True
        for rec in self.repos.machines.in_states((S.DELETING,), self._id):
            await self.purge(rec.id)
        for rec in self.repos.machines.in_states((S.HIBERNATED,), self._id):
            if rec.pid:  # killed between recording the hibernation and ending the VM
                _, engine = await self.host.ready(rec.engine)
                engine.kill_stray(rec.vm_id, self.run_dir(rec.vm_id), rec.pid)
                self.repos.machines.update(rec.id, pid=None)
        for rec in self.repos.machines.in_states(HAS_VM, self._id):
            _, engine = await self.host.ready(rec.engine)
            await self._reattach(engine, rec)
        for rec in self.repos.machines.in_states(
            (*HAS_VM, S.HIBERNATED, S.FAILED), self._id
        ):
            if rec.port and rec.fwd_port != rec.port:  # (equal: QEMU itself holds it)
                await self.proxy.open(rec.id, rec.port)
        await self._sweep()
        self.gc()
        if self._idle_task is None:
            self._idle_task = asyncio.create_task(self._idle_loop(), name="idle timers")

    async def _reattach(self, engine: Engine, rec: MachineRecord) -> None:
        image_ok = is_sealed(self.paths.hibernated / rec.id)
        if not rec.pid or rec.layer_id is None:
            # Killed mid-launch: its VM process may have started before the pid was
            # recorded (the run directory has it; the sweep skips recorded VM ids).
            if rec.vm_id and engine.kill_stray(rec.vm_id, self.run_dir(rec.vm_id)):
                log.info("machine=%s event=stray_vm_killed vm=%s", rec.id, rec.vm_id)
            if rec.state in (S.HIBERNATING, S.WAKING) and image_ok:
                self.lifecycle.move(rec.id, S.HIBERNATED, expect=(rec.state,))
            else:
                self.lifecycle.fail(rec.id, "the daemon stopped while the machine was launched")
            return
        try:
            handle = engine.attach(
                self._config(rec), self.run_dir(rec.vm_id), rec.pid, self.layer_path(rec.layer_id),
                rec.ram_shared, self.log_path(rec.vm_id),
            )
            undone = await handle.recover()
        except MachineFailed as exc:
            if rec.state in (S.HIBERNATING, S.WAKING) and image_ok:
                self.lifecycle.move(rec.id, S.HIBERNATED, expect=(rec.state,))
            else:
                self.lifecycle.fail(rec.id, exc.message)
            return
        if undone:
            log.info("machine=%s event=recovered undone=%r", rec.id, undone)
        self._install(rec.id, handle)
        if rec.state == S.SUSPENDED:
            await handle.pause()  # recover() resumed it: it was paused on purpose
        elif rec.state in TRANSIENT:
            remove_tree(self.paths.hibernated / rec.id)  # the VM ran on: drop a half image
            self.lifecycle.move(rec.id, S.RUNNING, expect=(rec.state,))
        if self._rec(rec.id).state in (S.RUNNING, S.SUSPENDED):
            # A new daemon: a new credential (relay_listen writes it).
            self._serve_guest_api(rec, handle, self._new_guest_key(rec))

    async def _sweep(self) -> None:
        """Remove run directories, templates and checkpoints no record knows."""
        known = self.repos.machines.vm_ids()
        strays = [d for d in (self.paths.shm / "machines").glob("*") if d.name not in known]
        if strays:
            # Standby children of a daemon that died (spares are never recorded), or
            # machines whose records are gone: their VMs may still be running.
            await self.host.ready()
            for d in strays:
                if any(e.kill_stray(d.name, d) for e in self.host.engines.values()):
                    log.info("machine=%s event=stray_vm_killed", d.name)
                remove_tree(d)
        for d in self.paths.machines.glob("*"):
            if d.name not in known:
                remove_tree(d)
        tpls = self.repos.layers.template_dirs()
        for d in self.paths.templates.glob("*"):
            if d.name not in tpls:
                remove_tree(d)
        cks = self.repos.checkpoints.ids()
        for d in self.paths.checkpoints.glob("*"):
            if d.name not in cks:
                remove_tree(d)
        for d in (self.paths.shm / "tmp").glob("*"):  # the folder itself keeps its modes
            remove_tree(d)
        layers = self.repos.layers.ids()
        for f in self.paths.disks.glob("*.qcow2*"):
            if f.name.split(".")[0] not in layers:
                f.unlink(missing_ok=True)

    async def close(self) -> None:
        await self.proxy.close_all()
        if self._idle_task is not None:
            self._idle_task.cancel()
            self._idle_task = None
        await self.spares.close()
        await self.procs.close()
        for task in list(self._background) + list(self._guest_relays.values()):
            task.cancel()
        self._guest_relays.clear()
        self._guest_keys.clear()
        self._guest_keep.clear()
        for mid in list(self._guest_streams):
            self._end_guest_streams(mid)
        for mid in list(self.live):
            handle = self._retire(mid)
            if handle is not None:
                await handle.detach()


__all__ = ["HOST_GRACE", "MAX_CHAIN", "Launch", "NodeRuntime", "free_port", "host_memory_mib",
           "node_cap"]
