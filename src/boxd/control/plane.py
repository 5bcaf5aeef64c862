"""The control plane: accounts, names, quotas, the snapshot registry and placement.

It implements the service contracts of `boxd.services` on top of nodes (the `Node`
protocol): it claims a machine's name and quota slot by inserting its record, picks
the node (`control/placement.py`), and asks that node to launch, fork, checkpoint, run
and delete. Reads (`get`, `list`) are pure: they return the records as they are.

It holds either the nodes of this host (`LocalNode`) or a `Cluster` of nodes
(`ClusterNode`: liveness, address, snapshot blobs, node-to-node forks), and calls
those capabilities; it never asks what kind of node it holds (`control/nodes.py`).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import json
import logging
import secrets
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
)
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, TypeVar

from boxd import models
from boxd import process_models as pm
from boxd.config import DEFAULT_MACHINE_QUOTA
from boxd.control import netpolicy
from boxd.control.admission import Admission
from boxd.control.forking import ForkPlacement
from boxd.control.idempotency import Idempotency, fingerprint
from boxd.control.lifetimes import Lifetimes
from boxd.control.nodes import Cluster, ClusterNode, LocalNode
from boxd.control.placement import Placement, Room, check_hint
from boxd.engine.registry import ENGINES
from boxd.errors import (
    BoxdError,
    InvalidRequest,
    MachineNotFound,
    NodeLost,
    NotFound,
    SnapshotNotFound,
)
from boxd.images.oci import image_by_digest, resolve_image
from boxd.models import NAME_RE, NAME_RULE, MachineState
from boxd.net_policy import DEFAULT as DEFAULT_POLICY
from boxd.net_policy import NetPolicy
from boxd.node import SERVICE_ID, service_argv
from boxd.node.base import Boot, FromSnapshot, Node, ProcessStream
from boxd.services import GuestApi
from boxd.state import (
    CheckpointRecord,
    MachineRecord,
    Repos,
    RunImage,
    SnapshotRecord,
    new_id,
)
from boxd.storage import SnapshotStore
from boxd.storage.oci import ImageStore

log = logging.getLogger("boxd.control")

_T = TypeVar("_T")


def validate_name(name: str, kind: str = "machine") -> str:
    """Check a DNS-label name.

    Raises:
        InvalidRequest: the name breaks the rule.
    """
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidRequest(
            f"invalid {kind} name {name!r}: use {NAME_RULE}", field="name",
            hint="e.g. rl-base or rollout-3",
        )
    return name


def machine_url(rec: MachineRecord, host: str = "127.0.0.1") -> str | None:
    """``http://HOST:PORT/TOKEN``, the path segment the URL proxy requires and strips
    (node/_proxy.py); a public machine's is the bare ``http://HOST:PORT``."""
    if not rec.port:
        return None
    if rec.url_public:
        return f"http://{host}:{rec.port}"
    return f"http://{host}:{rec.port}/{rec.url_token}" if rec.url_token else None


def machine_model(rec: MachineRecord, host: str = "127.0.0.1") -> models.Machine:
    """The API's view of a record; ``host`` serves its URL (its node's address)."""
    return models.Machine(
        id=rec.id, name=rec.name, state=rec.state, vcpus=rec.vcpus, memory_mib=rec.memory_mib,
        disk_gib=rec.disk_gib, isolated=rec.isolated, port=rec.port,
        url=machine_url(rec, host), public=rec.url_public, parent_id=rec.parent_id,
        snapshot=rec.snapshot, accelerator=rec.accel, error=rec.error,
        created_at=rec.created_at, node=rec.node_id, engine=rec.engine,
        suspend_after=rec.suspend_after, hibernate_after=rec.hibernate_after,
        idle_seconds=round(max(0.0, time.time() - rec.last_active), 3),
        labels=dict(rec.labels),
        end_at=(datetime.fromtimestamp(rec.end_at, UTC) if rec.end_at is not None else None),
        on_timeout=models.check_on_timeout(rec.on_timeout or "delete")
        if rec.end_at is not None else None,
        image=models.MachineImage(name=rec.run_image.name, digest=rec.run_image.digest,
                                  service=service_argv(rec.run_image) or [])
        if rec.run_image is not None else None,
        expose_host=list(rec.net.expose_host),
        egress=list(rec.net.egress) if rec.net.egress is not None else None,
    )


