"""The node runtime: one host's machines, on one engine, through one launch path.

Records (the control plane inserted them) name what a machine is; the node owns what
happens on the host. `NodeRuntime` is the `boxd.node.base.Node` facade: it answers
requests by machine id, holds each machine's `Lease`, wakes machines for requests
(`using`) and starts fork children; the work is done by collaborators, one module
each, with narrow interfaces:

- `boxd.node._launch` (`Launcher`): the one launch path (create, fork child, start from
  snapshot, checkpoint restore, RAM swap, standby child), the VM process of each
  machine and the watcher that fails it when that process exits; the RAM swap.
- `boxd.node._templates` (`Templates`): where a fork's template comes from (made from
  the source, or received from a peer), what keeps it, and where it is freed.
- `boxd.node._spares` (`SparePool`): standby fork children.
- `boxd.node._offers` (`Offers`): what this node serves its peers (cross-node forks
  and snapshot moves).
- `boxd.node._guests` (`GuestRelay`): the in-guest API: credentials and relays.
- `boxd.node._exec` (`Exec`): exec, files and spawned processes.
- `boxd.node._sleep` (`Sleep`, `IdleTimers`): suspend, hibernate, wake; the idle policy.
- `boxd.node._checkpoints` (`Checkpoints`): checkpoints and snapshot saves.
- `boxd.node._recovery` (`Recovery`): after a daemon restart.
- `boxd.node._metrics` (`Metrics`): samples of machines' CPU, memory and disk use.

Every state change goes through `Lifecycle`; reads never write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any

from boxd import models
from boxd import process_models as pm
from boxd._version import __version__
from boxd.config import DEFAULT_MEMORY_MIB, Paths, Settings
from boxd.engine.base import Agent, Engine, MachineHandle, MemoryImage
from boxd.errors import (
    InvalidRequest,
    MachineFailed,
    MachineNotFound,
    NotFound,
)
from boxd.models import MachineState
from boxd.node._checkpoints import Checkpoints
from boxd.node._exec import HOST_GRACE, Exec, image_defaults
from boxd.node._forks import Forks
from boxd.node._guests import GuestRelay
from boxd.node._host import Host
from boxd.node._launch import Launch, Launcher, failed_error, set_identity
from boxd.node._metrics import Metrics
from boxd.node._offers import Offers
from boxd.node._ports import free_port
from boxd.node._processes import ProcessStream, ProcessTable
from boxd.node._proxy import PortProxy, Upstream, record_access
from boxd.node._recovery import Recovery
from boxd.node._services import wait_ready
from boxd.node._sleep import IdleTimers, Sleep
from boxd.node._standby import tree_pss
from boxd.node._templates import MAX_CHAIN, Templates
from boxd.node._transfer import Fetch, FileOffer, TemplateOffer
from boxd.node.base import Boot, FromSnapshot
from boxd.node.lifecycle import Lease, Lifecycle, require
from boxd.services import GuestApi
from boxd.state import CheckpointRecord, MachineRecord, Repos, RunImage, TemplateRecord
from boxd.storage import Manifest, SnapshotStore, disks
from boxd.storage.execs import ExecFiles
from boxd.storage.memory import remove_tree

log = logging.getLogger("boxd.node")

S = MachineState

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
        self._background: set[asyncio.Task[None]] = set()
        self.procs = ProcessTable()  # spawned processes (boxd.rl): see `boxd.node._exec`
        self.proxy = PortProxy(self.connect, record_access(self.repos.machines.get))
        self.guests = GuestRelay(self.live.get)
        self.templates = Templates(paths, repos, host, self, gc=self.gc, spawn=self._spawn,
                                   node_id=node_id)
        self.launcher = Launcher(
            paths, repos, host, self.lifecycle, live=self.live,
            unreferenced=self.templates.unreferenced, guests=self.guests, procs=self.procs,
            proxy=self.proxy, record=self.record, lease=self.lease, spawn=self._spawn,
        )
        self.forks = Forks(paths, repos, host, settings, machines=self,
                           templates=self.templates, launcher=self.launcher, procs=self.procs,
                           purge=self.purge)
        self.spares = self.forks.spares
        self.offers = Offers(repos, store, paths.disks, fork_source=self.forks.source,
                             unpin=self.templates.unpin, refs=self.templates.refs,
                             engine=self._engine)
        self.idle = IdleTimers(repos, settings, self.procs, node_id=node_id, lease=self.lease,
                               spawn=self._spawn)
        self.sleep = Sleep(paths, repos, settings, self.lifecycle, machines=self,
                           launcher=self.launcher, templates=self.templates, timers=self.idle)
        self.checkpoints = Checkpoints(paths, repos, host, store, self.lifecycle, machines=self,
                                       launcher=self.launcher, templates=self.templates)
        self.execs = Exec(self, self.lifecycle, self.procs,
                          max_output=settings.max_exec_output, files=ExecFiles(paths.execs))
        self.recovery = Recovery(paths, repos, host, self.lifecycle, node_id=node_id,
                                 launcher=self.launcher, guests=self.guests, proxy=self.proxy,
                                 purge=self.purge, record=self.record)
        self.metrics = Metrics(self, self._spawn)

    @property
    def id(self) -> str:
        return self._id

    # ------------------------------------------------------------------ helpers

    def lease(self, machine_id: str) -> Lease:
        return self._leases.setdefault(machine_id, Lease())

    def record(self, machine_id: str) -> MachineRecord:
        """The machine's record (one that is being deleted is gone already).

        Raises:
            MachineNotFound: there is none.
        """
        rec = self.repos.machines.get(machine_id)
        if rec is None or rec.state == S.DELETING:
            raise MachineNotFound(
                f"no machine {machine_id!r}", machine=machine_id,
                hint="`boxd machine list` shows your machines",
            )
        return rec

    def current(self, machine_id: str) -> MachineHandle | None:
        """The machine's VM process now (None: it has none)."""
        return self.live.get(machine_id)

    def layer_path(self, layer_id: str) -> Path:
        return disks.layer_path(self.paths.disks, layer_id)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def touch(self, machine_id: str) -> None:
        """Activity: a request needed the machine (status reads never call this)."""
        self.idle.touch(machine_id)

    def changed(self, machine_id: str) -> None:
        """The guest may change: the next fork needs a new template."""
        self.repos.machines.bump_generation(machine_id)
        self.spares.prune()  # a changed source's standby children are stale

    def processes_captured(self, machine_id: str) -> None:
        """A template of the machine is being taken: the next send changes it again."""
        self.execs.captured(machine_id)

    async def own_ram(self, rec: MachineRecord) -> MachineHandle:
        """Give a machine that maps an image privately a RAM file of its own (the caller
        holds its lease; see `Launcher.own_ram`)."""
        handle = self.live.get(rec.id)
        swap = handle is not None and not handle.ram_shared
        new = await self.launcher.own_ram(rec)
        if swap:
            self.gc()
        return new

    # --------------------------------------------------------------- host, node

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

    async def _engine(self, name: str) -> Engine:
        _, engine = await self.host.ready(name)
        return engine

    # ------------------------------------------------------------------ create

    async def create(self, machine_id: str, source: Boot | FromSnapshot) -> None:
        # The whole create holds the machine's lease, an image's unpacking included: a
        # request for the machine meanwhile (its record exists, starting, with no VM
        # process yet) waits for the create instead of answering that no VM runs.
        # One more machine of its account: as a fork's children, it leaves the warm
        # pools less headroom (`SparePool.forked`; `freed` gives it back on delete, and
        # so does the purge of a create that fails: counted first, it balances).
        self.spares.forked(self.record(machine_id).account_id, 1)
        async with self.lease(machine_id).op():
            await self._create(machine_id, source)

    async def _create(self, machine_id: str, source: Boot | FromSnapshot) -> None:
        rec = self.record(machine_id)
        try:
            image, engine = await self.host.ready(rec.engine)
            root = image.rootfs
            if isinstance(source, Boot) and rec.run_image is not None:
                root = await self.host.image_root(rec.run_image, engine)
            elif rec.run_image is not None:
                await self._snapshot_image(rec.run_image, engine)
        except BaseException:
            await self.purge(machine_id)  # its engine cannot run here: no record is left
            raise
        port = None if rec.isolated else free_port()
        self.repos.machines.update(machine_id, port=port)
        rec = self.record(machine_id)
        try:
            if isinstance(source, Boot):
                await self.launcher.start(
                    rec, Launch(None, backing=root, backing_format="raw",
                                disk_gib=rec.disk_gib),
                    identity=False, to_running=False,
                )
            else:
                await self.launcher.start(rec, Launch(
                    MemoryImage(source.memory, source.state, rec.memory_mib),
                    backing=source.disk, backing_format="layer", disk_gib=rec.disk_gib,
                ))
        except BaseException:
            await self.purge(machine_id)
            raise
        log.info("machine=%s event=created name=%s", machine_id, rec.name)

    async def _snapshot_image(self, run: RunImage, engine: Engine) -> None:
        """Unpack here the image a snapshot's machine runs (gVisor runs it on that tree;
        QEMU's snapshot disk is whole and needs none). A snapshot imported from another
        host may name an image this store lacks: the start goes on, and an engine that
        needs the tree says so then."""
        try:
            await self.host.image_root(run, engine)
        except NotFound as exc:
            log.info("event=snapshot_image_missing image=%s error=%s", run.name, exc)

    # -------------------------------------------------------------- agent use

    @contextlib.asynccontextmanager
    async def using(
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
            rec = self.record(machine_id)
            if rec.state != S.RUNNING:
                if rec.state == S.FAILED:
                    raise failed_error(rec, rec.error)
                async with lease.op():
                    await self.awake(self.record(machine_id), timeout)
            async with lease.use():
                rec = self.record(machine_id)
                self.lifecycle.saw(rec)
                if rec.state != S.RUNNING:
                    continue  # suspended or replaced between the wake and the gate
                handle = self.live.get(machine_id)
                if handle is None:
                    raise failed_error(rec, "its VM process is not running")
                self.touch(machine_id)
                try:
                    agent = await handle.agent(timeout=timeout)
                    yield rec, handle, agent
                except MachineFailed as exc:
                    self.record(machine_id)  # deleted meanwhile: MachineNotFound, not a 503
                    await self.raise_if_died(rec, handle, exc)
                    raise
                finally:
                    self.touch(machine_id)
                return

    async def awake(self, rec: MachineRecord, timeout: float = 120.0) -> MachineRecord:
        """Bring a machine to ``running`` (the caller holds its lease): set a cold-booted
        one's identity, resume a suspended one, restore a hibernated one.

        Raises:
            MachineFailed: it is failed, or waking it failed (it is failed now).
            QuotaExceeded: waking a hibernated machine would exceed its account's quota.
            StateError: it is in a state nothing wakes it from.
        """
        if rec.state == S.FAILED:
            raise failed_error(rec, rec.error)
        if rec.state == S.STARTING:
            await self._first_answer(rec, timeout)
        elif rec.state == S.SUSPENDED:
            await self.sleep.resume(rec)
        elif rec.state == S.HIBERNATED:
            await self.sleep.wake(rec)
        fresh = self.record(rec.id)
        if fresh.state == S.FAILED:
            raise failed_error(fresh, fresh.error)
        return require(fresh, S.RUNNING)

    async def raise_if_died(
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
            self.launcher.on_exit(rec.id, handle, handle.exit_reason())
            raise failed_error(rec, handle.exit_reason()) from exc

    async def _first_answer(self, rec: MachineRecord, timeout: float) -> None:
        """A cold-booted machine's agent answered: its own machine-id, a reseeded RNG
        and the host's wall clock (the RTC only has seconds); then it is running."""
        handle = self.live.get(rec.id)
        if handle is None:
            raise failed_error(rec, "its VM process is not running")
        try:
            key = self.guests.new_key(rec)
            await set_identity(rec.name, handle, timeout, api_key=key,
                               host_name=bool(rec.net.expose_host))
        except MachineFailed as exc:
            await self.raise_if_died(rec, handle, exc)
            raise
        self.lifecycle.move(rec.id, S.RUNNING, expect=(S.STARTING,))
        # Not on a hot path: `wait_until_ready` answers once the socket is served.
        await self.guests.started(self.guests.serve(rec, handle, key))
        if rec.run_image is not None:  # its image's ENTRYPOINT + CMD (`_services`)
            await self.execs.start_service(rec, await handle.agent(timeout))

    def serve_guests(self, handler: GuestApi) -> None:
        """Serve each non-isolated machine's in-guest API socket with ``handler``.

        Every VM process (boot, fork child, restore, wake, a RAM swap, a daemon restart)
        gets its own credential, in the guest before the start answers; nothing is
        served without a handler.
        """
        self.guests.handler = handler

    @property
    def guest_api(self) -> GuestApi | None:
        return self.guests.handler

    def guest_key_hash(self, machine_id: str) -> str | None:
        """The sha256 of a machine's current in-guest credential (None: it has none)."""
        return self.guests.key_hash(machine_id)

    @contextlib.asynccontextmanager
    async def connect(self, machine_id: str) -> AsyncIterator[Upstream]:
        """For the URL proxy: wake the machine, hold it awake, yield how to open a
        connection to one of its guest ports (the engine's `open_http`)."""
        async with self.using(machine_id) as (rec, handle, _agent):
            if rec.fwd_port is None:
                raise InvalidRequest(f"machine {rec.name!r} has no network (isolated)")
            yield handle.open_http

    async def wait_until_ready(self, machine_id: str, timeout: float) -> None:
        """Until the machine runs and, for an image's machine, its HEALTHCHECK (else
        its first EXPOSEd port) says its service is ready (`boxd.node._services`)."""
        deadline = time.monotonic() + timeout
        async with self.using(machine_id, timeout=timeout) as (rec, handle, agent):
            if rec.run_image is not None:
                await wait_ready(rec, handle, agent, image_defaults(rec, None, None, None),
                                 max(0.0, deadline - time.monotonic()))

    # ---------------------------------------------- exec, files and processes

    async def exec(self, machine_id: str, req: models.ExecRequest) -> models.ExecResult:
        return await self.execs.exec(machine_id, req)

    async def exec_result(self, machine_id: str, exec_id: str, wait: float) -> models.ExecStatus:
        return await self.execs.exec_result(machine_id, exec_id, wait)

    async def exec_list(self, machine_id: str, limit: int) -> list[models.ExecSummary]:
        return await self.execs.execs(machine_id, limit)

    def exec_stream(
        self, machine_id: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        return self.execs.exec_stream(machine_id, req)

    def exec_interactive(
        self, machine_id: str, req: models.ExecRequest, inputs: AsyncIterator[pm.ExecInput],
        pty: tuple[int, int] | None,
    ) -> AsyncIterator[pm.ExecBytes | models.ExecEvent]:
        return self.execs.exec_interactive(machine_id, req, inputs, pty)

    async def upload(
        self, machine_id: str, path: str, data: bytes | AsyncIterable[bytes], mode: int,
        user: str | None = None,
    ) -> models.FileInfo:
        return await self.execs.upload(machine_id, path, data, mode, user)

    def download(self, machine_id: str, path: str) -> AsyncGenerator[bytes, None]:
        return self.execs.download(machine_id, path)

    async def spawn(self, machine_id: str, req: pm.SpawnRequest) -> pm.Process:
        return await self.execs.spawn(machine_id, req)

    async def processes(self, machine_id: str) -> list[pm.Process]:
        return await self.execs.processes(machine_id)

    async def process_kill(self, machine_id: str, process_id: str, signal: int) -> pm.Process:
        return await self.execs.process_kill(machine_id, process_id, signal)

    async def process_output(self, machine_id: str, process_id: str, after: int | None,
                             wait: float) -> pm.ProcessOutput:
        return await self.execs.process_output(machine_id, process_id, after, wait)

    def process_attach(
        self, machine_id: str, process_id: str
    ) -> contextlib.AbstractAsyncContextManager[ProcessStream]:
        return self.execs.process_attach(machine_id, process_id)

    async def machine_metrics(self, machine_id: str, start: float | None,
                              end: float | None) -> list[models.MetricSample]:
        """Its kept samples in [start, end], one taken now if it runs (`Metrics.read`)."""
        return await self.metrics.read(machine_id, start, end)

    # ------------------------------------------------------------------ delete

    async def delete(self, machine_id: str) -> None:
        rec = self.record(machine_id)
        lease = self.lease(machine_id)
        async with lease.op(), lease.replace():
            if not self.lifecycle.move(machine_id, S.DELETING):
                self.record(machine_id)  # gone meanwhile: MachineNotFound
            await self.purge(machine_id)
        log.info("machine=%s event=deleted name=%s", machine_id, rec.name)

    async def purge(self, machine_id: str) -> None:
        """Stop the VM and remove every file and record of a machine."""
        rec = self.repos.machines.get(machine_id)
        await self.proxy.close(machine_id)
        handle = self.launcher.retire(machine_id)
        if handle is not None:
            await handle.destroy()
        if handle is None and rec is not None and rec.pid:
            _, engine = await self.host.ready(rec.engine)
            engine.kill_stray(rec.vm_id, self.paths.run_dir(rec.vm_id), rec.pid)
        for ck_id in self.repos.checkpoints.delete_for(machine_id):
            remove_tree(self.paths.checkpoints / ck_id)
        self.repos.machines.delete(machine_id)
        if rec is not None:  # a slot of its account's quota is free: warm pools refill
            self.spares.freed(rec.account_id, 1)
        self.execs.records.forget(machine_id)
        # In a thread: a RAM file or a hibernation image is GiBs to free, which would
        # hold every other request up for as long.
        dirs = [self.paths.hibernated / machine_id]
        if rec is not None:
            dirs += [self.paths.run_dir(rec.vm_id), self.paths.machines / rec.vm_id]
        for d in dirs:
            await asyncio.to_thread(remove_tree, d)
        self._leases.pop(machine_id, None)
        self.idle.forget(machine_id)
        self.metrics.forget(machine_id)
        await self.procs.drop(machine_id)
        self.gc()

    def gc(self) -> None:
        """Remove templates and disk layers nothing refers to any more (see
        `Templates.collect`), and what depended on them."""
        self.templates.collect()
        self.offers.forget_collected()
        self.spares.prune()

    # -------------------------------------------------------------------- fork

    async def fork(self, source_id: str, child_ids: list[str]) -> list[Exception | None]:
        """Start recorded children of the source from its template (see `Forks`)."""
        return await self.forks.fork(source_id, child_ids)

    async def warm(self, source_id: str, forks: int,
                   claimable: int | None = None) -> models.Standby:
        """Keep ``forks`` standby children of the source's current state (see
        `SparePool.warm`); 0 releases them without making a template."""
        return await self.forks.warm(source_id, forks, claimable)

    # ------------------------------------------- cross-node transfer (boxd.node.ray)

    async def offer_template(self, source_id: str) -> TemplateOffer:
        """The source's template (made if needed), described for a peer node to fetch."""
        return await self.offers.offer_template(source_id)

    async def read_chunk(self, kind: str, key: str, offset: int, length: int) -> bytes:
        """A chunk of a file this node offered (a template's, a frozen layer, a blob)."""
        return await self.offers.read_chunk(kind, key, offset, length)

    def offer_done(self, template_id: str) -> None:
        """A peer is done with one offer of the template (see `Offers.offer_done`)."""
        self.offers.offer_done(template_id)

    async def receive_template(self, tpl_offer: TemplateOffer, fetch: Fetch) -> TemplateRecord:
        """Make another node's template a local one, pinned: the caller unpins it
        (`unpin_template`) once its children started (see `Templates.receive`)."""
        return await self.templates.receive(tpl_offer, fetch)

    def unpin_template(self, template_id: str) -> None:
        """A launch from a received template finished (see `Templates.unpin`)."""
        self.templates.unpin(template_id)

    async def fork_received(
        self, src: MachineRecord, tpl: TemplateRecord, child_ids: list[str]
    ) -> list[Exception | None]:
        """Start recorded children of another node's machine ``src`` from ``tpl`` (pinned
        by the caller: `receive_template`)."""
        return await self.forks.fork_received(src, tpl, child_ids)

    async def receive_snapshot(self, digest: str, raw: bytes, offers: list[FileOffer],
                               fetch: Fetch) -> Manifest:
        """Store another node's snapshot here (the blobs this store lacks)."""
        return await self.offers.receive_snapshot(digest, raw, offers, fetch)

    async def offer_snapshot(self, digest: str) -> tuple[bytes, list[FileOffer]]:
        """A stored snapshot's manifest and its blobs, for a peer node to fetch."""
        return await self.offers.offer_snapshot(digest)

    # ------------------------------------------------- checkpoints, snapshots

    async def checkpoint_save(self, machine_id: str, name: str) -> CheckpointRecord:
        return await self.checkpoints.save(machine_id, name)

    async def checkpoint_restore(self, machine_id: str, name: str) -> None:
        await self.checkpoints.restore(machine_id, name)

    async def checkpoint_list(self, machine_id: str) -> list[CheckpointRecord]:
        return await self.checkpoints.saved(machine_id)

    async def checkpoint_delete(self, machine_id: str, name: str) -> None:
        await self.checkpoints.delete(machine_id, name)

    async def save_snapshot(self, machine_id: str, meta: dict[str, object]) -> str:
        """Capture a machine into the snapshot store; return the manifest's digest."""
        return await self.checkpoints.save_snapshot(machine_id, meta)

    def snapshot_digests_in_use(self) -> set[str]:
        return self.repos.machines.snapshot_digests()

    # ------------------------------------------------- suspend, hibernate, wake

    @property
    def idle_interval(self) -> float:
        return self.idle.interval

    @idle_interval.setter
    def idle_interval(self, seconds: float) -> None:
        self.idle.interval = seconds

    def last_active(self, rec: MachineRecord) -> float:
        return self.idle.last_active(rec)

    def timers(self, rec: MachineRecord) -> tuple[float, float]:
        """(suspend_after, hibernate_after) in seconds for this machine; 0 is never."""
        return self.idle.timers(rec)

    async def suspend(self, machine_id: str, *, idle: bool = False) -> None:
        """Stop a running machine's vCPUs; its memory stays resident (see `Sleep`)."""
        await self.sleep.suspend(machine_id, idle=idle)

    async def hibernate(self, machine_id: str, *, idle: bool = False) -> None:
        """Write memory and device state to disk and end the VM process (see `Sleep`)."""
        await self.sleep.hibernate(machine_id, idle=idle)

    async def resume(self, machine_id: str) -> None:
        """Wake a suspended or hibernated machine (a running one: nothing to do)."""
        async with self.lease(machine_id).op():
            await self.awake(self.record(machine_id))

    async def idle_tick(self, now: float | None = None) -> None:
        """Suspend and hibernate the machines idle past their timers (one pass)."""
        await self.idle.tick(now)

    # ---------------------------------------------------------------- recovery

    def _machine_name(self, machine_id: str) -> str | None:
        rec = self.repos.machines.get(machine_id)
        return None if rec is None or rec.state == S.DELETING else rec.name

    async def recover(self) -> None:
        """After a daemon (re)start: find the VMs of recorded machines again (see
        `boxd.node._recovery`); then the idle timers start."""
        if self.recovery.done:
            return
        await self.execs.records.load(self._machine_name)
        await self.recovery.recover()
        self.gc()
        self.idle.start()

    async def close(self) -> None:
        self.execs.stopping = True  # execs cut off from here on are kept as such
        self.offers.close()
        await self.proxy.close_all()
        self.idle.stop()
        await self.spares.close()
        await self.procs.close()
        for task in list(self._background):
            task.cancel()
        self.guests.close()
        for _mid, handle in self.launcher.close():
            await handle.detach()


__all__ = ["HOST_GRACE", "MAX_CHAIN", "Launch", "NodeRuntime", "free_port", "host_memory_mib",
           "node_cap"]
