"""Files sent from one node runtime to another: a template, disk layers, snapshot blobs.

A cross-node fork streams the source's template (its RAM file, its device state and
the frozen disk layers under it) from the source's node to the receiving node, which
keeps it as a template of its own; a snapshot started on a node that lacks its blobs
fetches the missing ones by digest. Both go chunk by chunk over the nodes' own channel
(`boxd.node.ray`: Ray actor calls), a few chunks in flight, holes skipped: guest RAM
files are mostly holes, so only the pages the guest touched cross the network.

The sender names files by what they are (``mem``/``state`` of a template, ``layer`` by
id, ``blob`` by digest), never by path: a peer can read exactly what it was offered.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from boxd.state import RunImage
from boxd.storage import Manifest, SnapshotStore
from boxd.storage._files import data_regions, os_errors
from boxd.storage.fds import OwnedFd

#: Bytes per chunk: big enough that per-call overhead is small, small enough that a
#: few in flight stay well under the memory budget.
CHUNK = 8 << 20
#: Chunks in flight per file.
WINDOW = 4


@dataclass(frozen=True)
class FileOffer:
    """One file a node offers: how to ask for it, its size and its data regions."""

    kind: str  # "mem", "state", "layer", "root" or "blob"
    key: str  # template id, layer id, root file name or blob digest
    size: int
    regions: tuple[tuple[int, int], ...]

    @property
    def data_bytes(self) -> int:
        return sum(n for _, n in self.regions)


@dataclass(frozen=True)
class LayerOffer:
    """A frozen disk layer and what it sits on (``parent`` None: the base image)."""

    id: str
    parent: str | None
    file: FileOffer


@dataclass(frozen=True)
class TemplateOffer:
    """What a cross-node fork sends: a source's template as of ``generation``."""

    template_id: str
    source_id: str
    generation: int
    image: str  # the guest image key the bottom layer sits on
    engine: str
    memory_mib: int
    mem: FileOffer
    state: FileOffer
    layers: tuple[LayerOffer, ...]  # the frozen layer first, down to the base image
    # The container image the base layer sits on (None: the guest image): the receiving
    # node re-points that layer at its own root of the image (`Host.image_root`) ...
    run_image: RunImage | None = None
    # ... or, when the engine's form of that root differs between nodes, at the
    # sender's, sent along (`Engine.root_files`, bottom first, keyed by name).
    roots: tuple[FileOffer, ...] = ()

    @property
    def files(self) -> tuple[FileOffer, ...]:
        """Every file offered: RAM, device state, layers, roots."""
        return (self.mem, self.state, *(layer.file for layer in self.layers), *self.roots)

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)


def offer(kind: str, key: str, path: Path) -> FileOffer:
    """Describe ``path`` for a peer (its size and data regions)."""
    with os_errors("read", path), OwnedFd.open(path, os.O_RDONLY) as fd:
        size = os.fstat(fd.fd).st_size
        regions = tuple(_split(data_regions(fd.fd, size)))
    return FileOffer(kind, key, size, regions)


def _split(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, length in regions:
        while length > 0:
            n = min(length, CHUNK)
            out.append((off, n))
            off, length = off + n, length - n
    return out


def read_chunk(path: Path, offset: int, length: int) -> bytes:
    """One chunk of an offered file (at most `CHUNK` bytes)."""
    with os_errors("read", path), open(path, "rb") as f:
        f.seek(offset)
        return f.read(min(length, CHUNK))


Fetch = Callable[[FileOffer, int, int], Awaitable[bytes]]


async def receive(fetch: Fetch, file: FileOffer, dest: Path, *, mode: int = 0o600) -> int:
    """Write the offered file to ``dest`` (holes stay holes); return the bytes received.

    Written to a temporary name first: ``dest`` appears whole or not at all.
    """
    tmp = dest.with_name(dest.name + ".part")
    fd = OwnedFd.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    received = 0
    pending: list[tuple[int, asyncio.Future[bytes]]] = []
    regions = list(file.regions)
    try:
        with fd:
            os.ftruncate(fd.fd, file.size)
            while regions or pending:
                while regions and len(pending) < WINDOW:
                    off, n = regions.pop(0)
                    pending.append((off, asyncio.ensure_future(fetch(file, off, n))))
                off, task = pending.pop(0)
                data = await task
                await _write_in_thread(fd, data, off)
                received += len(data)
            os.fsync(fd.fd)
    except BaseException:
        for _, task in pending:
            task.cancel()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)
    return received


async def _write_in_thread(fd: OwnedFd, data: bytes, offset: int) -> None:
    """``os.pwrite`` in a worker thread, which the caller's cancellation does not stop:
    the write is awaited to its end either way, so the descriptor is never closed (and
    its number given to another file) while the thread still writes through it."""
    write = asyncio.ensure_future(asyncio.to_thread(os.pwrite, fd.fd, data, offset))
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        await asyncio.wait([write])
        raise


async def receive_snapshot(
    store: SnapshotStore, digest: str, raw: bytes, offers: list[FileOffer], fetch: Fetch
) -> Manifest:
    """Put a peer's snapshot into ``store``: fetch each blob it lacks once (staged in its
    staging area), then let the store hash and publish them with the manifest ``raw``."""
    missing = {e.digest for e in store.missing(raw, digest)}
    work = Path(tempfile.mkdtemp(prefix="recv-", dir=store.staging_dir))
    try:
        files: dict[str, Path] = {}
        for o in offers:
            if o.key in missing and o.key not in files:
                files[o.key] = work / o.key
                await receive(fetch, o, files[o.key])
        return await asyncio.to_thread(store.receive, raw, digest, files)
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = [
    "CHUNK", "Fetch", "FileOffer", "LayerOffer", "TemplateOffer", "offer", "read_chunk", "receive",
    "receive_snapshot",
]
