"""What one node offers its peers: templates, frozen layers and snapshot blobs.

A cross-node fork (``boxd.node.cluster``) asks the source's node for its template,
described file by file (`TemplateOffer`, see `boxd.node._transfer`), and the child's
node fetches the chunks it lacks with `read_chunk`; the receiving side is
`Templates.receive`. A snapshot moves the same way (`offer_snapshot`,
`receive_snapshot`). A node only serves what it offered and still has.

An offered template is held (an ``offer`` reference in `TemplateRefs`, one per offer)
until the peer says it is done (`offer_done`), so a source that changes, and the gc
that follows, cannot remove its files under a fetch. A peer that never says so (it
crashed, its node died) loses the references once no chunk of the template was read
for `OFFER_LEASE` seconds: every read of it renews the lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from boxd.engine.base import Engine, MemoryImage
from boxd.errors import NotFound
from boxd.node import _transfer as transfer
from boxd.node._template_refs import TemplateRefs
from boxd.node._transfer import Fetch, FileOffer, LayerOffer, TemplateOffer
from boxd.state import MachineRecord, Repos, TemplateRecord
from boxd.storage import Manifest, SnapshotStore, disks

#: Seconds an offered template is held after its last chunk was read, when the peer
#: never says it is done. A transfer reads a chunk every few ms; 120 s covers a peer
#: stalled by a busy Ray object store, and holds a stale template no longer than that.
OFFER_LEASE = 120.0

#: The `TemplateRefs` holder of an offered template.
OFFER_HOLDER = "offer"


class Offers:
    """The templates this node described for peers, and the files it serves them."""

    def __init__(
        self, repos: Repos, store: SnapshotStore, disks_dir: Path, *,
        fork_source: Callable[[str], Awaitable[tuple[MachineRecord, TemplateRecord]]],
        unpin: Callable[[str], None], refs: TemplateRefs,
        engine: Callable[[str], Awaitable[Engine]],
    ) -> None:
        self.repos = repos
        self.store = store
        self._disks = disks_dir
        self._fork_source = fork_source
        self._unpin = unpin
        self._refs = refs
        self._engine = engine
        self._roots: dict[str, Path] = {}  # root files offered (`Engine.root_files`)
        self._offered: dict[str, TemplateRecord] = {}  # templates peers may fetch
        self._offers: dict[str, TemplateOffer] = {}  # ... and how they were described
        # template id -> (offers not yet done, the lease's timer)
        self._leases: dict[str, tuple[int, asyncio.TimerHandle]] = {}

    def _layer_path(self, layer_id: str) -> Path:
        return disks.layer_path(self._disks, layer_id)

    def forget_collected(self) -> None:
        """Stop offering templates the node's gc collected."""
        for tid in [t for t in self._offered if self.repos.layers.template(t) is None]:
            del self._offered[tid]
            self._offers.pop(tid, None)

    async def offer_template(self, source_id: str) -> TemplateOffer:
        """The source's template (made if needed), described for a peer node to fetch
        (see `boxd.node._transfer`). A cross-node fork writes nothing else here."""
        src, tpl = await self._fork_source(source_id)
        try:  # pinned while described, then held by the offer until the peer is done
            offer = await self._offer(src, tpl)
            self._hold(tpl.id)
            return offer
        finally:
            self._unpin(tpl.id)

    def offer_done(self, template_id: str) -> None:
        """A peer finished fetching (or gave up on) one offer of ``template_id``: its
        reference goes (the template is collected now if nothing else holds it).
        Unknown or lapsed offers are a no-op: a peer may say so twice, or late."""
        lease = self._leases.get(template_id)
        if lease is None:
            return
        count, timer = lease
        if count > 1:
            self._leases[template_id] = (count - 1, timer)
        else:
            timer.cancel()
            del self._leases[template_id]
        self._refs.release(template_id, OFFER_HOLDER)

    def close(self) -> None:
        """Stop the leases' timers (the node is closing; nothing is collected now)."""
        for _, timer in self._leases.values():
            timer.cancel()
        self._leases.clear()

    def _hold(self, template_id: str) -> None:
        self._refs.acquire(template_id, OFFER_HOLDER)
        count, timer = self._leases.get(template_id, (0, None))
        if timer is not None:
            timer.cancel()
        self._leases[template_id] = (count + 1, self._timer(template_id))

    def _timer(self, template_id: str) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(OFFER_LEASE, self._lapse, template_id)

    def _renew(self, template_id: str) -> None:
        lease = self._leases.get(template_id)
        if lease is not None:
            lease[1].cancel()
            self._leases[template_id] = (lease[0], self._timer(template_id))

    def _lapse(self, template_id: str) -> None:
        count, _ = self._leases.pop(template_id, (0, None))
        for _ in range(count):
            self._refs.release(template_id, OFFER_HOLDER)

    async def _offer(self, src: MachineRecord, tpl: TemplateRecord) -> TemplateOffer:
        # Any engine's template is described; the receiving node refuses one its
        # engine cannot start there (`Engine.portable_templates`, `Templates.receive`).
        self._offered[tpl.id] = tpl
        cached = self._offers.get(tpl.id)
        if cached is not None:
            return cached

        engine = await self._engine(src.engine)

        def describe() -> TemplateOffer:
            chain = self.repos.layers.chain(tpl.layer_id)
            layers = tuple(
                LayerOffer(layer.id, layer.parent_id,
                           transfer.offer("layer", layer.id, self._layer_path(layer.id)))
                for layer in chain
            )
            roots = engine.root_files(self._layer_path(chain[-1].id),
                                      MemoryImage(tpl.mem_path, tpl.state_path, src.memory_mib))
            self._roots.update((r.name, r.path) for r in roots)
            return TemplateOffer(
                template_id=tpl.id, source_id=src.id, generation=tpl.generation,
                image=src.image, engine=src.engine, memory_mib=src.memory_mib,
                mem=transfer.offer("mem", tpl.id, tpl.mem_path),
                state=transfer.offer("state", tpl.id, tpl.state_path), layers=layers,
                run_image=src.run_image,
                roots=tuple(transfer.offer("root", r.name, r.path) for r in roots),
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
                return self._layer_path(key)
        if kind == "root" and key in self._roots and self._roots[key].exists():
            return self._roots[key]
        if kind == "blob" and self.store.has_blob(key):
            return self.store.blob_path(key)
        raise NotFound(f"this node offers no {kind} {key!r}",
                       hint="the source changed or was deleted meanwhile; fork again")

    async def read_chunk(self, kind: str, key: str, offset: int, length: int) -> bytes:
        """A chunk of a file this node offered (a template's, a frozen layer, a blob).
        A read of a template's file renews the lease of its offers."""
        for tid, described in self._offers.items():
            if tid in self._leases and any(f.kind == kind and f.key == key
                                           for f in described.files):
                self._renew(tid)
        return await asyncio.to_thread(
            transfer.read_chunk, self._offered_path(kind, key), offset, length
        )

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


__all__ = ["Offers"]
