"""The one launch path: starting a VM process for a machine, and watching it.

`Launcher.launch` starts a VM process for all six cases — create, fork child, start
from snapshot, checkpoint restore, RAM swap and standby child — and has one failure
behaviour: the new process and the new layer are removed and (`Launcher.start`) the
machine is marked failed with the reason; for a machine that never ran (create, fork
child, snapshot start) the caller then removes its record, so the request fails
cleanly and the quota slot is free again.

A machine that maps an image privately (a fork child, a machine from a snapshot) first
gets RAM of its own before it is forked or saved (`Launcher.own_ram`: state
``swapping``). A watcher per VM process marks the machine failed when it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boxd.config import Paths
from boxd.engine.base import BootDisk, MachineConfig, MachineHandle, MemoryImage
from boxd.errors import BoxdError, MachineFailed, ResourceExhausted
from boxd.models import MachineState
from boxd.net_policy import DEFAULT as DEFAULT_POLICY
from boxd.net_policy import GATEWAY, HOST_NAME, NetPolicy
from boxd.node._guests import GuestRelay
from boxd.node._host import Host
from boxd.node._ports import free_port
from boxd.node._processes import ProcessTable
from boxd.node._proxy import PortProxy
from boxd.node._spares import Spare
from boxd.node.lifecycle import Lease, Lifecycle
from boxd.state import MachineRecord, Repos, new_id
from boxd.storage import disks
from boxd.storage.memory import ensure_space, remove_tree

log = logging.getLogger("boxd.node")

S = MachineState

# Seconds a RAM swap waits for requests in flight on the machine to finish.
SWAP_DRAIN = 30.0


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


def failed_error(rec: MachineRecord, reason: str | None) -> MachineFailed:
    return MachineFailed(
        f"machine {rec.name!r} failed: {reason or 'unknown reason'}", machine=rec.name,
        hint=f"restore a checkpoint, or delete it (`boxd machine delete {rec.name}`) and "
        "create it again",
    )


async def set_identity(
    hostname: str, handle: MachineHandle, timeout: float = 60.0, api_key: str | None = None,
    host_name: bool = False,
) -> None:
    """A new machine-id, a reseeded RNG and the host's clock (and the hostname; and the
    in-guest API credential when given; and ``host.boxd.internal`` in /etc/hosts for a
    machine that exposes host ports, ``host_name``)."""
    agent = await handle.agent(timeout=timeout)
    await agent.identity(
        hostname=hostname, machine_id=secrets.token_hex(16), seed=os.urandom(64),
        now=time.time(), api_key=api_key,
    )
    if host_name:
        await name_the_host(handle)


HOSTS_LINE = f"{GATEWAY}\t{HOST_NAME}\n"


async def name_the_host(handle: MachineHandle) -> None:
    """Make ``host.boxd.internal`` resolve to the guest's gateway (which passt or pasta
    map to the host's loopback for such a machine): a line in the guest's /etc/hosts,
    added once (a fork's disk has it already). Best effort: a guest whose /etc/hosts
    cannot be written still reaches the exposed ports at the gateway's address."""
    agent = await handle.agent(timeout=60.0)
    try:
        hosts = await agent.read_file("/etc/hosts")
    except BoxdError:  # none (a bare container image): write one
        hosts = b"127.0.0.1\tlocalhost\n"
    if any(HOST_NAME in line.split()[1:] for line in hosts.decode(errors="replace")
           .splitlines() if not line.lstrip().startswith("#")):
        return
    try:
        await agent.write_file("/etc/hosts", hosts.rstrip(b"\n") + b"\n" + HOSTS_LINE.encode())
    except BoxdError as exc:
        log.warning("machine=%s event=hosts_not_written error=%r", handle.config.id, exc)


def launch_error(rec: MachineRecord, exc: Exception) -> BoxdError:
    """What a launch that raised ``exc`` answers: a boxd error as it is; a full disk as
    `ResourceExhausted`; anything else as the machine's `MachineFailed`, naming the
    error's type (its text, with the host's paths, goes to the daemon's log)."""
    if isinstance(exc, BoxdError):
        return exc
    log.error("machine=%s event=launch_error error=%r", rec.id, exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted("the host's disk is full: the machine could not start",
                                 hint="free disk space on the host, or delete machines "
                                 "and snapshots")
    return failed_error(rec, f"launch failed ({type(exc).__name__}; the daemon's log "
                             "has the details)")


class Launcher:
    """Starts, installs, watches and retires the VM processes of one node's machines.

    ``live`` is the node's map of machine id to its VM process now (shared with the
    node); ``unreferenced`` the layers recorded by a launch or freeze in flight that no
    machine points at yet (gc keeps them).
    """

    def __init__(
        self, paths: Paths, repos: Repos, host: Host, lifecycle: Lifecycle, *,
        live: dict[str, MachineHandle], unreferenced: set[str], guests: GuestRelay,
        procs: ProcessTable, proxy: PortProxy, record: Callable[[str], MachineRecord],
        lease: Callable[[str], Lease], spawn: Callable[[Coroutine[Any, Any, None], str], None],
    ) -> None:
        self.paths = paths
        self.repos = repos
        self.host = host
        self.lifecycle = lifecycle
        self.live = live
        self._unreferenced = unreferenced
        self._guests = guests
        self._procs = procs
        self._proxy = proxy
        self._rec = record
        self._lease = lease
        self._spawn = spawn
        self._watchers: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ places

    def layer_path(self, layer_id: str) -> Path:
        return disks.layer_path(self.paths.disks, layer_id)

    def run_dir(self, vm_id: str) -> Path:
        return self.paths.run_dir(vm_id)

    def log_path(self, vm_id: str) -> Path:
        return self.paths.machines / vm_id / "qemu.log"

    def config_for(
        self, vm_id: str, hostname: str, *, vcpus: int, memory_mib: int, isolated: bool,
        port: int | None, image_root: bool = False, net: NetPolicy = DEFAULT_POLICY,
    ) -> MachineConfig:
        image = self.host.image
        return MachineConfig(
            id=vm_id, hostname=hostname, vcpus=vcpus, memory_mib=memory_mib,
            isolated=isolated, port=port, net=net,
            kernel=image.kernel if image else Path(), initrd=image.initrd if image else Path(),
            cmdline=image.cmdline_hint if image else "", image_root=image_root,
        )

    def config(self, rec: MachineRecord) -> MachineConfig:
        return self.config_for(
            rec.vm_id, rec.name, vcpus=rec.vcpus, memory_mib=rec.memory_mib,
            isolated=rec.isolated, port=rec.fwd_port, image_root=rec.run_image is not None,
            net=rec.net,
        )

    # ----------------------------------------------------- handles and watchers

    def install(self, machine_id: str, handle: MachineHandle) -> None:
        """Make ``handle`` the machine's VM and watch its process."""
        self._procs.detach_all(machine_id, "its VM process was replaced")
        self.live[machine_id] = handle
        old = self._watchers.pop(machine_id, None)
        if old is not None:
            old.cancel()
        self._watchers[machine_id] = asyncio.create_task(
            self._watch(machine_id, handle), name=f"watch {machine_id}"
        )

    def retire(self, machine_id: str) -> MachineHandle | None:
        """Take the machine's VM out of service (before a deliberate destroy)."""
        self._guests.stop(machine_id)
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
        self.on_exit(machine_id, handle, reason)

    def on_exit(self, machine_id: str, handle: MachineHandle, reason: str) -> None:
        """The VM process of a machine ended: failed, unless it was replaced meanwhile."""
        if self.live.get(machine_id) is not handle:
            return  # replaced or retired on purpose: not a failure
        self._guests.stop(machine_id)
        self.live.pop(machine_id, None)
        self._watchers.pop(machine_id, None)
        if self.lifecycle.fail(machine_id, reason):
            log.warning("machine=%s event=failed reason=%r", machine_id, reason)
        self._spawn(handle.detach(), f"detach {machine_id}")

    # -------------------------------------------------------------- launching

    async def launch(
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
                    # `start` has pointed the machine at it (see ``unreferenced``).
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

    async def start(
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
        started: list[tuple[MachineHandle, str | None]] = []
        try:
            rec, handle, key = await self._put_in_service(
                rec, launch, template_id, spare, started, identity=identity,
                to_running=to_running,
            )
        except BaseException as exc:
            await self._undo_start(rec, launch, started, exc)
            if isinstance(exc, Exception) and not isinstance(exc, BoxdError):
                raise launch_error(rec, exc) from exc
            raise
        if to_running and not self.lifecycle.move(rec.id, S.RUNNING, expect=(rec.state,)):
            fresh = self._rec(rec.id)  # its new process died at once: the watcher said why
            raise failed_error(fresh, fresh.error)
        if rec.port and not self._proxy.is_open(rec.id):
            await self._proxy.open(rec.id, rec.port)
        self._guests.serve(rec, handle, key, lazy=True)  # a cold boot's: its first answer
        return handle

    async def _put_in_service(
        self, rec: MachineRecord, launch: Launch, template_id: str | None,
        spare: Spare | None, started: list[tuple[MachineHandle, str | None]], *,
        identity: bool, to_running: bool,
    ) -> tuple[MachineRecord, MachineHandle, str | None]:
        """`start`'s work up to the move to running; what it launched goes into
        ``started`` at once (for `_undo_start`). Returns the record as read after the
        launch, the handle and its credential."""
        layer_id: str | None
        if spare is not None:
            handle, layer_id = spare.handle, spare.layer_id
            started.append((handle, layer_id))
            self._unreferenced.add(spare.layer_id)
            self.repos.layers.new(launch.parent_layer, "", layer_id=spare.layer_id)
            self.repos.machines.update(rec.id, vm_id=spare.vm_id, fwd_port=spare.port)
        else:
            # Each VM process gets a fresh forward; the URL's port stays the daemon's.
            self.repos.machines.update(rec.id, fwd_port=None if rec.isolated else free_port())
            rec = self._rec(rec.id)
            handle, layer_id = await self.launch(self.config(rec), launch, rec.engine)
            started.append((handle, layer_id))
        _, engine = await self.host.ready(rec.engine)
        fields: dict[str, object] = {"pid": handle.pid, "ram_shared": handle.ram_shared,
                                     "template_id": template_id,
                                     "accel": engine.accelerator}
        if layer_id is not None:
            fields["layer_id"] = layer_id
        self.repos.machines.update(rec.id, **fields)
        if layer_id is not None:
            self._unreferenced.discard(layer_id)
        self.install(rec.id, handle)
        if spare is not None:
            await handle.resume()
        # A new VM process, a new in-guest credential, in place before it answers:
        # in identity for a fork child or a snapshot start; else one cheap op.
        key = self._guests.new_key(rec) if identity or to_running else None
        if identity:
            await set_identity(rec.name, handle, api_key=key,
                               host_name=bool(rec.net.expose_host))
        elif key is not None:
            await (await handle.agent(timeout=60.0)).set_api_key(key)
        return rec, handle, key

    async def _undo_start(
        self, rec: MachineRecord, launch: Launch,
        started: list[tuple[MachineHandle, str | None]], exc: BaseException,
    ) -> None:
        """A start failed: remove its new process and layer; the machine is failed."""
        reason = exc.message if isinstance(exc, BoxdError) else type(exc).__name__
        for handle, layer_id in started:
            self.retire(rec.id)
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

    # -------------------------------------------------------------- RAM swap

    async def own_ram(self, rec: MachineRecord) -> MachineHandle:
        """Give a machine that maps an image privately a RAM file of its own.

        Needed once before such a machine is forked or saved: its whole RAM is streamed
        to a file and a new VM process (same id, name, port and disk) loads it. The
        caller holds the machine's lease; the machine is ``swapping`` meanwhile and
        requests that need it wait.
        """
        handle = self.live.get(rec.id)
        if handle is None:
            raise failed_error(rec, "its VM process is not running")
        if handle.ram_shared:
            return handle
        tmp = self.paths.shm / "tmp" / new_id("p")

        async def resume() -> None:
            if handle.alive():
                await handle.resume()

        async with self._lease(rec.id).replace(drain=SWAP_DRAIN):
            try:
                # Until its RAM is captured the old process runs on: on error, back to
                # running. After, a failed start marks it failed (`start`).
                async with self.lifecycle.transition(
                    rec, S.SWAPPING, S.RUNNING, undo=resume
                ) as rec:
                    await handle.pause()
                    image = await handle.capture(tmp)
                self._guests.keep(rec.id)  # the same guest runs on: so do its calls
                self.retire(rec.id)
                await handle.destroy()
                new = await self.start(
                    rec, Launch(image, keep_disk=handle.disk, copy_memory=True,
                                disk_gib=rec.disk_gib),
                    identity=False,
                )
            finally:
                remove_tree(tmp)
                self._guests.drop_kept(rec.id)  # kept only if the new process did not start
        return new

    def close(self) -> list[tuple[str, MachineHandle]]:
        """Take every VM out of service (the daemon stops; the VMs run on). Returns them."""
        out = []
        for mid in list(self.live):
            handle = self.retire(mid)
            if handle is not None:
                out.append((mid, handle))
        return out


__all__ = ["SWAP_DRAIN", "Launch", "Launcher", "failed_error", "launch_error", "set_identity"]
