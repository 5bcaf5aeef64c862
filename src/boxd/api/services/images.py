"""Container images of an account: import, list, inspect, remove. No HTTP types here.

Images live in one store per daemon (an OCI layout under ``<data dir>/oci``), so a layer
two accounts both import is stored once; each account sees and removes only its own
names (the store names them ``<account>/<name>:<tag>``).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from boxd import models
from boxd.errors import BoxdError, NotFound
from boxd.images import collect_unpacked
from boxd.images.build import BuildRequest, build_image, unpack_context
from boxd.images.oci import ImageInfo, import_image, inspect_image, list_images, parse_name
from boxd.images.oci import remove_image as _remove
from boxd.storage.oci import ImageStore

__all__ = ["ImageService"]

log = logging.getLogger(__name__)


class ImageService:
    """The daemon's image store, per account."""

    def __init__(self, root: Path | None, *, unpacked: tuple[Path, Path] | None = None,
                 in_use: Callable[[], set[str]] | None = None,
                 on_nodes: Callable[[Callable[[], set[str]]], Awaitable[int]] | None = None,
                 ) -> None:
        """``root``: the store's folder; None: a new temporary folder, made on first use
        (an app built only to read its schema makes none). ``unpacked``: where images
        are unpacked for machines (trees, disks: `collect`); ``in_use``: the manifest
        digests of the images machines and snapshots still run (raises when unknown);
        ``on_nodes``: a cluster's nodes collect their copies of the images a function
        it is given does not name (its count of what went)."""
        self._root = root
        self._store: ImageStore | None = None
        self._unpacked = unpacked
        self._in_use = in_use or set
        self._on_nodes = on_nodes

    @property
    def store(self) -> ImageStore:
        if self._store is None:
            self._store = ImageStore(self._root or Path(tempfile.mkdtemp(prefix="boxd-oci-")))
        return self._store

    async def import_(self, account: str, body: models.ImageImport,
                      progress: Callable[[str, float | None], None] | None = None,
                      ) -> models.Image:
        """Import for ``account``; ``progress(step, fraction)`` is called from a worker
        thread as blobs arrive."""
        name = parse_name(body.name)
        info = await asyncio.to_thread(
            import_image, self.store, body.source, f"{account}/{name}", creds=body.creds,
            insecure=body.insecure, owned=f"{account}/", progress=progress)
        return _model(account, info)

    async def build(self, account: str, context: Path, name: str, *, dockerfile: str,
                    build_args: dict[str, str], target: str | None) -> models.Image:
        """Build the context archive ``context`` (a tar) as ``name``."""
        parse_name(name)
        store = self.store

        def run() -> ImageInfo:
            with tempfile.TemporaryDirectory(prefix="boxd-context-",
                                             dir=context.parent) as tmp:
                unpack_context(context, Path(tmp))
                return build_image(
                    store, BuildRequest(name, Path(tmp), dockerfile, build_args, target),
                    prefix=f"{account}/", cache=store.root.parent / "build")

        return _model(account, await asyncio.to_thread(run))

    async def list(self, account: str) -> builtins.list[models.Image]:
        infos = await asyncio.to_thread(list_images, self.store)
        prefix = f"{account}/"
        return [_model(account, i) for i in infos if i.name.startswith(prefix)]

    async def get(self, account: str, name: str) -> models.Image:
        full = f"{account}/{parse_name(name)}"
        try:
            return _model(account, await asyncio.to_thread(inspect_image, self.store, full))
        except NotFound:
            raise _missing(name) from None

    async def remove(self, account: str, name: str) -> models.Image:
        """Remove the name; its blobs, trees and disks go unless another name, a machine
        or a snapshot still needs them (`collect`)."""
        full = f"{account}/{parse_name(name)}"

        def run() -> ImageInfo:
            try:
                keep: set[str] | None = self._in_use()
            except BoxdError as exc:
                log.warning("image blobs kept: what runs them is unknown (%s)", exc)
                keep = None
            return _remove(self.store, full, keep)

        try:
            info = await asyncio.to_thread(run)
        except NotFound:
            raise _missing(name) from None
        await self.collect()
        return _model(account, info)

    async def collect(self) -> int:
        """Remove the unpacked trees and disks no image, machine or snapshot needs
        (`boxd.images._collect`); return how many entries went. Run after a remove and
        when the daemon starts (a machine deleted since frees its image's then)."""
        removed = 0
        if self._unpacked is not None:
            roots, disks = self._unpacked
            try:
                removed = len(await asyncio.to_thread(collect_unpacked, self.store, roots,
                                                      disks, self._in_use))
            except BoxdError as exc:
                log.warning("unpacked images not collected: %s", exc)
        if self._on_nodes is not None:
            removed += await self._on_nodes(self._needed)
        return removed

    def _needed(self) -> set[str]:
        """The images a node's copies of which stay: every named one (it may run there
        again) and every one a machine or snapshot runs. Raises when that is unknown."""
        return {d.digest for d in self.store.refs().values()} | self._in_use()


def _missing(name: str) -> NotFound:
    return NotFound(f"no image named {parse_name(name)!r}",
                    hint="see `boxd image list`; import one with `boxd image import`")


def _model(account: str, info: ImageInfo) -> models.Image:
    c = info.config
    return models.Image(
        name=info.name.removeprefix(f"{account}/"), digest=info.digest,
        config_digest=info.config_digest,
        layers=[models.ImageLayer(digest=d.digest, size=d.size, media_type=d.media_type)
                for d in info.layers],
        size=info.size, architecture=info.architecture, os=info.os, created=info.created,
        config=models.ImageRunConfig(
            env=list(c.env), entrypoint=list(c.entrypoint), cmd=list(c.cmd),
            working_dir=c.working_dir, user=c.user, exposed_ports=list(c.exposed_ports),
            healthcheck=list(c.healthcheck), labels=dict(c.labels)),
    )
