"""A node runtime as a Ray actor (``boxd serve --ray ADDRESS``): one per Ray node.

Every Ray node that offers the custom resource ``boxd`` gets one `NodeActor`, pinned
to it by node affinity and named after the node (a restarted control plane finds the
same actors again). The actor runs the same `NodeRuntime` as a single host, with its
own data directory (``<node root>/nodes/<ray node id>``: its own database, disks,
snapshot store, sockets and ports), so several Ray nodes on one machine share nothing.

The node's database is the truth about its machines (state, process, layers): a
machine the control plane claimed enters it by `Lifecycle.adopt`, and the node's own
Lifecycle moves it from there. The control plane's end of the actor (`RayNode`,
`RayCluster`) lives in `boxd.control.ray`.

A node runtime's QEMU processes die with it: each actor starts a small reaper process
that holds a pipe to the actor and, when the pipe closes (the actor died, whatever the
signal), kills every process whose command line names the node's directories, then
the gVisor machines' network namespaces (pasta and its holder, whose command lines
name nothing of the node's: each machine's ``net.json`` records them).

Cross-node work goes node to node, not through the control plane: the receiving actor
gets the sender's actor handle and pulls chunks (`boxd.node._transfer`).

An interactive exec (stdin kept open, a pty: the E2B front door's) is a session on the
actor (`NodeActor.interactive`): a Ray streaming generator whose first item names the
session, then the command's output; the control plane feeds the command's input with
one `NodeActor.interactive_input` call per item. The session lives as long as that
stream: when the control plane stops reading it (its client went, or a kill), the
session ends and the command is killed in the guest, as on one host. A session holds a
lease its control plane renews; one whose control plane died ends when it lapses.
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
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, cast

from boxd import models
from boxd import process_models as pm
from boxd.config import Paths, Settings
from boxd.errors import BoxdError, InternalError, ResourceExhausted
from boxd.images import collect_unpacked
from boxd.node import _transfer as transfer
from boxd.node._host import Host
from boxd.node._transfer import FileOffer, TemplateOffer
from boxd.node.base import Boot, FromSnapshot, ProcessStream
from boxd.node.runtime import NodeRuntime
from boxd.state import Database, MachineRecord, Repos
from boxd.storage import SnapshotStore
from boxd.storage.oci import ImageStore

log = logging.getLogger("boxd.cluster")

#: The Ray namespace of boxd's actors and the custom resource that marks boxd nodes.
NAMESPACE = "boxd"
RESOURCE = "boxd"
#: The bytes of one chunk of a file crossing the cluster (uploads, transfers).
CHUNK = transfer.CHUNK
#: Interactive execs (`NodeActor.interactive`) one node serves at once, and the inputs
#: (each at most one request's bytes) one of them may have waiting on the node.
MAX_INTERACTIVE = 1024
INTERACTIVE_INPUTS = 8
#: Seconds an interactive session lives without word from its control plane (its
#: input, or a renewal: `NodeActor.interactive_renew`). A control plane that died
#: cannot close its streams (Ray does not end a dead caller's stream that yields
#: nothing): its sessions end, and their commands are killed, when their leases lapse.
INTERACTIVE_LEASE = 30.0

#: What an interactive exec yields: the command's bytes, then its exit event.
Output = pm.ExecBytes | models.ExecEvent

_REAPER = r"""
import os, signal, sys
home, nets, markers = sys.argv[1], sys.argv[2], sys.argv[3:]
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
sys.path.insert(0, home)  # where this node's boxd is, whatever the environment says
from pathlib import Path
from boxd.engine.registry import end_networks_left
end_networks_left(Path(nets))
"""


def _start_reaper(paths: Paths) -> subprocess.Popen[bytes]:
    """A process that kills this node's VMs once this process is gone (see module doc)."""
    markers = [str(paths.home) + "/", str(paths.shm) + "/"]
    return subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(Path(models.__file__).parents[1]),
         str(paths.shm / "machines"), *markers],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        close_fds=True,
    )


