"""The control plane's end of a Ray cluster (``boxd serve --ray ADDRESS``).

`RayCluster` joins the cluster, finds boxd nodes in Ray's node table and keeps one
`RayNode` per node: the control plane's end of that node's `NodeActor`
(`boxd.node.cluster`), which implements the control plane's `ClusterNode` protocol
with actor calls.

The node's database is the truth about its machines (state, process, layers); the
control plane keeps a mirror of each record (`Lifecycle.mirror`), refreshed after
every call that changes a machine and once a second (idle timers, VM exits), so its
reads stay local. When Ray reports a node dead, or its actor dies, `RayCluster` marks
exactly that node's machines ``lost`` (`Lifecycle.mark_lost`): ``lost`` is a state of
the control plane's table only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from boxd import models
from boxd import process_models as pm
from boxd.config import Paths, Settings
from boxd.control.nodes import Cluster, ClusterNode
from boxd.errors import (
    BoxdError,
    HostSetupError,
    MachineNotFound,
    NodeLost,
    NotFound,
)
from boxd.node.base import Boot, FromSnapshot, ProcessStream
from boxd.node.cluster import (
    CHUNK,
    INTERACTIVE_LEASE,
    NAMESPACE,
    RESOURCE,
    NodeActor,
    receive_snapshot,
)
from boxd.node.lifecycle import Lifecycle
from boxd.state import CheckpointRecord, MachineRecord, Repos
from boxd.storage import SnapshotStore
from boxd.storage.oci import ImageStore

log = logging.getLogger("boxd.cluster")

#: Seconds between the control plane's refreshes of nodes and machine records.
POLL = 1.0
#: Seconds a node's capacity figures (free memory) are reused for placement.
INFO_TTL = 2.0
#: Seconds between renewals of an interactive session's lease on its node (three per
#: lease: one lost or slow renewal does not end it).
RENEW = INTERACTIVE_LEASE / 3


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
    """The control plane's end of one `NodeActor` (a `ClusterNode`)."""

    def __init__(self, node_id: str, actor: Any, address: str, repos: Repos,
                 quota: Callable[[str], int], lifecycle: Lifecycle | None = None) -> None:
        self._id = node_id
        self.actor = actor
        self.address = address
        self.repos = repos
        self.quota = quota
        self.lifecycle = lifecycle or Lifecycle(repos.machines)
        self.alive = True
        self.error: str | None = None
        self.last_info: models.NodeInfo | None = None
        self._info_at = 0.0
        # (engine, image machine) -> `portable_templates` answer
        self._portable: dict[tuple[str, bool], bool] = {}
        self._pushing: dict[str, asyncio.Lock] = {}  # image digest -> its push here
        # Images whose blobs this node holds (pushed, or found whole): a later fork or
        # create there asks nothing, until a collection there (`collect_images`).
        self._images: set[str] = set()
        # Pushes share it, a collection of the node's images holds it alone.
        self._images_gate = _Gate()

    @property
    def id(self) -> str:
        return self._id

    @property
    def peer(self) -> Any:
        return self.actor  # another node's actor pulls from this one by its handle

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
            self.lifecycle.mirror(rec)

    async def _call(self, method: str, machine_id: str, *args: Any) -> Any:
        try:
            out, rec = await self._ask(self.actor.call.remote(method, machine_id, *args))
        except BaseException:
            if self.alive:  # a failed call may have changed the machine (failed, gone)
                with contextlib.suppress(BoxdError):
                    await self.sync([machine_id])
            raise
        if rec is not None:
            self.lifecycle.mirror(rec)
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

    async def portable_templates(self, engine: str, image: bool = False) -> bool:
        if (engine, image) not in self._portable:  # an engine's capability: asked once
            self._portable[engine, image] = bool(
                await self._ask(self.actor.portable_templates.remote(engine, image)))
        return self._portable[engine, image]

    def _forget(self, ids: list[str]) -> None:
        for mid in ids:
            self.repos.machines.delete(mid)

    async def create(self, machine_id: str, source: Boot | FromSnapshot,
                     holder: ClusterNode | None = None) -> None:
        rec = self.repos.machines.get(machine_id)
        assert rec is not None
        try:
            await self._ask(self.actor.create.remote(
                rec, self.quota(rec.account_id), source,
                holder.peer if holder is not None else None))
        except BaseException:
            self._forget([machine_id])  # the node removed its copy: the request failed
            raise
        await self.sync([machine_id])

    async def fork(self, source_id: str, child_ids: list[str]) -> list[Exception | None]:
        return await self._fork(None, source_id, child_ids)

    async def fork_from(self, source: ClusterNode, source_id: str,
                        child_ids: list[str]) -> list[Exception | None]:
        """Children here of a machine on ``source`` (its template streamed node to node)."""
        return await self._fork(source, source_id, child_ids)

    async def _fork(self, source: ClusterNode | None, source_id: str,
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
                    self.actor.fork_from.remote(source.peer, src, children, quota))
        except BaseException:
            self._forget(child_ids)  # the node dropped its copies too
            raise
        self._forget([c for c, r in zip(child_ids, results, strict=True) if r is not None])
        await self.sync([c for c, r in zip(child_ids, results, strict=True) if r is None])
        return results

    async def warm(self, source_id: str, forks: int,
                   claimable: int | None = None) -> models.Standby:
        out: models.Standby = await self._call("warm", source_id, forks, claimable)
        return out

    async def wait_until_ready(self, machine_id: str, timeout: float) -> None:
        await self._call("wait_until_ready", machine_id, timeout)

    async def exec(self, machine_id: str, req: models.ExecRequest) -> models.ExecResult:
        out: models.ExecResult = await self._call("exec", machine_id, req)
        return out

    async def exec_result(self, machine_id: str, exec_id: str, wait: float) -> models.ExecStatus:
        out: models.ExecStatus = await self._call("exec_result", machine_id, exec_id, wait)
        return out

    async def exec_list(self, machine_id: str, limit: int) -> list[models.ExecSummary]:
        out: list[models.ExecSummary] = await self._call("exec_list", machine_id, limit)
        return out

    async def machine_metrics(self, machine_id: str, start: float | None,
                              end: float | None) -> list[models.MetricSample]:
        out: list[models.MetricSample] = await self._call("machine_metrics", machine_id,
                                                          start, end)
        return out

    async def _stream(self, method: Any, *args: Any) -> AsyncGenerator[Any, None]:
        """A node's async generator as a Ray streaming generator, a few items ahead of
        the consumer (back-pressure); closing it cancels the generator on the node."""
        if not self.alive:
            await self._ask(None)  # raises NodeLost
        gen = method.options(
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
        stream = self._stream(self.actor.exec_stream, machine_id, req)
        async with contextlib.aclosing(stream) as events:
            async for event in events:
                yield event

    async def exec_interactive(
        self, machine_id: str, req: models.ExecRequest, inputs: AsyncIterator[pm.ExecInput],
        pty: tuple[int, int] | None,
    ) -> AsyncIterator[pm.ExecBytes | models.ExecEvent]:
        """The node's interactive session (`NodeActor.interactive`): its stream's first
        item names the session, which ``inputs`` then reach one actor call each, in
        order; the rest is the command's output. The session's lease is renewed while
        this runs. Closing this ends the session on the node, which kills the command
        (as on one host)."""
        stream = self._stream(self.actor.interactive, machine_id, req, pty)
        async with contextlib.aclosing(stream) as events:
            sid = await anext(events)
            helpers = [asyncio.create_task(self._feed(sid, inputs),
                                           name=f"stdin {machine_id} {sid}"),
                       asyncio.create_task(self._renew(sid), name=f"lease {machine_id} {sid}")]
            try:
                async for event in events:
                    yield event
            finally:
                for task in helpers:
                    task.cancel()
                # Not awaited: a lost node must not hold the close. It ends the session
                # also where the stream's cancel did not reach the node's task.
                if self.alive:
                    with contextlib.suppress(Exception):
                        self.actor.interactive_end.remote(sid)

    async def _feed(self, sid: str, inputs: AsyncIterator[pm.ExecInput]) -> None:
        """Hand a node's interactive session ``inputs`` until either ends (a lost node:
        the session's stream says so)."""
        try:
            async for item in inputs:
                if not await self._ask(self.actor.interactive_input.remote(sid, item)):
                    return  # the command ended: its stream tells the rest
        except BoxdError as exc:
            log.debug("session=%s event=input_stopped error=%s", sid, exc.message)

    async def _renew(self, sid: str) -> None:
        """Renew a node's interactive session's lease until it is over (a control plane
        that dies stops renewing: the node ends the session when its lease lapses)."""
        with contextlib.suppress(BoxdError):  # a lost node: the session's stream says so
            while True:
                await asyncio.sleep(RENEW)
                if not await self._ask(self.actor.interactive_renew.remote(sid)):
                    return

    async def upload(
        self, machine_id: str, path: str, data: bytes | AsyncIterable[bytes], mode: int,
        user: str | None = None,
    ) -> models.FileInfo:
        """Chunks go to the node one actor call each (the node writes them to the guest
        as they come; a few in flight at most)."""
        sid: str = await self._ask(self.actor.upload_begin.remote(
            machine_id, path, mode, user=user))
        try:
            if isinstance(data, bytes):
                for off in range(0, len(data), CHUNK):
                    await self._ask(self.actor.upload_chunk.remote(
                        sid, data[off:off + CHUNK]))
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
        stream = self._stream(self.actor.download, machine_id, path)
        async with contextlib.aclosing(stream) as chunks:
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
        await receive_snapshot(self.actor, store, digest, raw, offers)

    async def receive_image(self, store: ImageStore, digests: list[str]) -> None:
        """Copy the blobs of ``digests`` (an image's manifest, config and layers) this
        node's image store lacks from ``store``, chunk by chunk; the node verifies each.
        One push of an image to this node at a time (a second create waits for it), and
        none once the node holds it (``_images``)."""
        async with self._pushing.setdefault(digests[0], asyncio.Lock()), \
                self._images_gate.shared():
            if digests[0] in self._images:
                return
            missing: list[str] = await self._ask(self.actor.image_missing.remote(digests))
            for digest in missing:
                try:
                    f = open(store.path(digest), "rb")  # noqa: SIM115 (closed below)
                except FileNotFoundError:
                    raise NotFound(f"image blob {digest} left the control plane's store",
                                   hint="the image was removed meanwhile; import it "
                                   "again") from None
                with f:
                    size, offset = os.fstat(f.fileno()).st_size, 0
                    while True:
                        data = await asyncio.to_thread(f.read, CHUNK)
                        await self._ask(self.actor.image_put.remote(digest, size, offset, data))
                        offset += len(data)
                        if offset >= size:
                            break
            self._images.add(digests[0])

    async def drop_snapshot(self, digest: str) -> None:
        await self._ask(self.actor.drop_snapshot.remote(digest))

    async def drop_received(self, source_id: str) -> None:
        await self._ask(self.actor.drop_received.remote(source_id))

    async def collect_images(self, keep: Callable[[], set[str]]) -> int:
        async with self._images_gate.alone():
            kept = keep()  # no push is under way: what it pushes, the records name
            removed: int = await self._ask(self.actor.collect_images.remote(sorted(kept)))
            self._images &= kept
            return removed

    async def snapshot_digests(self) -> set[str]:
        return set(await self._ask(self.actor.snapshot_digests.remote()))

    async def delete(self, machine_id: str) -> None:
        rec = self.repos.machines.get(machine_id)
        with contextlib.suppress(NodeLost, MachineNotFound):  # nothing is left of it there
            await self._ask(self.actor.call.remote("delete", machine_id))
        self.repos.machines.delete(machine_id)
        digest = rec.snapshot if rec is not None else None
        if digest and not self.repos.snapshots.digest_used(digest):
            # Its snapshot left the registry while it ran from it: the node kept its copy
            # then (`drop_snapshot` refuses one in use); the last such machine lets it go.
            with contextlib.suppress(BoxdError):
                await self.drop_snapshot(digest)

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

    async def process_output(self, machine_id: str, process_id: str, after: int | None,
                             wait: float) -> pm.ProcessOutput:
        out: pm.ProcessOutput = await self._call("process_output", machine_id, process_id,
                                                 after, wait)
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


class _Gate:
    """Held by many at once (`shared`) or by one alone (`alone`); one waiting to hold
    it alone goes before sharers that come after it."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._sharers = 0
        self._alone = False
        self._waiting = 0  # waiting to hold it alone

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._alone and not self._waiting)
            self._sharers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._sharers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._alone and not self._sharers)
            finally:
                self._waiting -= 1
                self._cond.notify_all()  # sharers held back by this wait may go now
            self._alone = True
        try:
            yield
        finally:
            async with self._cond:
                self._alone = False
                self._cond.notify_all()


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

    async def recv(self) -> bytes | bytearray | None:
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
        self.lifecycle = Lifecycle(repos.machines)  # the mirror's writes (the nodes' own
        self.nodes: dict[str, RayNode] = {}          # Lifecycles move the machines)
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
                                       self.repos, self.quota, self.lifecycle))
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
        lost = self.lifecycle.mark_lost(node.id, f"its node {node.id} is gone: {why}")
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


def _conforms(node: RayNode, cluster: RayCluster) -> tuple[ClusterNode, Cluster]:
    return node, cluster  # mypy proves RayNode and RayCluster implement the protocols


__all__ = ["INFO_TTL", "POLL", "RENEW", "RayCluster", "RayNode"]