class Machines:
    """The `MachineService`: machines of accounts, on nodes."""

    def __init__(
        self, repos: Repos, nodes: Mapping[str, LocalNode], store: SnapshotStore, *,
        default_quota: int = DEFAULT_MACHINE_QUOTA, cluster: Cluster | None = None,
        placement: Placement | None = None, images: ImageStore | None = None,
    ) -> None:
        self.repos = repos
        self.images = images  # imported container images (`MachineCreate.image`)
        self.local = nodes  # this host's nodes (none on a cluster's control plane)
        self.store = store
        self.default_quota = default_quota
        self.snapshots: Snapshots | None = None
        self.cluster = cluster  # nodes on Ray (`boxd serve --ray`); None: this host only
        self.placement = placement or Placement()
        # Held from a fork batch's placement to its claims: a concurrent batch reads
        # the room after them, so together they keep every node's cap.
        self._placing = asyncio.Lock()
        self.idempotency = Idempotency(repos)
        self.forks = ForkPlacement(lambda: self.nodes, lambda: self.cluster, self.placement,
                                   self._room, self._forget, self._push_image)
        self.admission = Admission()  # requests with wait= (`control/admission.py`)
        repos.machines.on_free = self.admission.freed
        # Ends machines at their lifetime's end (one task for all; started by recover)
        self.lifetimes = Lifetimes(repos, delete=lambda r: self.delete(r.account_id, r.id),
                                   hibernate=lambda r: self._node(r).hibernate(r.id))

    @property
    def nodes(self) -> Mapping[str, Node]:
        """Every node machines may be on: the cluster's, or this host's."""
        return self.cluster.nodes if self.cluster is not None else self.local

    @nodes.setter
    def nodes(self, nodes: Mapping[str, LocalNode]) -> None:
        """Replace this host's nodes (a restarted node runtime)."""
        self.local = nodes

    # ------------------------------------------------------------- placement

    def _alive(self, node_id: str) -> bool:
        """A node of this host is always alive; a cluster's until it died."""
        if self.cluster is None:
            return node_id in self.local
        node = self.cluster.nodes.get(node_id)
        return node is not None and node.alive

    def _live_cluster_nodes(self) -> builtins.list[ClusterNode]:
        return [n for n in self.cluster.nodes.values() if n.alive] if self.cluster else []

    def _node(self, rec: MachineRecord) -> Node:
        node = self.nodes.get(rec.node_id)
        if rec.state == MachineState.LOST or node is None or not self._alive(node.id):
            raise NodeLost(
                f"machine {rec.name!r} is lost: {rec.error or f'its node {rec.node_id} is gone'}",
                machine=rec.name, node=rec.node_id,
                hint=f"delete it (`boxd machine delete {rec.name}`) and create or fork again",
            )
        return node

    def _model(self, rec: MachineRecord) -> models.Machine:
        node = self.cluster.nodes.get(rec.node_id) if self.cluster is not None else None
        return machine_model(rec, (node.address if node is not None else "") or "127.0.0.1")

    def quota_of(self, account: str) -> int:
        acct = self.repos.accounts.get(account)
        return acct.max_machines if acct is not None else self.default_quota

    async def _room(self) -> dict[str, Room]:
        """Per live cluster node: free slots under its cap, free memory."""
        counts = self.repos.machines.count_by_node()
        live = self._live_cluster_nodes()
        infos = await asyncio.gather(*(n.info() for n in live))
        return {n.id: Room(i.max_machines - counts.get(n.id, 0), i.memory_free_mib,
                           i.max_machines)
                for n, i in zip(live, infos, strict=True)}

    async def _place(
        self, hint: str | None = None, prefer: set[str] | None = None, count: int = 1
    ) -> builtins.list[Node]:
        """The nodes ``count`` new machines go to.

        One host: its node. On a cluster: `Placement.choose` (``hint`` if given, else
        ``prefer`` first, then the most free memory, each node up to its cap).

        Raises:
            NotFound: ``hint`` names no node.
            ResourceExhausted: every node is at its cap (BOXD_NODE_MAX_MACHINES).
        """
        check_hint(hint, self.nodes)
        if self.cluster is None:
            return [self.nodes[hint] if hint else next(iter(self.nodes.values()))] * count
        chosen = self.placement.choose(await self._room(), count, hint=hint,
                                       prefer=prefer or set())
        return [self.nodes[nid] for nid in chosen]

    async def _launch(
        self, hint: str | None, prefer: set[str], launch: Callable[[Node], Awaitable[_T]]
    ) -> _T:
        """Run ``launch`` on the node placement picks. On a cluster, a launch that failed
        on a node is tried on the next one, without the nodes that failed
        (`Placement.launch`); on one host its node answers.

        Raises:
            NotFound: ``hint`` names no node.
            ResourceExhausted: every node is at its cap.
        """
        check_hint(hint, self.nodes)
        if self.cluster is None:
            return await launch((await self._place(hint))[0])
        return await self.placement.launch(
            self._room, lambda nid: launch(self.nodes[nid]), hint=hint, prefer=prefer)

    def queue(self, account: str) -> models.AdmissionQueue:
        return self.admission.waiting(account)

    async def nodes_list(self) -> builtins.list[models.NodeInfo]:
        return [await node.info() for node in self.nodes.values()]

    def _find(self, account: str, ref: str) -> MachineRecord:
        rec = self.repos.machines.find(account, ref)
        if rec is None or rec.state == MachineState.DELETING:
            raise MachineNotFound(
                f"no machine named {ref!r}", machine=ref,
                hint="`boxd machine list` shows your machines",
            )
        return rec

    async def _claim(
        self, account: str, name: str | None, node: Node, *, vcpus: int, memory_mib: int,
        disk_gib: int, isolated: bool, parent_id: str | None = None,
        snapshot: str | None = None, image: str | None = None, engine: str | None = None,
        suspend_after: float | None = None, hibernate_after: float | None = None,
        public: bool = False, labels: Mapping[str, str] | None = None,
        timeout: int | None = None, on_timeout: str = "delete",
        run_image: RunImage | None = None, net: NetPolicy = DEFAULT_POLICY,
    ) -> MachineRecord:
        name = validate_name(name if name is not None else f"machine-{secrets.token_hex(3)}")
        rec = self.lifetimes.hold(self.repos.machines.claim(
            account, name, machine_id=new_id("m"), vcpus=vcpus, memory_mib=memory_mib,
            disk_gib=disk_gib, isolated=isolated, image=image or await node.image_key(),
            node_id=node.id, engine=engine or await node.engine_name(), parent_id=parent_id,
            snapshot=snapshot, default_quota=self.default_quota,
            suspend_after=suspend_after, hibernate_after=hibernate_after, url_public=public,
            labels=models.check_labels(labels or {}), run_image=run_image,
            end_at=self.lifetimes.end_at(timeout), on_timeout=models.check_on_timeout(on_timeout),
            net=net,
        ))
        self.admission.claimed()  # its slot is taken: the next queued request may try
        return rec

    # ---------------------------------------------------------------- create

    async def create(
        self, account: str, req: models.MachineCreate, idempotency_key: str | None = None,
    ) -> models.Machine:
        """Create and boot a machine; a retry with ``idempotency_key`` returns the first
        request's machine (`control/idempotency.py`).

        Raises:
            InvalidRequest, AlreadyExists, QuotaExceeded, SnapshotNotFound,
            HostSetupError; IdempotencyKeyReused: the key named another request.
        """
        def admitted() -> Awaitable[models.Machine]:
            return self.admission.run(account, req.wait, lambda: self._create(account, req))

        if idempotency_key is None:
            return await admitted()
        return await self.idempotency.machine(
            account, idempotency_key,
            fingerprint("create", req.model_dump(mode="json", exclude={"wait"})),
            admitted, lambda m: _as_now(self, account, m))

    async def _create(self, account: str, req: models.MachineCreate) -> models.Machine:
        if req.name is not None:
            validate_name(req.name)
        if req.engine is not None and req.engine not in ENGINES:
            raise InvalidRequest(f"unknown engine {req.engine!r}", field="engine",
                                 hint=f"use one of {', '.join(ENGINES)}")
        run_image = await _run_image(self.images, account, req)
        net = await netpolicy.policy_for(req)
        if req.from_snapshot:
            return await self._create_from_snapshot(account, req, net)

        async def launch(node: Node) -> MachineRecord:
            rec = await self._claim(
                account, req.name, node, vcpus=req.vcpus, memory_mib=req.memory_mib,
                disk_gib=req.disk_gib, isolated=req.isolated, engine=req.engine,
                suspend_after=req.suspend_after, hibernate_after=req.hibernate_after,
                public=req.public, labels=req.labels, timeout=req.timeout,
                on_timeout=req.on_timeout or "delete", run_image=run_image, net=net,
            )
            held.append(rec)
            await self._give_image(rec, node)
            await node.create(rec.id, Boot())  # on failure the record is gone
            return rec

        with self.lifetimes.launching() as held:  # its end waits for the create
            rec = await self._launch(req.node, set(), launch)
        return await self.get(account, rec.id)

    async def _give_image(self, rec: MachineRecord, node: Node) -> None:
        """On a cluster: a new image machine's node gets its image (failed: no record)."""
        try:
            if rec.run_image is not None and self.cluster is not None:
                await self._push_image(node.id, rec.run_image.digest)
        except BaseException:
            await self._forget(rec.id, node)
            raise

    async def _push_image(self, node_id: str, digest: str) -> None:
        """On a cluster: give the node the image's blobs it lacks (to create or fork on)."""
        assert self.images is not None and self.cluster is not None
        info = await asyncio.to_thread(image_by_digest, self.images, digest, digest)
        await self.cluster.nodes[node_id].receive_image(
            self.images, [info.digest, info.config_digest, *(d.digest for d in info.layers)])

    async def _create_from_snapshot(
        self, account: str, req: models.MachineCreate, net: NetPolicy
    ) -> models.Machine:
        assert self.snapshots is not None and req.from_snapshot is not None
        snap = self.snapshots.resolve(account, req.from_snapshot)
        manifest = self.store.get(snap.digest)
        holders: dict[str, ClusterNode] = {}
        if self.cluster is None:
            await asyncio.to_thread(self.store.ensure_verified, manifest.digest)
        else:  # the blobs are on the nodes that saved or received it
            holders = await _holders(self._live_cluster_nodes(), manifest.digest,
                                     req.from_snapshot, snap.name)
        meta = manifest.meta
        engine = str(meta.get("engine") or "qemu")
        source = FromSnapshot(
            manifest.digest, manifest.blob_path("memory"), manifest.blob_path("state"),
            manifest.blob_path("disk"),
        )

        async def launch(node: Node) -> MachineRecord:
            _check_engine(req, engine)  # after placement, as its errors come first
            netpolicy.check_isolated(bool(meta.get("isolated", False)), net)
            rec = await self._claim(
                account, req.name, node, vcpus=int(meta.get("vcpus", req.vcpus)),
                memory_mib=int(meta.get("memory_mib", req.memory_mib)),
                disk_gib=max(req.disk_gib, int(meta.get("disk_gib", req.disk_gib))),
                isolated=req.isolated or bool(meta.get("isolated", False)),
                snapshot=manifest.digest, engine=engine, public=req.public, labels=req.labels,
                suspend_after=req.suspend_after, hibernate_after=req.hibernate_after,
                timeout=req.timeout, on_timeout=req.on_timeout or "delete",
                run_image=RunImage.from_json(meta.get("run_image")), net=net,
            )
            held.append(rec)
            if self.cluster is None:
                await node.create(rec.id, source)
            else:  # a node that lacks the blobs pulls them from one that holds them
                await self._give_image(rec, node)  # ... and an image machine's image
                target = self.cluster.nodes[node.id]
                holder = holders.get(node.id) or next(iter(holders.values()))
                await target.create(rec.id, source,
                                    holder=None if holder.id == node.id else holder)
            return rec

        with self.lifetimes.launching() as held:
            rec = await self._launch(req.node, set(holders), launch)
        return await self.get(account, rec.id)

    # ------------------------------------------------------------ inspection

    async def get(self, account: str, ref: str) -> models.Machine:
        return self._model(self._find(account, ref))

    async def list(self, account: str) -> builtins.list[models.Machine]:
        return [self._model(r) for r in self.repos.machines.list(account)]

    async def list_page(
        self, account: str, *, labels: Mapping[str, str] | None = None,
        state: MachineState | None = None, limit: int = models.DEFAULT_LIST_LIMIT,
        cursor: str | None = None,
    ) -> models.MachineList:
        """One page of the account's machines that carry every label of ``labels`` (and
        are in ``state``), oldest first; its ``next_cursor`` continues after it.

        Raises:
            InvalidRequest: bad labels, a ``limit`` outside 1-MAX_LIST_LIMIT, or a cursor
                this daemon did not make.
        """
        _check_limit(limit, models.MAX_LIST_LIMIT)
        recs = self.repos.machines.page(
            account, labels=models.check_labels(labels or {}, "label"), state=state,
            after=_decode_cursor(cursor) if cursor else None, limit=limit)
        last = recs[-1] if len(recs) == limit else None
        return models.MachineList(
            machines=[self._model(r) for r in recs],
            next_cursor=_encode_cursor(last.created_at, last.id) if last else None)

    async def delete_many(
        self, account: str, labels: Mapping[str, str], state: MachineState | None = None,
    ) -> builtins.list[tuple[models.MachineRef, Exception | None]]:
        """Delete every machine of the account that carries all of ``labels`` (and is in
        ``state``): a crashed run's cleanup. Each item is a machine and the error that
        stopped its delete, or None; one failure does not stop the others.

        Raises:
            InvalidRequest: no label (an empty selector would take every machine), or a
                bad one.
        """
        return await _delete_by_labels(self.repos, self.delete, account, labels, state)

    async def wait_until_ready(self, account: str, ref: str, timeout: float) -> models.Machine:
        rec = self._find(account, ref)
        await self._node(rec).wait_until_ready(rec.id, timeout)
        return await self.get(account, rec.id)

    # --------------------------------------------------------- guest access

    async def exec(self, account: str, ref: str, req: models.ExecRequest) -> models.ExecResult:
        rec = self._find(account, ref)
        return await self._node(rec).exec(rec.id, req)

    async def logs(self, account: str, ref: str, after: int | None,
                   wait: float) -> models.ServiceLog:
        """The machine's service output after offset ``after`` (`boxd.node._services`).

        Raises:
            MachineNotFound; NotFound: the machine has no service (no image, an image
                without ENTRYPOINT or CMD, or created with ``service=False``).
        """
        rec = self._find(account, ref)
        return await _service_log(self._node(rec), rec, after, wait)

    async def exec_result(
        self, account: str, ref: str, exec_id: str, wait: float = 0.0
    ) -> models.ExecStatus:
        rec = self._find(account, ref)
        return await self._node(rec).exec_result(rec.id, exec_id, wait)

    async def exec_list(self, account: str, ref: str, limit: int = models.DEFAULT_EXEC_LIST,
                        ) -> builtins.list[models.ExecSummary]:
        """Raises: MachineNotFound; InvalidRequest: ``limit`` outside 1-MAX_EXEC_LIST."""
        _check_limit(limit, models.MAX_EXEC_LIST)
        rec = self._find(account, ref)
        return await self._node(rec).exec_list(rec.id, limit)

    async def metrics(self, account: str, ref: str, start: float | None = None,
                      end: float | None = None) -> models.MachineMetrics:
        """Raises: MachineNotFound, InvalidRequest, MachineFailed (`MachineService`)."""
        if start is not None and end is not None and start > end:
            raise InvalidRequest(f"start ({start}) is after end ({end})", field="start")
        rec = self._find(account, ref)
        samples = await self._node(rec).machine_metrics(rec.id, start, end)
        now = self._find(account, rec.id)
        return models.MachineMetrics(machine=now.name, state=now.state, samples=samples)

    async def exec_stream(
        self, account: str, ref: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        rec = self._find(account, ref)
        async for event in self._node(rec).exec_stream(rec.id, req):
            yield event

    async def exec_interactive(
        self, account: str, ref: str, req: models.ExecRequest,
        inputs: AsyncIterator[pm.ExecInput], pty: tuple[int, int] | None = None,
    ) -> AsyncIterator[pm.ExecBytes | models.ExecEvent]:
        rec = self._find(account, ref)
        async for event in self._node(rec).exec_interactive(rec.id, req, inputs, pty):
            yield event

    async def upload(
        self, account: str, ref: str, path: str, data: bytes | AsyncIterable[bytes],
        mode: int = 0o644, user: str | None = None,
    ) -> models.FileInfo:
        if not path.startswith("/"):
            raise InvalidRequest(f"guest path must be absolute: {path!r}", field="path")
        rec = self._find(account, ref)
        return await self._node(rec).upload(rec.id, path, data, mode, user)

    async def download(self, account: str, ref: str, path: str) -> AsyncIterator[bytes]:
        if not path.startswith("/"):
            raise InvalidRequest(f"guest path must be absolute: {path!r}", field="path")
        rec = self._find(account, ref)
        async with contextlib.aclosing(self._node(rec).download(rec.id, path)) as chunks:
            async for chunk in chunks:
                yield chunk

    # ------------------------------------------------------------------ fork

    async def warm(self, account: str, ref: str, forks: int) -> models.Standby:
        """Standby forks on the source's node: the next forks there are claims (on a
        cluster, the first of a batch go to the source's node while it has room)."""
        if not 0 <= forks <= models.MAX_STANDBY_FORKS:
            raise InvalidRequest(f"forks must be 0-{models.MAX_STANDBY_FORKS}, not {forks}",
                                 field="forks")
        rec = self._find(account, ref)
        claimable = _claimable(self.repos, account, self.default_quota)
        return await self._node(rec).warm(rec.id, forks, claimable)

    async def fork(
        self, account: str, ref: str, names: builtins.list[str | None],
        node_hint: str | None = None, labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None, timeout: int | None = None,
        on_timeout: str = "delete", wait: float | None = None,
    ) -> builtins.list[models.Machine | Exception]:
        """Fork ``ref`` into one child per name (None: a generated name); each item is
        the child or the error that stopped it. ``node_hint`` puts every child on that
        node (a cluster's other node receives the source's template). The children
        carry the source's labels merged with ``labels``, and a lifetime of ``timeout``
        seconds (None: none; never the source's). A retry with ``idempotency_key``
        returns the first request's items (`control/idempotency.py`); with ``wait``
        the children that find no room wait for it (`control/admission.py`).

        Raises:
            InvalidRequest: a bad name, labels that break `models.LABEL_RULE` (with
                the source's), or a bad ``timeout`` or ``on_timeout``.
            IdempotencyKeyReused: the key named another request.
        """
        Lifetimes.check(timeout, on_timeout)

        def admitted() -> Awaitable[builtins.list[models.Machine | Exception]]:
            return self.admission.run_items(account, wait, len(names), lambda todo: self._fork(
                account, ref, [names[i] for i in todo], node_hint, labels, timeout,
                on_timeout))

        if idempotency_key is None:
            return await admitted()
        return await self.idempotency.items(
            account, idempotency_key,
            fingerprint("fork", ref, names, node_hint, labels or {}, timeout, on_timeout),
            admitted, lambda m: _as_now(self, account, m))

    async def _fork(
        self, account: str, ref: str, names: builtins.list[str | None],
        node_hint: str | None = None, labels: Mapping[str, str] | None = None,
        timeout: int | None = None, on_timeout: str = "delete",
    ) -> builtins.list[models.Machine | Exception]:
        src = self._find(account, ref)
        for n in names:
            if n is not None:
                validate_name(n)
        inherited = models.check_labels({**src.labels, **models.check_labels(labels or {})})
        node = self._node(src)
        async with self._placing:  # room counts claims: batches choose one at a time
            targets = await self.forks.targets(src, node, len(names), node_hint)
            claimed = await self._claim_children(account, src, names, targets, inherited,
                                                 timeout, on_timeout)
        with self.lifetimes.launching(claimed):  # their ends wait for the launch
            results = await self.forks.launch(src, node, claimed)
        out: builtins.list[models.Machine | Exception] = []
        for c in claimed:
            if isinstance(c, Exception):
                out.append(c)
                continue
            err = results[c.id]
            try:
                out.append(err if err is not None else self._model(self._find(account, c.id)))
            except MachineNotFound as exc:  # deleted as soon as it was made: its item only
                out.append(exc)
        return out

    async def _claim_children(
        self, account: str, src: MachineRecord, names: builtins.list[str | None],
        targets: builtins.list[Node | Exception], labels: Mapping[str, str],
        timeout: int | None = None, on_timeout: str = "delete",
    ) -> builtins.list[MachineRecord | Exception]:
        """Claim every child's name and quota slot first: one that fails is that item's
        error and the others go on."""
        claimed: builtins.list[MachineRecord | Exception] = []
        for n, target in zip(names, targets, strict=True):
            if isinstance(target, Exception):
                claimed.append(target)
                continue
            try:
                claimed.append(await self._claim(
                    account, n if n is not None else f"{src.name[:48]}-{secrets.token_hex(3)}",
                    target, vcpus=src.vcpus, memory_mib=src.memory_mib, disk_gib=src.disk_gib,
                    isolated=src.isolated, parent_id=src.id, snapshot=src.snapshot,
                    image=src.image, engine=src.engine, suspend_after=src.suspend_after,
                    hibernate_after=src.hibernate_after, public=src.url_public,
                    labels=labels, timeout=timeout, on_timeout=on_timeout,
                    run_image=src.run_image, net=src.net,
                ))
            except Exception as exc:
                claimed.append(exc)
        return claimed

    async def _forget(self, machine_id: str, node: Node) -> None:
        """Remove the record of a machine that was never launched."""
        if self.repos.machines.get(machine_id) is not None:
            await node.delete(machine_id)

    # ----------------------------------------------------------- checkpoints

    async def checkpoint_save(self, account: str, ref: str, name: str) -> models.Checkpoint:
        validate_name(name, "checkpoint")
        rec = self._find(account, ref)
        return _checkpoint(await self._node(rec).checkpoint_save(rec.id, name))

    async def checkpoint_restore(self, account: str, ref: str, name: str) -> models.Machine:
        rec = self._find(account, ref)
        await self._node(rec).checkpoint_restore(rec.id, name)
        return await self.get(account, rec.id)

    async def checkpoint_list(self, account: str, ref: str) -> builtins.list[models.Checkpoint]:
        rec = self._find(account, ref)
        return [_checkpoint(ck) for ck in await self._node(rec).checkpoint_list(rec.id)]

    async def checkpoint_delete(self, account: str, ref: str, name: str) -> None:
        rec = self._find(account, ref)
        await self._node(rec).checkpoint_delete(rec.id, name)

    # ------------------------------------------------------ suspend / hibernate

    async def suspend(self, account: str, ref: str) -> models.Machine:
        return await self._transition(account, ref, "suspend")

    async def hibernate(self, account: str, ref: str) -> models.Machine:
        return await self._transition(account, ref, "hibernate")

    async def resume(self, account: str, ref: str) -> models.Machine:
        return await self._transition(account, ref, "resume")

    async def _transition(self, account: str, ref: str,
                          op: Literal["suspend", "hibernate", "resume"]) -> models.Machine:
        rec = self._find(account, ref)
        await getattr(self._node(rec), op)(rec.id)
        return await self.get(account, rec.id)

    # -------------------------------------------------- processes (boxd.rl)

    async def spawn(self, account: str, ref: str, req: pm.SpawnRequest) -> pm.Process:
        rec = self._find(account, ref)
        return await self._node(rec).spawn(rec.id, req)

    async def processes(self, account: str, ref: str) -> builtins.list[pm.Process]:
        rec = self._find(account, ref)
        return await self._node(rec).processes(rec.id)

    async def process_kill(
        self, account: str, ref: str, process_id: str, signal: int
    ) -> pm.Process:
        rec = self._find(account, ref)
        return await self._node(rec).process_kill(rec.id, process_id, signal)

    async def process_output(self, account: str, ref: str, process_id: str,
                             after: int | None = None, wait: float = 0.0) -> pm.ProcessOutput:
        rec = self._find(account, ref)
        return await self._node(rec).process_output(rec.id, process_id, after, wait)

    @contextlib.asynccontextmanager
    async def process_attach(
        self, account: str, ref: str, process_id: str
    ) -> AsyncIterator[ProcessStream]:
        rec = self._find(account, ref)
        async with self._node(rec).process_attach(rec.id, process_id) as stream:
            yield stream

    async def set_timeout(
        self, account: str, ref: str, timeout: int | None, on_timeout: str | None = None,
    ) -> models.Machine:
        """`Lifetimes.set`. Raises: InvalidRequest, MachineNotFound."""
        Lifetimes.check(timeout, on_timeout or "delete")
        rec = self._find(account, ref)
        self.lifetimes.set(rec, timeout, on_timeout)
        return await self.get(account, rec.id)

    # ---------------------------------------------------------------- delete

    async def delete(self, account: str, ref: str) -> None:
        rec = self._find(account, ref)
        node = self.nodes.get(rec.node_id)
        await self.forks.source_gone(rec.id)
        if rec.state == MachineState.LOST or node is None or not self._alive(node.id):
            self.repos.machines.delete(rec.id)  # its node and VM are gone: only the record
            return
        await node.delete(rec.id)

    async def recover(self) -> None:
        self.idempotency.recover()  # keys of requests the last daemon was running
        if self.cluster is not None:
            await self.cluster.start()  # joins Ray; nodes recover their machines
        for node in self.nodes.values():
            await node.recover()
        if self.snapshots is not None:
            # interrupted saves and imports leave staging files and unreferenced blobs
            report = await asyncio.to_thread(self.store.gc, in_use=self.snapshots.in_use)
            log.info("event=snapshot_store_gc report=%s", report)
        # after the nodes recovered: the ends that passed while the daemon was down
        # are ended at once, the others when they come
        self.lifetimes.reaper.start()

    async def close(self) -> None:
        await self.lifetimes.reaper.stop()
        if self.cluster is not None:
            await self.cluster.close()
        for node in self.nodes.values():
            await node.close()

    def serve_guests(self, handler: GuestApi) -> None:
        """Serve in-guest API sockets with ``handler`` on every node that can: the local
        node (a remote node's machines have no route to this daemon's app yet)."""
        for node in self.local.values():
            node.serve_guests(handler)


async def _service_log(node: Node, rec: MachineRecord, after: int | None,
                       wait: float) -> models.ServiceLog:
    """`Machines.logs` on the machine's node."""
    try:
        out = await node.process_output(rec.id, SERVICE_ID, after, wait)
    except NotFound as exc:
        if isinstance(exc, MachineNotFound):
            raise
        raise NotFound(f"machine {rec.name!r} has no service", machine=rec.name,
                       hint="a machine of an image with ENTRYPOINT or CMD has one "
                       "(`boxd machine new NAME --image REF`)") from None
    procs = {p.id: p for p in await node.processes(rec.id)}
    argv = procs[SERVICE_ID].argv if SERVICE_ID in procs else []
    return models.ServiceLog(start=out.start, end=out.end,
                             data=out.data.decode(errors="replace"), state=out.state,
                             exit_code=out.exit_code, argv=argv)


def _claimable(repos: Repos, account: str, default_quota: int) -> int:
    """The machines ``account``'s quota still lets it start. Standby forks it could never
    claim would hold memory for nothing: its pools on a node hold no more than these."""
    acct = repos.accounts.get(account)
    if acct is not None:
        return acct.max_machines - acct.used
    return default_quota - sum(m.state not in (MachineState.DELETING, MachineState.HIBERNATED)
                               for m in repos.machines.list(account))


def _check_limit(limit: int, most: int) -> None:
    """Raises: InvalidRequest: ``limit`` is outside 1-``most``."""
    if not 1 <= limit <= most:
        raise InvalidRequest(f"limit must be 1-{most}, not {limit}", field="limit")


def _as_now(plane: Machines, account: str, kept: models.Machine) -> models.Machine:
    """A machine a keyed request made, as it is now (as it was made, if deleted)."""
    rec = plane.repos.machines.get(kept.id)
    ok = rec is not None and rec.account_id == account and rec.state != MachineState.DELETING
    return plane._model(rec) if rec is not None and ok else kept


#: Machines a delete by labels deletes at once (one page of its selector).
_DELETE_PAGE = 32

async def _delete_by_labels(
    repos: Repos, delete: Callable[[str, str], Awaitable[None]], account: str,
    labels: Mapping[str, str], state: MachineState | None,
) -> list[tuple[models.MachineRef, Exception | None]]:
    """`Machines.delete_many`: a page of records in memory at a time, each deleted."""
    labels = models.check_labels(labels, "label")
    if not labels:
        raise InvalidRequest(
            "delete by labels needs at least one label: an empty selector would "
            "delete every machine", field="label",
            hint="give the labels of what to delete, e.g. label=boxd.rl/run=ID")
    out: list[tuple[models.MachineRef, Exception | None]] = []
    after: tuple[float, str] | None = None
    while True:  # a page at a time: the records in memory are one page's
        recs = repos.machines.page(account, labels=labels, state=state,
                                        after=after, limit=_DELETE_PAGE)
        if not recs:
            return out
        after = (recs[-1].created_at, recs[-1].id)
        results = await asyncio.gather(*(delete(account, r.id) for r in recs),
                                       return_exceptions=True)
        for rec, res in zip(recs, results, strict=True):
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res  # a cancellation is the request's, not an item's
            err = None if isinstance(res, MachineNotFound) else res  # gone meanwhile
            out.append((models.MachineRef(id=rec.id, name=rec.name), err))


def _checkpoint(ck: CheckpointRecord) -> models.Checkpoint:
    return models.Checkpoint(id=ck.id, name=ck.name, machine_id=ck.machine_id,
                             created_at=ck.created_at)


def _encode_cursor(created_at: float, machine_id: str) -> str:
    """An opaque list cursor: the (created_at, id) key of the last machine of a page."""
    raw = json.dumps([created_at, machine_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[float, str]:
    """Raises: InvalidRequest: not a cursor of `_encode_cursor`."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, machine_id = json.loads(raw)
        if isinstance(created_at, int | float) and isinstance(machine_id, str):
            return float(created_at), machine_id
    except (ValueError, TypeError):
        pass
    raise InvalidRequest(f"invalid cursor {cursor[:40]!r}", field="cursor",
                         hint="pass the next_cursor of the previous page as given")


async def _run_image(images: ImageStore | None, account: str,
                     req: models.MachineCreate) -> RunImage | None:
    """The imported image ``req.image`` of ``account`` as a machine records it (None:
    the request names none).

    Raises:
        InvalidRequest: the request names a snapshot too.
        NotFound: the account has no such image (the hint names `boxd image import`).
    """
    ref = req.image
    if ref is None:
        return None
    if req.from_snapshot:
        raise InvalidRequest("a machine starts from an image or from a snapshot, not both",
                             field="image")
    if images is None:
        raise NotFound(f"no image {ref!r}: this daemon keeps no imported images",
                       hint="import it with `boxd image import` on a daemon")
    info = await asyncio.to_thread(resolve_image, images, account, ref)
    c = info.config
    return RunImage(info.name.removeprefix(f"{account}/"), info.digest, c.env,
                    c.working_dir, c.user, c.entrypoint, c.cmd, c.healthcheck,
                    c.exposed_ports, req.service)


def _check_engine(req: models.MachineCreate, engine: str) -> None:
    """A snapshot starts on the engine it was saved on.

    Raises:
        InvalidRequest: ``req`` names another engine.
    """
    if req.engine is not None and req.engine != engine:
        raise InvalidRequest(
            f"snapshot {req.from_snapshot!r} was saved on the {engine} engine; it cannot "
            f"start on {req.engine}", field="engine",
            hint=f"leave the engine out (it starts on {engine}), or save a snapshot of a "
            f"machine running on {req.engine}",
        )


class Snapshots:
    """The `SnapshotService`: named, versioned snapshots per account."""

    def __init__(self, machines: Machines, store: SnapshotStore) -> None:
        self.machines = machines
        self.repos = machines.repos
        self.store = store

    def in_use(self) -> set[str]:
        """Blob digests that machines started from snapshots still map or back onto."""
        return self.store.blobs_of(
            d for node in self.machines.nodes.values() for d in node.snapshot_digests_in_use()
        )

    def resolve(self, account: str, ref: str) -> SnapshotRecord:
        """Find a snapshot by NAME, NAME@N or sha256:HEX.

        Raises:
            SnapshotNotFound: nothing matches.
        """
        rec: SnapshotRecord | None = None
        if ref.startswith("sha256:"):
            rec = self.repos.snapshots.by_digest(account, ref[7:])
        elif "@" in ref:
            name, _, ver = ref.partition("@")
            if ver.isdigit():
                rec = self.repos.snapshots.by_version(account, name, int(ver))
        else:
            rec = self.repos.snapshots.latest(account, ref)
        if rec is None:
            raise SnapshotNotFound(
                f"no snapshot {ref!r}", snapshot=ref,
                hint="`boxd snapshots list` shows your snapshots",
            )
        return rec

    def _model(self, rec: SnapshotRecord) -> models.Snapshot:
        m = self.store.get(rec.digest)
        meta = m.meta
        return models.Snapshot(
            id=rec.id, name=rec.name, version=rec.version, digest="sha256:" + rec.digest,
            created_at=rec.created_at, source_machine=meta.get("source_machine"),
            memory_bytes=m.blobs["memory"].size if "memory" in m.blobs else 0,
            disk_bytes=m.blobs["disk"].size if "disk" in m.blobs else 0,
            stored_bytes=m.stored_bytes(), engine=meta.get("engine"),
            cpu_model=meta.get("cpu_model"), image=meta.get("image"),
        )

    async def save(
        self, account: str, machine_ref: str, name: str, *, new_version: bool = False
    ) -> models.Snapshot:
        validate_name(name, "snapshot")
        rec = self.machines._find(account, machine_ref)
        self.repos.snapshots.check_name(account, name, new_version=new_version)  # fail early
        digest = await self.machines._node(rec).save_snapshot(rec.id, {
            "name": name, "source_machine": rec.name, "source_machine_id": rec.id,
            "created_at": time.time(), "memory_mib": rec.memory_mib, "vcpus": rec.vcpus,
            "disk_gib": rec.disk_gib, "isolated": rec.isolated,
        })
        node = self.machines._node(rec)
        cluster = self.machines.cluster
        if cluster is not None:  # the registry keeps the manifest; blobs stay on the node
            raw = await cluster.nodes[node.id].manifest(digest)
            await asyncio.to_thread(self.store.add_manifest, raw, digest)
        snap = self.repos.snapshots.add(account, name, digest, new_version=new_version)
        log.info("snapshot=%s event=saved name=%s digest=%s", snap.id, name, digest[:12])
        return self._model(snap)

    async def list(self, account: str) -> builtins.list[models.Snapshot]:
        return [self._model(r) for r in self.repos.snapshots.list(account)
                if self.store.exists(r.digest)]

    async def get(self, account: str, ref: str) -> models.Snapshot:
        return self._model(self.resolve(account, ref))

    async def delete(self, account: str, ref: str) -> None:
        rec = self.resolve(account, ref)
        self.repos.snapshots.delete(rec.id)
        if not self.repos.snapshots.digest_used(rec.digest):
            await asyncio.to_thread(self.store.delete, rec.digest, in_use=self.in_use)
            for node in self.machines._live_cluster_nodes():  # they hold the blobs
                try:
                    await node.drop_snapshot(rec.digest)
                except BoxdError as exc:  # its store collects them later
                    log.warning("node=%s event=snapshot_drop_failed error=%s", node.id, exc)

    async def export(self, account: str, ref: str) -> Path:
        rec = self.resolve(account, ref)
        if self.machines.cluster is not None:
            await self._fetch_blobs(rec.digest)
        out = self.store.root / "staging" / f"export-{secrets.token_hex(6)}.boxd"
        out.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.store.export, rec.digest, out)
        return out

    async def _fetch_blobs(self, digest: str) -> None:
        """On a cluster: copy a snapshot's blobs from a node that holds them into the
        control plane's store (which holds manifests only until then)."""
        raw = self.store.manifest_bytes(digest)
        if not self.store.missing(raw, digest):
            return
        for node in self.machines._live_cluster_nodes():
            if digest in await node.snapshot_digests():
                await node.fetch_snapshot(digest, self.store)
                return
        raise SnapshotNotFound(f"snapshot {digest[:12]} is on no live node",
                               snapshot=digest, hint="the nodes that held it are gone")

    async def import_(self, account: str, path: Path, name: str | None = None) -> models.Snapshot:
        if self.machines.cluster is not None:
            raise InvalidRequest(
                "snapshot import is not available on a cluster yet", field="file",
                hint="import it on a single-host daemon, start a machine from it there, "
                "or save the snapshot from a machine on the cluster",
            )
        manifest = await asyncio.to_thread(self.store.import_, path)
        name = name or str(manifest.meta.get("name") or "")
        if not name:
            raise InvalidRequest("the imported snapshot has no name; pass one", field="name")
        existing = self.repos.snapshots.named(account, name, manifest.digest)
        if existing is not None:
            return self._model(existing)
        return self._model(self.repos.snapshots.add(account, name, manifest.digest,
                                                    new_version=True))


async def _holders(nodes: Iterable[ClusterNode], digest: str, ref: str,
                   name: str) -> dict[str, ClusterNode]:
    """The live nodes holding snapshot ``digest``'s blobs (those that saved or received
    it). Raises: SnapshotNotFound: none does."""
    holders = {n.id: n for n in nodes if digest in await n.snapshot_digests()}
    if not holders:
        raise SnapshotNotFound(f"snapshot {ref!r} is on no live node", snapshot=name,
                               hint="the nodes that held it are gone; import it again")
    return holders


__all__ = ["Machines", "Snapshots", "machine_model", "validate_name"]