class _Interactive:
    """One interactive exec a control plane drives on this node. Its command runs in a
    task of its own, fed from ``inputs`` (`NodeActor.interactive_input`); its output waits
    in ``output`` one item at a time (the command waits for the reader), then None or
    the error that ended it. `close` ends it whatever it was doing (kills the command);
    ``expire`` is called when its lease (`INTERACTIVE_LEASE`) lapses unrenewed."""

    def __init__(self, start: Callable[[AsyncIterator[pm.ExecInput]], AsyncIterator[Output]],
                 name: str, expire: Callable[[], None]) -> None:
        self.inputs: asyncio.Queue[pm.ExecInput] = asyncio.Queue(INTERACTIVE_INPUTS)
        self.output: asyncio.Queue[Output | Exception | None] = asyncio.Queue(1)
        self.task = asyncio.create_task(self._run(start(self._drain())), name=name)
        self._expire = expire
        self._lease = asyncio.get_running_loop().call_later(INTERACTIVE_LEASE, expire)

    def renew(self) -> None:
        self._lease.cancel()
        self._lease = asyncio.get_running_loop().call_later(INTERACTIVE_LEASE, self._expire)

    async def _drain(self) -> AsyncIterator[pm.ExecInput]:
        while True:
            yield await self.inputs.get()

    async def _run(self, events: AsyncIterator[Output]) -> None:
        end: Exception | None = None
        try:
            async with contextlib.aclosing(cast("AsyncGenerator[Output, None]", events)):
                async for event in events:
                    await self.output.put(event)
        except Exception as exc:  # the reader raises it
            end = exc
        await self.output.put(end)

    def close(self) -> None:
        """Kill the command (closing its exec) and leave the reader only the end."""
        self._lease.cancel()
        self.task.cancel()
        while not self.output.empty():
            self.output.get_nowait()
        self.output.put_nowait(None)


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
        self._interactive: dict[str, _Interactive] = {}
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

    async def portable_templates(self, engine: str, image: bool = False) -> bool:
        """Whether templates of ``engine``'s machines here (``image``: of a container
        image's machine) can move to a peer node (`Engine.portable_templates`,
        `Engine.portable_image_templates`)."""
        _, eng = await self.rt.host.ready(engine)
        return eng.portable_templates and (not image or eng.portable_image_templates)

    # --------------------------------------------------------------- launch

    async def create(self, rec: MachineRecord, quota: int, source: Boot | FromSnapshot,
                     holder: Any = None) -> None:
        if isinstance(source, FromSnapshot):
            store = self.rt.store
            if not store.exists(source.digest):
                if holder is None:
                    raise InternalError(f"no node holds snapshot {source.digest[:12]}")
                raw, offers = await holder.offer_snapshot.remote(source.digest)
                await self.rt.receive_snapshot(source.digest, raw, offers, fetcher(holder))
            await asyncio.to_thread(store.ensure_verified, source.digest)
            m = store.get(source.digest)
            source = FromSnapshot(source.digest, m.blob_path("memory"), m.blob_path("state"),
                                  m.blob_path("disk"))
        self.rt.lifecycle.adopt(rec, quota)
        await self.rt.create(rec.id, source)

    async def fork(self, source_id: str, children: list[MachineRecord],
                   quota: int) -> list[Exception | None]:
        for c in children:
            self.rt.lifecycle.adopt(c, quota)
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
        try:  # the peer holds the template until it hears this fetch is over
            tpl = await self.rt.receive_template(tpl_offer, fetcher(peer))
        finally:
            await _offer_done(peer, tpl_offer.template_id)
        t2 = time.monotonic()
        try:
            for c in children:
                self.rt.lifecycle.adopt(c, quota)
            out = await self.rt.fork_received(src, tpl, [c.id for c in children])
        except BaseException:
            await self._drop(children)
            raise
        finally:
            self.rt.unpin_template(tpl.id)
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

    async def image_missing(self, digests: list[str]) -> list[str]:
        """The blobs of ``digests`` this node's image store lacks."""
        store = ImageStore(self.paths.images_store)
        return [d for d in digests if not store.has(d)]

    async def image_put(self, digest: str, size: int, offset: int, data: bytes) -> bool:
        """One chunk of an image blob the control plane pushes (`ImageStore.receive`)."""
        store = ImageStore(self.paths.images_store)
        return await asyncio.to_thread(store.receive, digest, size, offset, data)

    async def offer_done(self, template_id: str) -> None:
        self.rt.offer_done(template_id)

    async def drop_received(self, source_id: str) -> bool:
        """Let go of the template received of ``source_id`` (the source was deleted)."""
        return self.rt.templates.drop_received(source_id)

    async def collect_images(self, keep: list[str]) -> int:
        """Remove this node's copies of the images neither ``keep`` (the control
        plane's: named, or run by a record or a snapshot of its registry) nor a machine
        of this node names: their blobs, unpacked trees and disks (received ones too).
        Returns how many entries went. (A snapshot copy here that the registry dropped
        keeps no image: a machine started from it names its image itself.)"""
        store = ImageStore(self.paths.images_store)
        machines = self.rt.repos.machines

        def needed() -> set[str]:
            return set(keep) | machines.run_image_digests()

        def run() -> int:
            # An unpack under way here is of a machine's image (its record came first):
            # needed, its blobs stay.
            blobs = store.collect(needed())
            return len(blobs) + len(collect_unpacked(store, self.paths.image_roots,
                                                     self.paths.image_disks, needed))

        try:
            removed = await asyncio.to_thread(run)
        except BoxdError as exc:
            log.warning("node=%s event=images_not_collected error=%s", self.node_id, exc)
            return 0
        log.info("node=%s event=images_collected entries=%d", self.node_id, removed)
        return removed

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

    async def upload_begin(self, machine_id: str, path: str, mode: int,
                           user: str | None = None) -> str:
        """Start writing a guest file (owned by ``user``; None: root) fed by
        `upload_chunk` calls; `upload_end` answers."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)

        async def chunks() -> AsyncIterator[bytes]:
            while (item := await queue.get()) is not None:
                yield item

        task = asyncio.create_task(self.rt.upload(machine_id, path, chunks(), mode, user))
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

    async def interactive(self, machine_id: str, req: models.ExecRequest,
                          pty: tuple[int, int] | None) -> AsyncIterator[str | Output]:
        """An interactive exec (`NodeRuntime.exec_interactive`), as a Ray streaming
        generator: first the session's id, which `interactive_input` calls name, then the
        command's output and exit event. The session ends with this stream: cancelled
        or closed (the control plane stopped reading), it kills the command.

        Raises:
            ResourceExhausted: this node serves `MAX_INTERACTIVE` sessions already.
        """
        if len(self._interactive) >= MAX_INTERACTIVE:
            raise ResourceExhausted(
                f"node {self.node_id} serves {MAX_INTERACTIVE} interactive commands already",
                hint="end some (close their stdin, kill them) and try again")
        sid = secrets.token_hex(8)
        session = self._interactive[sid] = _Interactive(
            lambda inputs: self.rt.exec_interactive(machine_id, req, inputs, pty),
            f"interactive {machine_id} {sid}", lambda: self._expire_interactive(machine_id, sid))
        try:
            yield sid
            while (item := await session.output.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self._end_interactive(sid)

    async def interactive_input(self, sid: str, item: pm.ExecInput) -> bool:
        """Queue ``item`` (bytes, EOF, a pty's size) for session ``sid``'s command,
        waiting while its queue is full; False once the session is over."""
        session = self._interactive.get(sid)
        if session is None:
            return False
        session.renew()
        put = asyncio.ensure_future(session.inputs.put(item))
        await asyncio.wait({put, session.task}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():  # the command ended (or was killed) first
            put.cancel()
            return False
        return True

    async def interactive_renew(self, sid: str) -> bool:
        """Renew session ``sid``'s lease (its control plane still reads it); False once
        the session is over."""
        session = self._interactive.get(sid)
        if session is not None:
            session.renew()
        return session is not None

    def _expire_interactive(self, machine_id: str, sid: str) -> None:
        log.warning("machine=%s event=interactive_expired session=%s lease=%.0f",
                    machine_id, sid, INTERACTIVE_LEASE)
        self._end_interactive(sid)

    async def interactive_end(self, sid: str) -> None:
        """End session ``sid`` (its command is killed) if it still runs: the control
        plane's word when it stops reading, as the cancel of a stream is best effort."""
        self._end_interactive(sid)

    def _end_interactive(self, sid: str) -> None:
        session = self._interactive.pop(sid, None)
        if session is not None:
            session.close()

    async def attach(self, machine_id: str, process_id: str) -> tuple[str, pm.Process]:
        stack = AsyncExitStack()
        stream = await stack.enter_async_context(self.rt.process_attach(machine_id, process_id))
        sid = secrets.token_hex(8)
        self._sessions[sid] = (stack, stream)
        return sid, stream.process

    async def send(self, sid: str, data: bytes) -> None:
        await self._sessions[sid][1].send(data)

    async def recv(self, sid: str) -> bytes | bytearray | None:
        return await self._sessions[sid][1].recv()

    async def detach(self, sid: str) -> None:
        entry = self._sessions.pop(sid, None)
        if entry is not None:
            await entry[0].aclose()

    async def open_sessions(self) -> dict[str, int]:
        """How many sessions of each kind this node holds for a control plane (a leak
        shows here: tests, and a look at a busy node)."""
        return {"interactive": len(self._interactive), "attach": len(self._sessions),
                "upload": len(self._uploads)}

    async def delete_all(self) -> None:
        """Delete every machine of this node (tests, and `boxd nodes drain`)."""
        for rec in self.rt.repos.machines.on_node(self.node_id):
            with contextlib.suppress(BoxdError):
                await self.rt.delete(rec.id)


# Methods of NodeRuntime a control plane calls by machine id (everything else is above).
_CALLS = frozenset({
    "wait_until_ready", "exec", "exec_result", "exec_list", "checkpoint_save", "checkpoint_restore",
    "checkpoint_list", "checkpoint_delete", "save_snapshot", "delete", "suspend", "hibernate",
    "resume", "spawn", "processes", "process_kill", "process_output", "machine_metrics",
})


def fetcher(peer: Any) -> Callable[[FileOffer, int, int], Any]:
    """Reads of ``peer``'s (a `NodeActor` handle's) offered files, chunk by chunk."""
    async def fetch(f: FileOffer, offset: int, length: int) -> bytes:
        data: bytes = await peer.read_chunk.remote(f.kind, f.key, offset, length)
        return data
    return fetch


#: Seconds a node waits for a peer to hear that a template fetch is over. A peer that
#: does not answer (its node died) lets the template go when its lease lapses
#: (`boxd.node._offers.OFFER_LEASE`).
OFFER_DONE_WAIT = 10.0


async def _offer_done(peer: Any, template_id: str) -> None:
    """Tell ``peer`` this node is done fetching its template ``template_id``. Never
    raises (the fork's outcome is decided already); a lost message costs the peer one
    stale template held until its lease lapses."""
    try:
        await asyncio.wait_for(peer.offer_done.remote(template_id), OFFER_DONE_WAIT)
    except Exception as exc:  # a dead or slow peer: its lease lapses
        log.warning("template=%s event=offer_done_lost error=%s", template_id, exc)


async def receive_snapshot(peer: Any, store: SnapshotStore, digest: str, raw: bytes,
                           offers: list[FileOffer]) -> None:
    """Copy a snapshot ``peer`` offered (``raw`` manifest, ``offers``) into ``store``: the
    blobs it lacks, each verified against its digest."""
    await transfer.receive_snapshot(store, digest, raw, offers, fetcher(peer))


__all__ = ["CHUNK", "INTERACTIVE_INPUTS", "INTERACTIVE_LEASE", "MAX_INTERACTIVE", "NAMESPACE",
           "RESOURCE", "NodeActor", "fetcher", "receive_snapshot"]
