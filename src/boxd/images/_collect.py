"""Collect what imported images left unpacked: the layer-chain trees under
``oci-roots`` and the disks under ``oci-disks`` that no image, machine or snapshot
needs any more (`collect_unpacked`).

An image's trees and disks are made when a machine first runs it (`unpack_image`,
`image_disk`) and are named by its layer chains (`chain_ids`). They stay while the
image has a name, and while a machine or a snapshot still runs it after its name was
removed (the caller's ``in_use``: those machines fork, restore and move to other nodes
from them). A chain two images share stays while either needs it.

A collection and an unpack exclude each other (`roots_lock`: unpacks share it, a
collection holds it alone), and the collection asks ``in_use`` under that lock:
a machine is recorded before its image is unpacked, so whatever a collection finds
unneeded, no unpack is using.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from boxd.errors import CorruptData, IntegrityError, NotFound
from boxd.state import Repos
from boxd.storage import SnapshotStore
from boxd.storage.oci import ImageStore

from .oci import CHAINS, chain_ids, image_by_digest, roots_lock

log = logging.getLogger(__name__)

#: A temporary file or tree (a dot name) this old was left by a process that died.
STALE_TEMP_S = 3600.0
#: The chain of an image of no layers (`unpack_image`).
EMPTY_CHAIN = hashlib.sha256(b"").hexdigest()

__all__ = ["collect_unpacked", "images_in_use"]


def images_in_use(repos: Repos, store: SnapshotStore) -> set[str]:
    """The manifest digests of the images every machine record of ``repos`` and every
    snapshot of ``store`` runs: what a collection must keep after their names went.

    Raises:
        IntegrityError: a snapshot's manifest cannot be read (what it runs is unknown,
            so nothing may be collected).
    """
    out = repos.machines.run_image_digests()
    manifests, whole = store.list_all()
    if not whole:
        raise IntegrityError("a stored snapshot cannot be read: which images it runs is "
                             "unknown", hint="run `boxd snapshot verify` to find it")
    for manifest in manifests:
        run = manifest.meta.get("run_image")
        if isinstance(run, dict) and run.get("digest"):
            out.add(str(run["digest"]))
    return out


def collect_unpacked(store: ImageStore, roots: Path, disks: Path,
                     in_use: Callable[[], set[str]]) -> list[Path]:
    """Remove the trees under ``roots`` and the disks under ``disks`` that neither a
    named image of ``store`` nor an image whose manifest digest ``in_use()`` returns
    needs, and the temporary leftovers of dead processes. Return what was removed.

    ``in_use`` is called under the collection's lock; it raises to call the
    collection off (nothing is removed then).
    """
    if not roots.is_dir() and not disks.is_dir():
        return []
    with roots_lock(roots, fcntl.LOCK_EX):
        digests = {d.digest for d in store.refs().values()} | in_use()
        live = {EMPTY_CHAIN}
        for digest in digests:
            try:
                info = image_by_digest(store, digest, digest)
            except (NotFound, CorruptData, ValueError):
                # its manifest is gone: what was unpacked of it cannot be made again, so
                # it stays while something runs it (its root link names its chain)
                live |= _linked_chain(roots, digest)
                continue
            live.update(chain_ids([d.digest for d in info.layers]))
        keep_links = {d.split(":", 1)[1] for d in digests}
        removed = _sweep_roots(roots, live, keep_links)
        removed += _sweep_disks(disks, live | keep_links)
    for path in removed:
        log.info("collected %s", path)
    return removed


def _linked_chain(roots: Path, digest: str) -> set[str]:
    link = roots / digest.split(":", 1)[1]
    with contextlib.suppress(OSError):
        return {Path(os.readlink(link)).name}
    return set()


def _stale(path: Path) -> bool:
    try:
        return time.time() - path.lstat().st_mtime > STALE_TEMP_S
    except FileNotFoundError:
        return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sweep_roots(roots: Path, live: set[str], keep_links: set[str]) -> list[Path]:
    removed: list[Path] = []
    if not roots.is_dir():
        return removed
    for entry in roots.iterdir():  # <digest> links naming a chain, and temporary links
        if entry.name in (CHAINS, ".gc-lock"):
            continue
        dead = _stale(entry) if entry.name.startswith(".") else entry.name not in keep_links
        if dead:
            _remove(entry)
            removed.append(entry)
    chains = roots / CHAINS
    if chains.is_dir():
        for entry in chains.iterdir():  # <id> trees and <id>.below links (`_note_below`)
            dead = _stale(entry) if entry.name.startswith(".") else \
                entry.name.split(".", 1)[0] not in live
            if dead:
                _remove(entry)
                removed.append(entry)
    return removed


def _sweep_disks(disks: Path, live: set[str]) -> list[Path]:
    """Disks are named ``<chain id>.<suffix>`` (a temporary one starts with a dot)."""
    removed: list[Path] = []
    if not disks.is_dir():
        return removed
    for entry in disks.iterdir():
        if entry.name.startswith("."):
            dead = _stale(entry)
        else:
            dead = entry.name.split(".", 1)[0] not in live
        if dead:
            _remove(entry)
            removed.append(entry)
    return removed
