"""Fork templates and the frozen disk layers under them: where they come from, what
keeps them, where they are freed.

Where a template comes from (two places, both here):

- `Templates.template` makes one of a local source (or reuses it): the source is paused
  once, its writable disk layer is frozen (it gets a fresh overlay on top,
  `freeze_and_capture`), its device state is written and its RAM file copied sparsely
  into ``templates/<id>``; the source resumes. Forks asked for while a template is being
  made share it; a later fork of an unchanged source (same generation: no exec, upload
  or restore since) reuses it. A source that maps an image privately first gets RAM of
  its own (the node's RAM swap).
- `Templates.receive` makes another node's template a local one (a cross-node fork, on
  any engine whose `portable_templates` says so): its files and the frozen layers it
  needs are fetched, the layers re-pointed and the files laid out by the engine
  (`retarget_disk`, `receive_image`); it is kept while current, so further forks of
  that source here are copy-on-write again.

What keeps one (one owner, `boxd.node._template_refs`): its row while it is the
source's current one or a machine's record names it (children map its files); else a
reference in `refs`, taken and dropped by its holder: a launch in flight from it
(`pin`: a fork child, a standby child being prepared, an offer being described), a
standby child made from it (until claimed or discarded), a received one while it is
the newest of its source here.

Where it is freed: `collect` (the node's gc: after a delete, a restore, a collapse, a
hibernate, the last reference of a stale template dropped) drops the rows nothing holds
and removes their files and layers. Children map a template's RAM privately
(copy-on-write) and get their own overlay on its frozen layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Protocol

from boxd.config import Paths
from boxd.engine.base import Engine, MachineHandle, MemoryImage
from boxd.errors import BoxdError, Conflict, HostSetupError, InvalidRequest
from boxd.images import unused_received
from boxd.models import MachineState
from boxd.node import _transfer as transfer
from boxd.node._host import Host
from boxd.node._template_refs import TemplateRefs
from boxd.node._transfer import Fetch, TemplateOffer
from boxd.node.lifecycle import Lease
from boxd.state import MachineRecord, Repos, TemplateRecord, new_id
from boxd.storage import disks
from boxd.storage.memory import ensure_space, remove_tree

log = logging.getLogger("boxd.node")

S = MachineState

# Backing chains longer than this are collapsed in the background (see `collapse`).
MAX_CHAIN = 8


class TemplateSource(Protocol):
    """What making a template needs of its node: the source machine, awake, with RAM
    of its own."""

    def record(self, machine_id: str) -> MachineRecord: ...

    def lease(self, machine_id: str) -> Lease: ...

    def current(self, machine_id: str) -> MachineHandle | None: ...

    async def awake(self, rec: MachineRecord) -> MachineRecord: ...

    async def own_ram(self, rec: MachineRecord) -> MachineHandle: ...

    def processes_captured(self, machine_id: str) -> None: ...


class Templates:
    """The templates of one node, and the layers a launch or freeze has in flight."""

    def __init__(
        self, paths: Paths, repos: Repos, host: Host, source: TemplateSource, *,
        gc: Callable[[], None], spawn: Callable[[Coroutine[Any, Any, None], str], None],
        node_id: str = "local",
    ) -> None:
        self.node_id = node_id
        self.paths = paths
        self.repos = repos
        self.host = host
        self._source = source
        self._gc = gc
        self._spawn = spawn
        # Layers recorded by a launch or freeze in flight that no machine points at yet:
        # a concurrent gc (a sibling's delete, a background collapse) must keep them.
        self.unreferenced: set[str] = set()
        self._preparing: dict[str, asyncio.Future[TemplateRecord]] = {}
        # Who holds each template besides the records (launches, standby children,
        # received ones): gc keeps what anyone holds; when the last holder lets a stale
        # template go, it is collected at that moment.
        self.refs = TemplateRefs(self._freed)
        # Templates other nodes sent (cross-node forks): source id -> template id. Held
        # while the newest, so further forks of that source here are copy-on-write again.
        self._received: dict[str, str] = {}
        self._receiving: dict[str, asyncio.Future[TemplateRecord]] = {}

    def layer_path(self, layer_id: str) -> Path:
        return disks.layer_path(self.paths.disks, layer_id)

    @staticmethod
    def image(tpl: TemplateRecord, memory_mib: int) -> MemoryImage:
        return MemoryImage(tpl.mem_path, tpl.state_path, memory_mib)

    def is_current(self, template_id: str) -> bool:
        return self.repos.layers.template_is_current(template_id)

    # ------------------------------------------------------------ freeing

    def collect(self) -> None:
        """Remove templates and disk layers nothing refers to any more."""
        garbage = self.repos.layers.collect(keep=self.unreferenced,
                                            keep_templates=self.refs.held())
        for d in garbage.template_dirs:
            remove_tree(d)
        for lid in garbage.layer_ids:
            disks.remove(self.layer_path(lid))
        received = self.paths.received_roots
        # (none while a receive is under way: it fetches roots before it records layers)
        if not self._receiving and received.is_dir():
            for gone in unused_received(received, self.repos.layers.bases()):
                log.info("event=received_root_collected path=%s", gone)

    def pin(self, tpl: TemplateRecord) -> None:
        """Keep ``tpl`` (its row, files and layers) while a launch from it is in flight.

        Raises:
            Conflict: it was collected already (its source changed or was deleted, and
                nothing mapped it): the caller takes the source's current one, or fails.
        """
        if self.repos.layers.template(tpl.id) is None or not tpl.state_path.exists():
            raise Conflict(f"template {tpl.id} was collected meanwhile",
                           hint="its source changed or was deleted; fork again")
        self.refs.acquire(tpl.id, "launch")

    def unpin(self, template_id: str) -> None:
        """One launch from the template finished (see `TemplateRefs.release`)."""
        self.refs.release(template_id, "launch")

    def _freed(self, template_id: str) -> None:
        """No reference holds the template any more: collect it unless its row is kept
        (the source's current one, or a record names it)."""
        if not self.repos.layers.template_is_current(template_id):
            self._gc()

    @contextlib.contextmanager
    def pinned(self, tpl: TemplateRecord) -> Iterator[None]:
        self.pin(tpl)
        try:
            yield
        finally:
            self.unpin(tpl.id)

    # ------------------------------------------------------------ making

    async def template(self, source_id: str) -> TemplateRecord:
        """The template children of this source start from, pinned (the caller unpins
        it, see `pin`): reused or made once.

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
                self.pin(tpl)  # no await since it was read: a gc cannot come between
                return tpl
            self._source.record(source_id)  # deleted: MachineNotFound
        raise Conflict(
            f"machine {self._source.record(source_id).name!r} changed while it was forked",
            hint="retry the fork")

    async def _template_once(self, source_id: str) -> TemplateRecord:
        rec = self._source.record(source_id)
        existing = self.repos.layers.template_for(source_id, rec.generation)
        if existing is not None and existing.mem_path.exists():
            return existing
        pending = self._preparing.get(source_id)
        if pending is not None:
            return await asyncio.shield(pending)
        return await _shared(self._preparing, source_id, self._make(source_id))

    async def _make(self, source_id: str) -> TemplateRecord:
        src = self._source
        async with src.lease(source_id).op():
            rec = await src.awake(src.record(source_id))
            handle = await src.own_ram(rec)
            rec = src.record(source_id)
            src.processes_captured(source_id)
            await self._flush_page_cache(handle)
            template_id = new_id("t")
            frozen_id, image = await self.freeze_and_capture(
                rec, handle, self.paths.templates / template_id
            )
            assert image.mem_path is not None
            return self.repos.layers.add_template(
                source_id, frozen_id, image.mem_path, image.state_path, rec.generation,
                template_id=template_id,
            )

    @staticmethod
    async def _flush_page_cache(handle: MachineHandle) -> None:
        """Write the source's dirty page cache to its disk before it is frozen.

        Otherwise every child inherits the same dirty pages and writes each of them
        into its own overlay. Only kernel state changes; best effort.
        """
        try:
            agent = await handle.agent(timeout=30)
            await agent.sync(timeout=60)
        except BoxdError as exc:
            log.warning("machine=%s event=sync_failed error=%s", handle.config.id, exc)

    async def freeze_and_capture(
        self, rec: MachineRecord, handle: MachineHandle, dest: Path, *, resume: bool = True
    ) -> tuple[str, MemoryImage]:
        """Pause, freeze the disk, capture memory + device state into ``dest``, resume.

        Returns the frozen layer id and the memory image. The source is resumed
        whatever happens, unless ``resume`` is false (hibernate: the VM ends next, and
        on failure the caller resumes it). Templates, checkpoints, snapshots and
        hibernation images are all taken so.
        """
        assert rec.layer_id is not None
        frozen_id = rec.layer_id
        new_layer = new_id("l")
        self.unreferenced.add(new_layer)
        self.repos.layers.new(frozen_id, "", layer_id=new_layer)
        t0 = time.monotonic()
        await handle.pause()
        try:
            try:
                await handle.freeze_disk(self.layer_path(new_layer))
                self.repos.layers.freeze(rec.id, frozen_id, new_layer)
            finally:
                self.unreferenced.discard(new_layer)
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
            async with self._source.lease(machine_id).op():
                rec = self.repos.machines.get(machine_id)
                handle = self._source.current(machine_id)
                if rec is None or rec.state != S.RUNNING or handle is None:
                    return
                chain = self.repos.layers.chain(rec.layer_id)
                if len(chain) <= MAX_CHAIN or rec.layer_id is None:
                    return
                base = chain[-1].base
                t0 = time.monotonic()
                await handle.collapse_disk(Path(base))
                self.repos.layers.rebase(rec.layer_id, base)
                self._gc()
                log.info("machine=%s event=collapsed layers=%d seconds=%.2f",
                         machine_id, len(chain), time.monotonic() - t0)
        except BoxdError as exc:
            log.warning("machine=%s event=collapse_failed error=%s", machine_id, exc)

    # ------------------------------------------------------------ receiving

    async def receive(self, tpl_offer: TemplateOffer, fetch: Fetch) -> TemplateRecord:
        """Make another node's template a local one (once per template; kept while its
        source is unchanged, so later forks here map it copy-on-write), returned pinned
        as `template` returns one: the caller unpins it. A waiter on another fork's
        receive may find it collected (a newer one of the source arrived and nothing
        held this one): it receives it anew.

        Raises:
            Conflict: it was collected under every attempt (the source kept changing).
        """
        for _ in range(3):
            tpl = await self._receive_once(tpl_offer, fetch)
            with contextlib.suppress(Conflict):
                self.pin(tpl)  # no await since it was read: a gc cannot come between
                return tpl
        raise Conflict(f"template {tpl_offer.template_id} was collected while it was received",
                       hint="its source changed meanwhile; fork again")

    def drop_received(self, source_id: str) -> bool:
        """The source of a template received here is gone (deleted on its node): let the
        template go (collected now unless a child here still maps it, then with its
        last child). Returns whether one was kept."""
        tid = self._received.pop(source_id, None)
        if tid is not None:
            self.refs.release(tid, f"received:{source_id}")
        return tid is not None

    async def _receive_once(self, tpl_offer: TemplateOffer, fetch: Fetch) -> TemplateRecord:
        existing = self.repos.layers.template(tpl_offer.template_id)
        if existing is not None and existing.mem_path.exists():
            return existing
        pending = self._receiving.get(tpl_offer.template_id)
        if pending is not None:
            return await asyncio.shield(pending)
        return await _shared(self._receiving, tpl_offer.template_id,
                             self._receive(tpl_offer, fetch))

    async def _receive(self, o: TemplateOffer, fetch: Fetch) -> TemplateRecord:
        image, engine = await self.host.ready(o.engine)
        if not engine.portable_templates:
            raise InvalidRequest(
                f"the {o.engine} engine's templates cannot move to another node",
                hint="fork the machine on its own node (leave the node out)", field="node")
        if image.key != o.image:
            raise HostSetupError(
                f"node {self.node_id} runs guest image {image.key}, the source runs "
                f"{o.image}",
                hint="run the same boxd version (and image recipe) on every node",
            )
        root = image.rootfs if o.run_image is None else await self._image_root(o, engine)
        # the state twice: an engine may lay it out anew beside the copy (gVisor)
        ensure_space(self.paths.shm, o.mem.data_bytes + 2 * o.state.size)
        t0 = time.monotonic()
        dest = self.paths.templates / o.template_id
        dest.mkdir(parents=True, exist_ok=True, mode=0o700)
        made: list[str] = []
        try:
            # the sender's own bytes of what the bottom layer sits on, when this node's
            # may differ (QEMU: an image's disks, a guest root, a snapshot's disk)
            below = await engine.receive_root(
                [(f.key, functools.partial(transfer.receive, fetch, f)) for f in o.roots],
                dest)
            received = await transfer.receive(fetch, o.mem, dest / "mem")
            received += await transfer.receive(fetch, o.state, dest / "state")
            if engine.file_owner is not None:
                # As a template made here: QEMU reads the state file as its own user.
                for p in (dest, dest / "mem", dest / "state"):
                    os.chown(p, *engine.file_owner)
            received += await self._receive_layers(o, fetch, root, engine, made, below)
            # The engine lays the copy out as its own captures are (gVisor: the files
            # runsc restores from, naming this node's root and agent trees).
            got = await engine.receive_image(
                MemoryImage(dest / "mem", dest / "state", o.memory_mib),
                self.layer_path(o.layers[0].id))
            assert got.mem_path is not None
            tpl = self.repos.layers.add_template(
                o.source_id, o.layers[0].id, got.mem_path, got.state_path, o.generation,
                template_id=o.template_id,
            )
        except BaseException:
            remove_tree(dest)
            for lid in made:
                disks.remove(self.layer_path(lid))
            for lid in reversed(made):  # children first
                self.repos.layers.drop(lid)
            raise
        older = self._received.get(o.source_id)
        self._received[o.source_id] = tpl.id
        self.refs.acquire(tpl.id, f"received:{o.source_id}")
        if older is not None:  # an older one of that source goes now, unless held
            self.refs.release(older, f"received:{o.source_id}")
        log.info("template=%s event=received source=%s bytes=%d seconds=%.3f", tpl.id,
                 o.source_id, received, time.monotonic() - t0)
        return tpl

    async def _image_root(self, o: TemplateOffer, engine: Engine) -> Path:
        """This node's root of the container image ``o``'s base layer sits on (its own
        tree, unpacked from the image's blobs here), which that layer is re-pointed at.

        Raises:
            InvalidRequest: the engine cannot move an image machine's template.
            NotFound: this node's store lacks the image (the control plane pushes it
                before it sends the template).
        """
        assert o.run_image is not None
        if not engine.portable_image_templates:
            raise InvalidRequest(
                f"the {o.engine} engine's templates of a container image's machine "
                "cannot move to another node", field="node",
                hint="fork the machine on its own node (leave the node out)")
        return await self.host.image_root(o.run_image, engine)

    async def _receive_layers(
        self, o: TemplateOffer, fetch: Fetch, rootfs: Path, engine: Engine, made: list[str],
        below: Path | None,
    ) -> int:
        """Fetch the frozen layers of ``o`` this node lacks (their ids go into ``made``
        as each is written), each re-pointed at this node's copy of its backing (the
        engine's layer format; the base layer at ``below`` if given, the root files
        received, else at ``rootfs``); returns the bytes received."""
        received = 0
        for layer in reversed(o.layers):  # the base image's layer first
            if self.repos.layers.get(layer.id) is not None:
                continue  # sent before, with an earlier template of this source
            path = self.layer_path(layer.id)
            received += await transfer.receive(fetch, layer.file, path)
            made.append(layer.id)
            backing = (below or rootfs) if layer.parent is None else \
                self.layer_path(layer.parent)
            await engine.retarget_disk(path, backing, "raw" if layer.parent is None else "layer")
            if engine.file_owner is not None:
                os.chown(path, *engine.file_owner)
            # the bottom layer's base: what it sits on here (a collapse streams down to it)
            self.repos.layers.received(layer.id, layer.parent,
                                       str(backing) if layer.parent is None else "")
        return received


async def _shared(
    pending: dict[str, asyncio.Future[TemplateRecord]], key: str,
    work: Coroutine[Any, Any, TemplateRecord],
) -> TemplateRecord:
    """Run ``work`` with its result shared through ``pending[key]`` while it runs
    (callers that find the future there await it instead)."""
    fut: asyncio.Future[TemplateRecord] = asyncio.get_running_loop().create_future()
    pending[key] = fut
    try:
        tpl = await work
        fut.set_result(tpl)
        return tpl
    except BaseException as exc:
        fut.set_exception(exc)
        fut.exception()  # mark retrieved: waiters re-raise it themselves
        raise
    finally:
        pending.pop(key, None)


__all__ = ["MAX_CHAIN", "TemplateSource", "Templates"]
