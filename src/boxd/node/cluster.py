"""Nodes on a Ray cluster (``boxd serve --ray ADDRESS``): one node runtime per Ray node.

Every Ray node that offers the custom resource ``boxd`` gets one `NodeActor`, pinned
to it by node affinity and named after the node (a restarted control plane finds the
same actors again). The actor runs the same `NodeRuntime` as a single host, with its
own data directory (``<node root>/nodes/<ray node id>``: its own database, disks,
snapshot store, sockets and ports), so several Ray nodes on one machine share nothing.

The control plane talks to each through a `RayNode`, which implements the `Node`
protocol with actor calls. The node's database is the truth about its machines (state,
process, layers); the control plane keeps a mirror of each record, refreshed after
every call that changes a machine and once a second (idle timers, VM exits), so its
reads stay local. When Ray reports a node dead, or its actor dies, `RayCluster` marks
exactly that node's machines ``lost``.

A node runtime's QEMU processes die with it: each actor starts a small reaper process
that holds a pipe to the actor and, when the pipe closes (the actor died, whatever the
signal), kills every process whose command line names the node's directories.

Cross-node work goes node to node, not through the control plane: the receiving actor
gets the sender's actor handle and pulls chunks (`boxd.node._transfer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from typing import Any

from boxd import models
from boxd import process_models as pm
from boxd.config import Paths, Settings
from boxd.errors import BoxdError, HostSetupError, InternalError, MachineNotFound, NodeLost
from boxd.node import _transfer as transfer
from boxd.node._host import Host
from boxd.node._transfer import FileOffer, TemplateOffer
from boxd.node.base import Boot, FromSnapshot, Node, ProcessStream
from boxd.node.runtime import NodeRuntime
from boxd.state import CheckpointRecord, Database, MachineRecord, Repos
from boxd.storage import SnapshotStore

log = logging.getLogger("boxd.cluster")

#: The Ray namespace of boxd's actors and the custom resource that marks boxd nodes.
NAMESPACE = "boxd"
RESOURCE = "boxd"
#: Seconds between the control plane's refreshes of nodes and machine records.
POLL = 1.0
#: Seconds a node's capacity figures (free memory) are reused for placement.
INFO_TTL = 2.0

_REAPER = r"""
import os, signal, sys
markers = sys.argv[1:]
try:
    while os.read(0, 4096):
        pass
except OSError:
    pass
me = os.getpid()
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == me:
        continue
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        continue
    if any(m in cmd for m in markers):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
"""


def _start_reaper(paths: Paths) -> subprocess.Popen[bytes]:
    """A process that kills this node's VMs once this process is gone (see module doc)."""
    markers = [str(paths.home) + "/", str(paths.shm) + "/"]
    return subprocess.Popen(
        [sys.executable, "-c", _REAPER, *markers], stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        close_fds=True,
    )


class NodeActor:
    """The Ray actor (async) that runs one node runtime on its Ray node."""

    def __init__(self, node_id: str, root: str, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.node_id = node_id
        self.paths = Paths(Path(root) / "nodes" / node_id)
        self.settings = Settings.from_env(env)
        self.runtime: NodeRuntime | None = None
        self._sessions: dict[str, tuple[AsyncExitStack, ProcessStream]] = {}
        self._uploads: dict[str, tuple[asyncio.Queue[bytes | None],
                                       asyncio.Task[models.FileInfo]]] = {}
        self._started: asyncio.Future[None] | None = None

    async def start(self) -> str:
        """Open the node's database and recover its machines (once); return the node id."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            try:
                self.paths.ensure()
                handler = logging.FileHandler(self.paths.log)
                handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
                logging.getLogger("boxd").addHandler(handler)
                logging.getLogger("boxd").setLevel(self.settings.log_level.upper())
                self._reaper = _start_reaper(self.paths)
                db = Database(self.paths.db)
                store = SnapshotStore(self.paths.snapshots)
                self.runtime = NodeRuntime(
                    self.paths, Repos(db), Host(self.paths, self.settings), self.settings,
                    store, node_id=self.node_id,
                )
                await self.runtime.recover()
                # Warm up before joining (guest image, accelerator probe: seconds on a new
                # node), not on the first create or fork placed here, and not while a
                # machine of a node that joined earlier boots (a probe boots a guest).
                try:
                    await self.runtime.host.ready()
                except BoxdError as exc:  # it joins; requests then say what is missing
                    logging.getLogger("boxd.cluster").warning(
                        "node=%s event=warm_up_failed error=%s", self.node_id, exc)
                self._started.set_result(None)
            except BaseException as exc:
                self._started.set_exception(exc)
                raise
        await asyncio.shield(self._started)
        return self.node_id

    @property
    def rt(self) -> NodeRuntime:
        assert self.runtime is not None, "start() first"
        return self.runtime

    # ------------------------------------------------------------ inspection

    async def info(self) -> models.NodeInfo:
        import ray

        info = await self.rt.info()
        address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return info.model_copy(update={"address": address})

    async def records(self, ids: list[str] | None = None) -> list[MachineRecord]:
        repo = self.rt.repos.machines
        if ids is None:
            return repo.on_node(self.node_id)
        return [r for r in (repo.get(i) for i in ids) if r is not None]

    async def host_info(self) -> models.HostInfo:
        return await self.rt.host_info()

    async def image_key(self) -> str:
        return await self.rt.image_key()

    async def engine_name(self) -> str:
        return await self.rt.engine_name()

    async def snapshot_digests(self) -> list[str]:
        return [m.digest for m in self.rt.store.list()]

    # --------------------------------------------------------------- launch

    async def create(self, rec: MachineRecord, quota: int, source: Boot | FromSnapshot,
                     holder: Any = None) -> None:
        if isinstance(source, FromSnapshot):
            store = self.rt.store
            if not store.exists(source.digest):
                if holder is None:
                    raise InternalError(f"no node holds snapshot {source.digest[:12]}")
                raw, offers = await holder.offer_snapshot.remote(source.digest)
                await self.rt.receive_snapshot(source.digest, raw, offers, _fetcher(holder))
            await asyncio.to_thread(store.ensure_verified, source.digest)
            m = store.get(source.digest)
            source = FromSnapshot(source.digest, m.blob_path("memory"), m.blob_path("state"),
                                  m.blob_path("disk"))
        self.rt.repos.machines.adopt(rec, quota)
        await self.rt.create(rec.id, source)

    async def fork(self, source_id: str, children: list[MachineRecord],
                   quota: int) -> list[Exception | None]:
        for c in children:
            self.rt.repos.machines.adopt(c, quota)
        try:
            return await self.rt.fork(source_id, [c.id for c in children])
        except BaseException:
            await self._drop(children)  # the source could not be forked: no child is left
            raise

    async def fork_from(self, peer: Any, src: MachineRecord, children: list[MachineRecord],
                        quota: int) -> list[Exception | None]:
        """Children of another node's machine: receive its template, then start them."""
        t0 = time.monotonic()
        tpl_offer: TemplateOffer = await peer.offer_template.remote(src.id)
        t1 = time.monotonic()
        tpl = await self.rt.receive_template(tpl_offer, _fetcher(peer))
        t2 = time.monotonic()
        for c in children:
            self.rt.repos.machines.adopt(c, quota)
        try:
            out = await self.rt.fork_received(src, tpl, [c.id for c in children])
        except BaseException:
            await self._drop(children)
            raise
        log.info("source=%s event=fork_from children=%d offer=%.3f receive=%.3f start=%.3f",
                 src.id, len(children), t1 - t0, t2 - t1, time.monotonic() - t2)
        return out

    async def _drop(self, children: list[MachineRecord]) -> None:
        for c in children:
            if self.rt.repos.machines.get(c.id) is not None:
                with contextlib.suppress(Exception):
                    await self.rt.purge(c.id)

    async def offer_template(self, source_id: str) -> TemplateOffer:
        return await self.rt.offer_template(source_id)

    async def offer_snapshot(self, digest: str) -> tuple[bytes, list[FileOffer]]:
        return await self.rt.offer_snapshot(digest)

    async def read_chunk(self, kind: str, key: str, offset: int, length: int) -> bytes:
        return await self.rt.read_chunk(kind, key, offset, length)

    async def drop_snapshot(self, digest: str) -> bool:
        """Remove a snapshot the registry no longer has (blobs machines here map stay);
        False if a machine here runs from it (its store keeps it)."""
        store, rt = self.rt.store, self.rt
        if not store.exists(digest) or digest in rt.snapshot_digests_in_use():
            return False

        def in_use() -> set[str]:
            return store.blobs_of(rt.snapshot_digests_in_use())

        await asyncio.to_thread(store.delete, digest, in_use=in_use)
        return True

    # -------------------------------------------------- calls by machine id

    async def call(self, method: str, machine_id: str, *args: Any
                   ) -> tuple[Any, MachineRecord | None]:
        """Run a node call on a machine; its answer and the machine's record after it
        (one round trip: the control plane mirrors the record)."""
        if method not in _CALLS:
            raise InternalError(f"not a node call: {method!r}")
        out = await getattr(self.rt, method)(machine_id, *args)
        return out, self.rt.repos.machines.get(machine_id)

    async def exec_stream(self, machine_id: str, req: models.ExecRequest
                          ) -> AsyncIterator[models.ExecEvent]:
        async for event in self.rt.exec_stream(machine_id, req):
            yield event

    async def download(self, machine_id: str, path: str) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(self.rt.download(machine_id, path)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def upload_begin(self, machine_id: str, path: str, mode: int) -> str:
        """Start writing a guest file fed by `upload_chunk` calls; `upload_end` answers."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)

        async def chunks() -> AsyncIterator[bytes]:
            while (item := await queue.get()) is not None:
                yield item

        task = asyncio.create_task(self.rt.upload(machine_id, path, chunks(), mode))
        sid = secrets.token_hex(8)
        self._uploads[sid] = (queue, task)
        return sid

    async def upload_chunk(self, sid: str, data: bytes) -> None:
        queue, task = self._uploads[sid]
        put = asyncio.ensure_future(queue.put(data))
        done, _ = await asyncio.wait({put, task}, return_when=asyncio.FIRST_COMPLETED)
        if task in done and put not in done:  # the write failed: say why
            put.cancel()
            self._uploads.pop(sid, None)
            task.result()

    async def upload_end(self, sid: str) -> models.FileInfo:
        queue, task = self._uploads.pop(sid)
        if not task.done():
            await queue.put(None)
        return await task

    async def upload_abort(self, sid: str) -> None:
        entry = self._uploads.pop(sid, None)
        if entry is not None:
            entry[1].cancel()

    async def attach(self, machine_id: str, process_id: str) -> tuple[str, pm.Process]:
        stack = AsyncExitStack()
        stream = await stack.enter_async_context(self.rt.process_attach(machine_id, process_id))
        sid = secrets.token_hex(8)
        self._sessions[sid] = (stack, stream)
        return sid, stream.process

    async def send(self, sid: str, data: bytes) -> None:
        await self._sessions[sid][1].send(data)

    async def recv(self, sid: str) -> bytes | None:
        return await self._sessions[sid][1].recv()

    async def detach(self, sid: str) -> None:
        entry = self._sessions.pop(sid, None)
        if entry is not None:
            await entry[0].aclose()

    async def delete_all(self) -> None:
        """Delete every machine of this node (tests, and `boxd nodes drain`)."""
        for rec in self.rt.repos.machines.on_node(self.node_id):
            with contextlib.suppress(BoxdError):
                await self.rt.delete(rec.id)


# Methods of NodeRuntime a control plane calls by machine id (everything else is above).
_CALLS = frozenset({
    "wait_until_ready", "exec", "checkpoint_save", "checkpoint_restore", "checkpoint_list",
    "checkpoint_delete", "save_snapshot", "delete", "suspend", "hibernate", "resume", "spawn",
    "processes", "process_kill",
})


def _fetcher(peer: Any) -> Callable[[FileOffer, int, int], Any]:
    async def fetch(f: FileOffer, offset: int, length: int) -> bytes:
        data: bytes = await peer.read_chunk.remote(f.kind, f.key, offset, length)
        return data
    return fetch


def _unwrap(exc: BaseException, node: str) -> BaseException:
    """The error a node raised (Ray wraps it), or NodeLost when the node died."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    if isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError)):
        return NodeLost(f"node {node} is gone: {type(exc).__name__}", node=node,
                        hint="its machines are lost; delete them and fork or create again")
    return exc


class RayNode:
    """The control plane's end of one `NodeActor` (implements `boxd.node.base.Node`)."""

    def __init__(self, node_id: str, actor: Any, address: str, repos: Repos,
                 quota: Callable[[str], int]) -> None:
        self._id = node_id
        self.actor = actor
        self.address = address
        self.repos = repos
        self.quota = quota
        self.alive = True
        self.error: str | None = None
        self.last_info: models.NodeInfo | None = None
        self._info_at = 0.0

    @property
    def id(self) -> str:
        return self._id

    async def _ask(self, ref: Any) -> Any:
        if not self.alive:
            raise NodeLost(f"node {self._id} is gone: {self.error}", node=self._id,
                           hint="its machines are lost; delete them and create or fork again")
        try:
            return await ref
        except Exception as exc:
            raise _unwrap(exc, self._id) from None

    async def sync(self, ids: list[str] | None = None) -> None:
        """Mirror the node's records of ``ids`` (all of its machines when None)."""
        recs: list[MachineRecord] = await self._ask(self.actor.records.remote(ids))
        for rec in recs:
            self.repos.machines.mirror(rec)

    async def _call(self, method: str, machine_id: str, *args: Any) -> Any:
        try:
            out, rec = await self._ask(self.actor.call.remote(method, machine_id, *args))
        except BaseException:
            if self.alive:  # a failed call may have changed the machine (failed, gone)
                with contextlib.suppress(BoxdError):
                    await self.sync([machine_id])
            raise
        if rec is not None:
            self.repos.machines.mirror(rec)
        return out

    # --------------------------------------------------------------- Node

    async def host_info(self) -> models.HostInfo:
        info: models.HostInfo = await self._ask(self.actor.host_info.remote())
        return info

    async def info(self) -> models.NodeInfo:
        if not self.alive:
            base = self.last_info or models.NodeInfo(
                id=self._id, address=self.address, health="dead", machines=0, max_machines=0,
                memory_total_mib=0, memory_free_mib=0, error=None)
            return base.model_copy(update={
                "health": "dead", "error": self.error,
                "machines": len(self.repos.machines.on_node(self._id))})
        if self.last_info is not None and time.monotonic() - self._info_at < INFO_TTL:
            return self.last_info.model_copy(
                update={"machines": len(self.repos.machines.on_node(self._id))})
        info: models.NodeInfo = await self._ask(self.actor.info.remote())
        self.last_info, self._info_at = info, time.monotonic()
        return info

    async def image_key(self) -> str:
        key: str = await self._ask(self.actor.image_key.remote())
        return key

    async def engine_name(self) -> str:
        name: str = await self._ask(self.actor.engine_name.remote())
        return name

    def _forget(self, ids: list[str]) -> None:
        for mid in ids:
            self.repos.machines.delete(mid)

    async def create(self, machine_id: str, source: Boot | FromSnapshot,
                     holder: RayNode | None = None) -> None:
        rec = self.repos.machines.get(machine_id)
        assert rec is not None
        try:
            await self._ask(self.actor.create.remote(
                rec, self.quota(rec.account_id), source,
                holder.actor if holder is not None else None))
        except BaseException:
            self._forget([machine_id])  # the node removed its copy: the request failed
            raise
        await self.sync([machine_id])

    async def fork(self, source_id: str, child_ids: list[str]) -> list[Exception | None]:
        return await self._fork(None, source_id, child_ids)

    async def fork_from(self, source: RayNode, source_id: str,
                        child_ids: list[str]) -> list[Exception | None]:
        """Children here of a machine on ``source`` (its template streamed node to node)."""
        return await self._fork(source, source_id, child_ids)

    async def _fork(self, source: RayNode | None, source_id: str,
                    child_ids: list[str]) -> list[Exception | None]:
        children = [r for r in (self.repos.machines.get(c) for c in child_ids) if r is not None]
        quota = self.quota(children[0].account_id) if children else 0
        try:
            if source is None:
                results: list[Exception | None] = await self._ask(
                    self.actor.fork.remote(source_id, children, quota))
            else:
                src = self.repos.machines.get(source_id)
                assert src is not None
                results = await self._ask(
                    self.actor.fork_from.remote(source.actor, src, children, quota))
        except BaseException:
            self._forget(child_ids)  # the node dropped its copies too
            raise
        self._forget([c for c, r in zip(child_ids, results, strict=True) if r is not None])
        await self.sync([c for c, r in zip(child_ids, results, strict=True) if r is None])
        return results

    async def wait_until_ready(self, machine_id: str, timeout: float) -> None:
        await self._call("wait_until_ready", machine_id, timeout)

    async def exec(self, machine_id: str, req: models.ExecRequest) -> models.ExecResult:
        out: models.ExecResult = await self._call("exec", machine_id, req)
        return out

    async def _stream(self, method: str, *args: Any) -> AsyncGenerator[Any, None]:
        """A node's async generator as a Ray streaming generator, a few items ahead of
        the consumer (back-pressure); closing it cancels the generator on the node."""
        if not self.alive:
            await self._ask(None)  # raises NodeLost
        gen = getattr(self.actor, method).options(
            num_returns="streaming", _generator_backpressure_num_objects=4,
        ).remote(*args)
        try:
            async for ref in gen:
                yield await self._ask(ref)
        except BoxdError:
            raise
        except Exception as exc:
            raise _unwrap(exc, self._id) from None
        finally:
            import ray

            with contextlib.suppress(Exception):
                ray.cancel(gen)

    async def exec_stream(
        self, machine_id: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        async with contextlib.aclosing(self._stream("exec_stream", machine_id, req)) as events:
            async for event in events:
                yield event

    async def upload(
        self, machine_id: str, path: str, data: bytes | AsyncIterable[bytes], mode: int
    ) -> models.FileInfo:
        """Chunks go to the node one actor call each (the node writes them to the guest
        as they come; a few in flight at most)."""
        sid: str = await self._ask(self.actor.upload_begin.remote(machine_id, path, mode))
        try:
            if isinstance(data, bytes):
                for off in range(0, len(data), transfer.CHUNK):
                    await self._ask(self.actor.upload_chunk.remote(
                        sid, data[off:off + transfer.CHUNK]))
            else:
                async for chunk in data:
                    await self._ask(self.actor.upload_chunk.remote(sid, chunk))
            out: models.FileInfo = await self._ask(self.actor.upload_end.remote(sid))
        except BaseException:
            with contextlib.suppress(Exception):
                await self.actor.upload_abort.remote(sid)
            raise
        with contextlib.suppress(BoxdError):
            await self.sync([machine_id])
        return out

    async def download(self, machine_id: str, path: str) -> AsyncGenerator[bytes, None]:
        """The node's chunks as the consumer takes them; closing stops the read there."""
        async with contextlib.aclosing(self._stream("download", machine_id, path)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def checkpoint_save(self, machine_id: str, name: str) -> CheckpointRecord:
        out: CheckpointRecord = await self._call("checkpoint_save", machine_id, name)
        return out

    async def checkpoint_list(self, machine_id: str) -> list[CheckpointRecord]:
        out: list[CheckpointRecord] = await self._call("checkpoint_list", machine_id)
        return out

    async def checkpoint_restore(self, machine_id: str, name: str) -> None:
        await self._call("checkpoint_restore", machine_id, name)

    async def checkpoint_delete(self, machine_id: str, name: str) -> None:
        await self._call("checkpoint_delete", machine_id, name)

    async def save_snapshot(self, machine_id: str, meta: dict[str, object]) -> str:
        digest: str = await self._call("save_snapshot", machine_id, meta)
        return digest

    async def manifest(self, digest: str) -> bytes:
        raw, _ = await self._ask(self.actor.offer_snapshot.remote(digest))
        out: bytes = raw
        return out

    async def fetch_snapshot(self, digest: str, store: SnapshotStore) -> None:
        """Copy a snapshot this node holds into ``store`` (blobs it lacks, verified)."""
        raw, offers = await self._ask(self.actor.offer_snapshot.remote(digest))
        await transfer.receive_snapshot(store, digest, raw, offers, _fetcher(self.actor))

    async def drop_snapshot(self, digest: str) -> None:
        await self._ask(self.actor.drop_snapshot.remote(digest))

    async def snapshot_digests(self) -> set[str]:
        return set(await self._ask(self.actor.snapshot_digests.remote()))

    async def delete(self, machine_id: str) -> None:
        with contextlib.suppress(NodeLost, MachineNotFound):  # nothing is left of it there
            await self._ask(self.actor.call.remote("delete", machine_id))
        self.repos.machines.delete(machine_id)

    def snapshot_digests_in_use(self) -> set[str]:
        return {r.snapshot for r in self.repos.machines.on_node(self._id) if r.snapshot}

    async def recover(self) -> None:
        await self.sync()

    async def close(self) -> None:
        pass  # the actor and its machines keep running (detached), like a daemon restart

    async def suspend(self, machine_id: str) -> None:
        await self._call("suspend", machine_id)

    async def hibernate(self, machine_id: str) -> None:
        await self._call("hibernate", machine_id)

    async def resume(self, machine_id: str) -> None:
        await self._call("resume", machine_id)

    async def spawn(self, machine_id: str, req: pm.SpawnRequest) -> pm.Process:
        out: pm.Process = await self._call("spawn", machine_id, req)
        return out

    async def processes(self, machine_id: str) -> list[pm.Process]:
        out: list[pm.Process] = await self._call("processes", machine_id)
        return out

    async def process_kill(self, machine_id: str, process_id: str, signal: int) -> pm.Process:
        out: pm.Process = await self._call("process_kill", machine_id, process_id, signal)
        return out

    def process_attach(
        self, machine_id: str, process_id: str
    ) -> AbstractAsyncContextManager[ProcessStream]:
        return self._attach(machine_id, process_id)

    @contextlib.asynccontextmanager
    async def _attach(self, machine_id: str, process_id: str) -> AsyncIterator[ProcessStream]:
        sid, process = await self._ask(self.actor.attach.remote(machine_id, process_id))
        try:
            yield _RemoteStream(self, sid, process)
        finally:
            with contextlib.suppress(Exception):
                await self.actor.detach.remote(sid)


class _RemoteStream:
    def __init__(self, node: RayNode, sid: str, process: pm.Process) -> None:
        self._node = node
        self._sid = sid
        self._process = process

    @property
    def process(self) -> pm.Process:
        return self._process

    async def send(self, data: bytes) -> None:
        await self._node._ask(self._node.actor.send.remote(self._sid, data))

    async def recv(self) -> bytes | None:
        out: bytes | None = await self._node._ask(self._node.actor.recv.remote(self._sid))
        return out


class RayCluster:
    """Joins a Ray cluster, keeps one `RayNode` per boxd node in ``nodes`` (the dict the
    control plane places work on) and marks the machines of dead nodes lost."""

    def __init__(self, address: str, paths: Paths, settings: Settings, repos: Repos,
                 quota: Callable[[str], int]) -> None:
        self.address = address
        self.paths = paths
        self.settings = settings
        self.repos = repos
        self.quota = quota
        self.nodes: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._joining: set[str] = set()
        self._env = {k: v for k, v in os.environ.items()
                     if k.startswith("BOXD_") and k not in ("BOXD_HOME", "BOXD_RAY_ADDRESS")}

    def connect(self) -> None:
        try:
            import ray
        except ImportError as exc:
            raise HostSetupError("boxd serve --ray needs Ray",
                                 hint="pip install 'boxd[ray]'") from exc
        if not ray.is_initialized():
            ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False)

    async def refresh(self) -> None:
        """Add actors for new boxd nodes; mark nodes Ray reports dead (and their machines)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        seen = await asyncio.to_thread(ray.nodes)
        root = str(self.settings.node_root or self.paths.home)
        joining: list[RayNode] = []
        for n in seen:
            nid = n["NodeID"]
            if not n.get("Resources", {}).get(RESOURCE) and nid not in self.nodes:
                continue
            node = self.nodes.get(nid)
            if not n["Alive"]:
                if node is not None and node.alive:
                    self.lose(node, "Ray reports the node dead")
                continue
            if node is None:
                remote_cls: Any = ray.remote(NodeActor)
                actor = remote_cls.options(
                    name=f"boxd-node-{nid}", namespace=NAMESPACE, lifetime="detached",
                    get_if_exists=True, num_cpus=0, resources={RESOURCE: 0.001},
                    max_concurrency=1000, max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
                ).remote(nid, root, self._env)
                joining.append(RayNode(nid, actor, n.get("NodeManagerAddress", ""),
                                       self.repos, self.quota))
        # New nodes start (recover, warm up) side by side, and join once ready.
        await asyncio.gather(*(self._join(node) for node in joining))
        for node in list(self.nodes.values()):
            if node.alive:
                try:
                    await node.sync()
                    node._info_at = 0.0
                    await node.info()
                except NodeLost as exc:
                    self.lose(node, exc.message)
                except BoxdError as exc:
                    log.warning("node=%s event=sync_failed error=%s", node.id, exc)

    async def _join(self, node: RayNode) -> None:
        if node.id in self._joining:
            return  # still starting from an earlier refresh
        self._joining.add(node.id)
        try:
            await node._ask(node.actor.start.remote())
            await node.sync()
        except BoxdError as exc:
            log.warning("node=%s event=start_failed error=%s", node.id, exc)
            return
        finally:
            self._joining.discard(node.id)
        self.nodes[node.id] = node
        log.info("node=%s event=joined address=%s", node.id, node.address)

    def lose(self, node: RayNode, why: str) -> None:
        node.alive = False
        node.error = why
        lost = self.repos.machines.mark_lost(node.id, f"its node {node.id} is gone: {why}")
        log.warning("node=%s event=lost machines=%d why=%s", node.id, len(lost), why)

    async def start(self) -> None:
        await asyncio.to_thread(self.connect)
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="ray nodes")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(POLL)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep watching whatever one refresh hit
                log.warning("event=cluster_refresh_failed error=%r", exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _conforms(node: RayNode) -> Node:
    return node  # mypy proves RayNode implements the Node protocol


__all__ = ["NAMESPACE", "RESOURCE", "NodeActor", "RayCluster", "RayNode"]
