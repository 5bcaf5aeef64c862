"""The content-addressed snapshot store: immutable blobs plus a manifest per snapshot.

Layout under ``root`` (``paths.snapshots``)::

    blobs/sha256/<hex>        immutable blob files (0400, or 0440 for QEMU's group), sparse
    manifests/<hex>.json      canonical JSON (0400); <hex> is its sha256 = snapshot digest
    staging/<random>/         saves and imports in progress (removed by gc())
    verified/<hex>            "this blob was verified at this (size, mtime, ctime, inode)"
    .lock                     flock held while publishing, deleting or collecting

A save stages its files (copying sparse-aware while hashing), then `Staging.commit`
fsyncs them, moves each blob into ``blobs/`` (dropping it when an identical blob is
there already), and renames the manifest into place last. Until that rename nothing
is visible; a crash before it leaves only staging files and orphan blobs, which
`SnapshotStore.gc` removes. Names and versions live in the state database; this store
knows digests only.
"""

from __future__ import annotations

import array
import builtins
import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import logging
import os
import re
import secrets
import shutil
import tarfile
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import IO, Any, Final, cast

from boxd.errors import (
    CorruptData,
    IntegrityError,
    InternalError,
    InvalidRequest,
    SnapshotNotFound,
)
from boxd.storage import _files
from boxd.storage._files import Progress, os_errors
from boxd.storage.fds import OwnedFd, private_opener

__all__ = [
    "FORMAT_VERSION",
    "BlobEntry",
    "BlobRef",
    "GcReport",
    "Manifest",
    "SnapshotStore",
    "Staging",
]

log = logging.getLogger("boxd.storage.snapshots")

#: Version of the manifest format written by this code.
FORMAT_VERSION: Final = 1
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_KIND_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_MAX_MANIFEST = 1 << 20
#: A received manifest's meta nests at most this deep (boxd's own: 1).
_MAX_META_DEPTH = 32
_FIX_HINT = "delete the snapshot and save it again, or re-import it from an export"
# A file modified within this window of its verification may keep the same mtime
# (timestamps are clock-tick granular), so such a verification is not trusted later.
_RACY_WINDOW_NS = 1_000_000_000
#: Default of `SnapshotStore`'s ``group``: the QEMU user's group (daemon run as root).
QEMU_GROUP: Final = -1


@dataclass(frozen=True)
class BlobEntry:
    """One blob as a manifest records it."""

    digest: str
    size: int


@dataclass(frozen=True)
class BlobRef:
    """A blob added to a staging area.

    Attributes:
        kind: its role in the snapshot ("memory", "state", "disk", ...).
        digest: sha256 hex of its logical bytes (holes count as zeros).
        size: logical size in bytes.
        stored: bytes actually allocated on disk.
    """

    kind: str
    digest: str
    size: int
    stored: int


@dataclass(frozen=True)
class Manifest:
    """A stored snapshot: its digest, its blobs by kind and the caller's metadata."""

    digest: str
    blobs: Mapping[str, BlobEntry]
    meta: Mapping[str, Any]
    format: int = FORMAT_VERSION
    root: Path = field(default=Path("."), compare=False, repr=False)

    def blob_path(self, kind: str) -> Path:
        """Path of the blob of this kind (read-only; map or back onto it, never write).

        Raises:
            InvalidRequest: the snapshot has no blob of this kind.
        """
        try:
            entry = self.blobs[kind]
        except KeyError:
            raise InvalidRequest(
                f"snapshot {self.digest[:12]} has no {kind!r} blob", field="kind"
            ) from None
        return _blob_path(self.root, entry.digest)

    @property
    def size(self) -> int:
        """Total logical size of the blobs."""
        return sum(b.size for b in self.blobs.values())

    def stored_bytes(self) -> int:
        """Bytes allocated on disk by this snapshot's blobs (shared blobs count fully)."""
        total = 0
        for d in {b.digest for b in self.blobs.values()}:
            with contextlib.suppress(OSError):
                total += os.stat(_blob_path(self.root, d)).st_blocks * 512
        return total


@dataclass(frozen=True)
class GcReport:
    """What `SnapshotStore.gc` removed."""

    staging_dirs: int = 0
    blobs: int = 0
    freed_bytes: int = 0
    skipped_blobs: bool = False


def _blob_path(root: Path, digest: str) -> Path:
    return root / "blobs" / "sha256" / digest


def _canonical(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidRequest(
            f"not a snapshot digest: {digest!r}", hint="use 64 lowercase hex digits",
            field="digest",
        )
    return digest


def _parse_manifest(raw: bytes, digest: str, root: Path) -> Manifest:
    """Parse manifest bytes already known to hash to ``digest``.

    Raises:
        InvalidRequest: not a valid manifest of a format this code reads.
    """
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        fmt = doc["format"]
        if fmt != FORMAT_VERSION:
            raise InvalidRequest(
                f"snapshot format {fmt!r} is not supported (this boxd reads {FORMAT_VERSION})",
                hint="upgrade boxd", field="format",
            )
        blobs: dict[str, BlobEntry] = {}
        for kind, b in doc["blobs"].items():
            if not _KIND_RE.fullmatch(kind) or not _DIGEST_RE.fullmatch(b["digest"]):
                raise ValueError(f"bad blob entry {kind!r}")
            size = b["size"]
            if not isinstance(size, int) or size < 0:
                raise ValueError(f"bad size for {kind!r}")
            blobs[kind] = BlobEntry(b["digest"], size)
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError("meta is not an object")
    except InvalidRequest:
        raise
    except RecursionError:
        raise InvalidRequest(
            f"malformed snapshot manifest {digest[:12]}: nested too deeply") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequest(f"malformed snapshot manifest {digest[:12]}: {exc}") from exc
    return Manifest(digest, MappingProxyType(blobs), MappingProxyType(meta), fmt, root)


def _depth(doc: object) -> int:
    """How deeply JSON values nest (a scalar is 0), without recursing."""
    deepest = 0
    todo: list[tuple[object, int]] = [(doc, 0)]
    while todo:
        value, depth = todo.pop()
        deepest = max(deepest, depth)
        if isinstance(value, Mapping):
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)
    return deepest


class _Lock:
    """An exclusive flock on a file; works across processes and threads."""

    def __init__(self, path: Path, *, blocking: bool = True) -> None:
        self.path = path
        self.blocking = blocking
        self.fd: OwnedFd | None = None

    def acquire(self) -> bool:
        with OwnedFd.open(self.path, os.O_RDWR | os.O_CREAT, 0o600) as fd:
            try:
                fcntl.flock(fd.fd, fcntl.LOCK_EX | (0 if self.blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                return False
            self.fd = OwnedFd(fd.detach())
        return True

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            fd.close()  # closing drops the flock

    def __enter__(self) -> _Lock:
        with os_errors("lock the snapshot store", self.path):
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Staging:
    """A save in progress; use through `SnapshotStore.stage` as a context manager.

    Nothing staged is visible until `commit`; leaving the ``with`` block without
    committing (or with an exception) removes every staged file.
    """

    def __init__(self, store: SnapshotStore, directory: Path, lock: _Lock) -> None:
        self._store = store
        self.directory = directory
        self._lock = lock
        self._blobs: dict[str, tuple[BlobRef, Path | None]] = {}
        self._manifest: Manifest | None = None
        self._closed = False

    @property
    def blobs(self) -> dict[str, BlobRef]:
        """The blobs staged so far, by kind."""
        return {k: ref for k, (ref, _) in self._blobs.items()}

    def add_blob(
        self, kind: str, src: Path, *, move: bool = False, progress: Progress | None = None
    ) -> BlobRef:
        """Copy (or move) ``src`` into staging as the blob of ``kind``, hashing it.

        Copies keep holes (``SEEK_DATA``/``SEEK_HOLE``) and turn all-zero blocks into
        holes. ``move=True`` renames the file when it is on the same filesystem and has
        no other hard link (otherwise copies it and removes ``src``); the caller must
        not write to ``src`` afterwards.

        Args:
            kind: the blob's role, e.g. ``"memory"``, ``"state"``, ``"disk"``.
            src: the file to store.
            move: take the file instead of copying it.
            progress: ``progress(done_bytes, total_bytes)`` while copying/hashing.

        Returns:
            The staged blob's `BlobRef`.

        Raises:
            InvalidRequest: bad or duplicate kind, or ``src`` is not a regular file.
            ResourceExhausted: the disk is full.
            InternalError: another I/O error.
        """
        self._check_open()
        if not _KIND_RE.fullmatch(kind):
            raise InvalidRequest(f"bad blob kind {kind!r}", field="kind")
        if kind in self._blobs:
            raise InvalidRequest(f"blob kind {kind!r} added twice", field="kind")
        dst = self.directory / f"blob-{kind}"
        moved = False
        if move:
            with os_errors("move into the snapshot store", src):
                st = os.stat(src)
                if st.st_dev == os.stat(self.directory).st_dev and st.st_nlink == 1:
                    os.rename(src, dst)
                    moved = True
        if moved:
            digest, size = _files.hash_file(dst, progress)
        else:
            digest, size = _files.copy_sparse(src, dst, progress)
            if move:
                with os_errors("remove", src):
                    src.unlink()
        with os_errors("stat", dst):
            stored = os.stat(dst).st_blocks * 512
        ref = BlobRef(kind, digest, size, stored)
        self._blobs[kind] = (ref, dst)
        return ref

    def commit(self, meta: Mapping[str, Any]) -> Manifest:
        """Publish the staged blobs and a manifest holding ``meta``; return it.

        Args:
            meta: JSON-serialisable caller metadata (name, version, created_at,
                source_machine, image, engine, cpu_model, memory_mib, ...).

        Returns:
            The stored `Manifest`; its digest is the sha256 of the manifest file.

        Raises:
            InvalidRequest: nothing staged, or ``meta`` is not JSON-serialisable.
            ResourceExhausted: the disk is full.
            InternalError: another I/O error.
        """
        self._check_open()
        if not self._blobs:
            raise InvalidRequest("a snapshot needs at least one blob")
        doc = {
            "format": FORMAT_VERSION,
            "blobs": {
                k: {"digest": ref.digest, "size": ref.size} for k, (ref, _) in self._blobs.items()
            },
            "meta": dict(meta),
        }
        try:
            raw = _canonical(doc)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"snapshot metadata is not JSON: {exc}", field="meta") from exc
        manifest = self._store._publish(self.directory, raw, self._blobs.values())
        self._manifest = manifest
        return manifest

    def _stage_existing(self, ref: BlobRef, path: Path | None) -> None:
        self._blobs[ref.kind] = (ref, path)

    def _check_open(self) -> None:
        if self._closed or self._manifest is not None:
            raise InternalError("this staging area is already committed or closed")

    def close(self) -> None:
        """Remove the staging directory (after commit, only leftovers remain in it)."""
        if self._closed:
            return
        self._closed = True
        try:
            shutil.rmtree(self.directory, ignore_errors=True)
        finally:
            self._lock.release()

    def __enter__(self) -> Staging:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SnapshotStore:
    """Content-addressed, integrity-checked storage of snapshot blobs and manifests.

    Thread- and process-safe: publishing, deleting and collecting take a file lock;
    copying and hashing run outside it.
    """

    def __init__(self, root: Path, *, group: int | None = QEMU_GROUP) -> None:
        """Open (creating if needed) the store at ``root``.

        Args:
            root: the store's directory.
            group: a group that may read blobs (never list them): QEMU, dropped to its
                own user, opens a snapshot's device-state blob by path. The default is
                the QEMU user's group when the daemon runs as root; None: owner only.
        """
        self.root = root
        self.blobs_dir = root / "blobs" / "sha256"
        self.manifests_dir = root / "manifests"
        self.staging_dir = root / "staging"
        self.verified_dir = root / "verified"
        self.group = _files.qemu_group() if group == QEMU_GROUP else group
        # Private to the daemon's user; QEMU's group may only pass through to a blob.
        passable = 0o710 if self.group is not None else 0o700
        with os_errors("create the snapshot store", root):
            for d in (self.blobs_dir, self.manifests_dir, self.staging_dir, self.verified_dir):
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
            for d, mode in ((root, passable), (root / "blobs", passable),
                            (self.blobs_dir, passable), (self.manifests_dir, 0o700),
                            (self.staging_dir, 0o700), (self.verified_dir, 0o700)):
                if self.group is not None:
                    os.chown(d, -1, self.group)
                os.chmod(d, mode)

    def _seal_blob(self, path: Path) -> None:
        """Make a blob immutable: read-only for the owner (and QEMU's group, if any)."""
        if self.group is not None:
            os.chown(path, -1, self.group)
        os.chmod(path, 0o440 if self.group is not None else 0o400)

    # ---- paths and locking -------------------------------------------------------

    def _lock(self) -> _Lock:
        return _Lock(self.root / ".lock")

    def blob_path(self, digest: str) -> Path:
        """Path of a blob by digest (it may not exist)."""
        return _blob_path(self.root, _check_digest(digest))

    def blobs_of(self, snapshots: Iterable[str]) -> set[str]:
        """The blob digests of the stored ones among ``snapshots`` (machines started from
        them map or back onto these blobs)."""
        used: set[str] = set()
        for digest in snapshots:
            if self.exists(digest):
                used |= {b.digest for b in self.get(digest).blobs.values()}
        return used

    def has_blob(self, digest: str) -> bool:
        return bool(_DIGEST_RE.fullmatch(digest)) and _blob_path(self.root, digest).exists()

    def manifest_path(self, digest: str) -> Path:
        """Path of a manifest by snapshot digest (it may not exist)."""
        return self.manifests_dir / f"{_check_digest(digest)}.json"

    # ---- saving ------------------------------------------------------------------

    def stage(self) -> Staging:
        """Open a staging area for a new snapshot (use as a context manager).

        Raises:
            ResourceExhausted: the disk is full.
            InternalError: another I/O error.
        """
        with self._lock(), os_errors("create a staging directory", self.staging_dir):
            d = self.staging_dir / secrets.token_hex(8)
            d.mkdir()
            lock = _Lock(d / ".lock")
            lock.acquire()  # gc() skips staging directories whose lock is held
        return Staging(self, d, lock)

    def _publish(
        self, staging: Path, raw: bytes, blobs: Iterable[tuple[BlobRef, Path | None]]
    ) -> Manifest:
        digest = hashlib.sha256(raw).hexdigest()
        manifest = _parse_manifest(raw, digest, self.root)
        blobs = list(blobs)
        tmp_manifest = staging / "manifest.json"
        with os_errors("save the snapshot", staging):
            # Data first: every staged blob and the manifest are durable before any
            # becomes visible.
            for _, path in blobs:
                if path is not None:
                    self._seal_blob(path)
                    _files.fsync_path(path)
            with open(tmp_manifest, "xb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp_manifest, 0o400)
            with self._lock():
                for ref, path in blobs:
                    target = _blob_path(self.root, ref.digest)
                    try:
                        existing = os.stat(target).st_size
                    except FileNotFoundError:
                        existing = -1
                    if path is None or not path.exists():
                        if existing != ref.size:
                            raise InternalError(f"blob {ref.digest[:12]} vanished while saving")
                        continue
                    if existing == ref.size:
                        path.unlink()  # dedup: an identical blob is stored already
                        continue
                    os.replace(path, target)  # new, or replacing a damaged (wrong-size) copy
                    self._forget_verified(ref.digest)
                _files.fsync_dir(self.blobs_dir)
                os.replace(tmp_manifest, self.manifests_dir / f"{digest}.json")
                _files.fsync_dir(self.manifests_dir)
        log.info("snapshot %s saved blobs=%s", digest[:12], sorted(manifest.blobs))
        return manifest

    def manifest_bytes(self, digest: str) -> bytes:
        """The manifest file as stored (a peer store checks it against ``digest``)."""
        return self._read_manifest_bytes(_check_digest(digest))

    def missing(self, raw: bytes, digest: str) -> builtins.list[BlobEntry]:
        """The blobs of the manifest ``raw`` this store does not hold."""
        manifest = self._parse_received(raw, digest)
        out = []
        for entry in manifest.blobs.values():
            try:
                present = os.stat(_blob_path(self.root, entry.digest)).st_size == entry.size
            except FileNotFoundError:
                present = False
            if not present and entry not in out:
                out.append(entry)
        return out

    def _parse_received(self, raw: bytes, digest: str) -> Manifest:
        _check_digest(digest)
        if hashlib.sha256(raw).hexdigest() != digest:
            raise CorruptData(f"snapshot {digest[:12]}: the manifest sent does not match its "
                              "digest", digest=digest)
        return _parse_manifest(raw, digest, self.root)

    def receive(self, raw: bytes, digest: str, files: Mapping[str, Path]) -> Manifest:
        """Store a snapshot another store holds: its manifest and the missing blobs.

        ``files`` maps blob digests to received files (see `missing`); each is hashed
        and must match, or nothing is stored. Blobs held already are not sent again.

        Raises:
            CorruptData: the manifest or a received blob does not match its digest,
                or a missing blob was not sent.
        """
        manifest = self._parse_received(raw, digest)
        with self.stage() as staging:
            staged: builtins.list[tuple[BlobRef, Path | None]] = []
            checked: builtins.list[tuple[str, int]] = []
            for kind, entry in manifest.blobs.items():
                src = files.get(entry.digest)
                if src is None:
                    if entry in self.missing(raw, digest):
                        raise CorruptData(f"snapshot {digest[:12]}: blob {entry.digest[:12]} "
                                          "was not sent", digest=entry.digest)
                    staged.append((BlobRef(kind, entry.digest, entry.size, 0), None))
                    continue
                dst = staging.directory / f"blob-{kind}"
                with os_errors("receive the snapshot", dst):
                    os.replace(src, dst)
                checked.append((entry.digest, time.time_ns()))
                got, size = _files.hash_file(dst)
                if got != entry.digest or size != entry.size:
                    raise CorruptData(f"snapshot {digest[:12]}: blob {entry.digest[:12]} "
                                      "arrived corrupt", digest=entry.digest)
                staged.append((BlobRef(kind, got, size, os.stat(dst).st_blocks * 512), dst))
            out = self._publish(staging.directory, raw, staged)
            for blob, started in checked:  # hashed just now: no need to hash again at start
                self._remember_verified(blob, os.stat(_blob_path(self.root, blob)), started)
            return out

    def add_manifest(self, raw: bytes, digest: str) -> Manifest:
        """Record a snapshot's manifest without its blobs (a cluster's registry: the
        blobs stay on the nodes that hold them)."""
        manifest = self._parse_received(raw, digest)
        path = self.manifests_dir / f"{digest}.json"
        if not path.exists():
            _files.write_atomic(path, raw, mode=0o400)
        return manifest

    # ---- reading -----------------------------------------------------------------

    def exists(self, digest: str) -> bool:
        """Whether a snapshot with this digest is stored."""
        if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
            return False
        return (self.manifests_dir / f"{digest}.json").exists()

    def _read_manifest_bytes(self, digest: str) -> bytes:
        path = self.manifest_path(digest)
        try:
            with open(path, "rb") as f:
                return f.read(_MAX_MANIFEST + 1)
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {digest[:12]}", snapshot=digest) from None
        except OSError as exc:
            raise InternalError(f"could not read {path}: {exc.strerror or exc}") from exc

    def get(self, digest: str) -> Manifest:
        """The manifest of a stored snapshot (its own hash is checked: it is small).

        Raises:
            InvalidRequest: ``digest`` is not 64 hex digits.
            SnapshotNotFound: no such snapshot.
            IntegrityError: the manifest file does not match its digest.
        """
        raw = self._read_manifest_bytes(_check_digest(digest))
        path = self.manifest_path(digest)
        if hashlib.sha256(raw).hexdigest() != digest:
            raise IntegrityError(
                f"snapshot {digest[:12]}: the manifest is corrupt", hint=_FIX_HINT,
                digest=digest, path=str(path),
            )
        try:
            return _parse_manifest(raw, digest, self.root)
        except InvalidRequest as exc:
            raise IntegrityError(
                f"snapshot {digest[:12]}: {exc.message}", hint=_FIX_HINT,
                digest=digest, path=str(path),
            ) from exc

    def list(self) -> list[Manifest]:
        """Every stored snapshot, sorted by digest; unreadable manifests are logged and
        skipped (`verify` or `get` reports them)."""
        return self.list_all()[0]

    def list_all(self) -> tuple[builtins.list[Manifest], bool]:
        """`list`, and whether every manifest could be read (a snapshot deleted
        meanwhile counts as read)."""
        out: builtins.list[Manifest] = []
        whole = True
        for digest in self._manifest_digests():
            try:
                out.append(self.get(digest))
            except SnapshotNotFound:
                continue
            except (IntegrityError, InternalError) as exc:
                log.warning("snapshot %s skipped in list: %s", digest[:12], exc)
                whole = False
        return out, whole

    def _manifest_digests(self) -> builtins.list[str]:
        with os_errors("list snapshots", self.manifests_dir):
            names = os.listdir(self.manifests_dir)
        return sorted(
            n[:-5] for n in names if n.endswith(".json") and _DIGEST_RE.fullmatch(n[:-5])
        )

    def _referenced(self) -> tuple[set[str], bool]:
        """Blob digests referenced by any manifest, and whether every manifest parsed.

        Deliberately lenient: a manifest whose bytes no longer match its digest still
        protects the blobs it names.
        """
        refs: set[str] = set()
        complete = True
        for digest in self._manifest_digests():
            try:
                doc = json.loads(self._read_manifest_bytes(digest))
                refs.update(b["digest"] for b in doc["blobs"].values())
            except SnapshotNotFound:
                continue
            except (ValueError, KeyError, TypeError, AttributeError, InternalError):
                log.warning("snapshot %s: unreadable manifest", digest[:12])
                complete = False
        return refs, complete

    # ---- integrity ---------------------------------------------------------------

    def verify(self, digest: str, *, kinds: Iterable[str] | None = None) -> None:
        """Re-hash the manifest and the blobs (all, or those of ``kinds``).

        Success is remembered for `ensure_verified`.

        Raises:
            SnapshotNotFound: no such snapshot.
            InvalidRequest: a kind the snapshot does not have.
            IntegrityError: a blob is missing, has the wrong size or the wrong hash;
                ``.path`` names it.
        """
        self._verify(digest, kinds, cached=False)

    def ensure_verified(self, digest: str, *, kinds: Iterable[str] | None = None) -> None:
        """Verify once; later calls re-hash only blobs changed since (by size, mtime,
        ctime and inode). Use before the first use of a snapshot.

        Raises:
            SnapshotNotFound: no such snapshot.
            InvalidRequest: a kind the snapshot does not have.
            IntegrityError: as `verify`.
        """
        self._verify(digest, kinds, cached=True)

    def _verify(self, digest: str, kinds: Iterable[str] | None, *, cached: bool) -> None:
        m = self.get(digest)  # checks the manifest's own hash
        selected = list(m.blobs) if kinds is None else list(kinds)
        for kind in selected:
            entry = m.blobs.get(kind)
            if entry is None:
                raise InvalidRequest(f"snapshot {digest[:12]} has no {kind!r} blob", field="kind")
            path = _blob_path(self.root, entry.digest)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise IntegrityError(
                    f"snapshot {digest[:12]}: the {kind} blob is missing", hint=_FIX_HINT,
                    digest=digest, path=str(path),
                ) from None
            except OSError as exc:
                raise InternalError(f"could not stat {path}: {exc.strerror or exc}") from exc
            if cached and self._is_verified(entry.digest, st):
                continue
            started = time.time_ns()
            actual, size = (None, st.st_size) if st.st_size != entry.size else (
                _files.hash_file(path)
            )
            if actual != entry.digest or size != entry.size:
                raise IntegrityError(
                    f"snapshot {digest[:12]}: the {kind} blob does not match its digest",
                    hint=_FIX_HINT, digest=digest, path=str(path),
                )
            self._remember_verified(entry.digest, st, started)

    @staticmethod
    def _stat_key(st: os.stat_result) -> builtins.list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    def _is_verified(self, blob: str, st: os.stat_result) -> bool:
        try:
            rec = json.loads((self.verified_dir / blob).read_bytes())
            key, at = rec["stat"], rec["verified_at_ns"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if key != self._stat_key(st):
            return False
        # A change in the same clock tick as the last write before verification would
        # keep the same timestamps: only trust verifications well after the last change.
        return bool(max(st.st_mtime_ns, st.st_ctime_ns) + _RACY_WINDOW_NS < at)

    def _remember_verified(self, blob: str, st: os.stat_result, started_ns: int) -> None:
        rec = _canonical({"stat": self._stat_key(st), "verified_at_ns": started_ns})
        try:
            _files.write_atomic(self.verified_dir / blob, rec, mode=0o600, durable=False)
        except OSError as exc:  # only a cache: failing to write it costs a re-hash later
            log.warning("could not record verification of blob %s: %s", blob[:12], exc)

    def _forget_verified(self, blob: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.verified_dir / blob).unlink()

    # ---- deleting and collecting -------------------------------------------------

    def delete(
        self, digest: str, *, in_use: Callable[[], set[str]] | None = None
    ) -> builtins.list[str]:
        """Delete a snapshot and every blob of it no other snapshot or machine uses.

        The manifest goes first, so a crash leaves at most orphan blobs for `gc`.

        Args:
            digest: the snapshot.
            in_use: returns digests of blobs running machines map; those are kept.

        Returns:
            The digests of the blobs removed.

        Raises:
            SnapshotNotFound: no such snapshot.
            InternalError: an I/O error.
        """
        path = self.manifest_path(digest)
        removed: builtins.list[str] = []
        with self._lock(), os_errors("delete the snapshot", path):
            try:
                doc = json.loads(self._read_manifest_bytes(digest))
                mine = {b["digest"] for b in doc["blobs"].values()}
            except (ValueError, KeyError, TypeError, AttributeError):
                mine = set()  # unreadable: gc() collects its blobs
            path.unlink()
            _files.fsync_dir(self.manifests_dir)
            referenced, complete = self._referenced()
            if not complete:
                log.warning("snapshot %s deleted; blobs kept (unreadable manifests)", digest[:12])
                return removed
            pinned = in_use() if in_use is not None else set()
            for blob in sorted(mine - referenced - pinned):
                if _DIGEST_RE.fullmatch(blob) and self._remove_blob(blob) is not None:
                    removed.append(blob)
            _files.fsync_dir(self.blobs_dir)
        log.info("snapshot %s deleted blobs_removed=%d", digest[:12], len(removed))
        return removed

    def _remove_blob(self, blob: str) -> int | None:
        path = _blob_path(self.root, blob)
        try:
            freed = os.stat(path).st_blocks * 512
            path.unlink()
        except FileNotFoundError:
            return None
        self._forget_verified(blob)
        return freed

    def gc(self, *, in_use: Callable[[], set[str]] | None = None) -> GcReport:
        """Remove abandoned staging directories and blobs no manifest references.

        Run at daemon start-up (it is also safe while the store is in use: live
        staging areas are skipped, and blob removal holds the store lock).

        Args:
            in_use: returns digests of blobs running machines map; those are kept.

        Returns:
            A `GcReport` of what was removed.

        Raises:
            InternalError: an I/O error.
        """
        blobs = freed = 0
        with self._lock(), os_errors("collect garbage", self.root):
            staging = self._remove_abandoned_staging()
            referenced, complete = self._referenced()
            if complete:
                pinned = in_use() if in_use is not None else set()
                blobs, freed = self._remove_unreferenced_blobs(referenced | pinned)
            else:
                log.warning("gc kept all blobs: some manifests are unreadable")
            for name in os.listdir(self.verified_dir):
                if not (self.blobs_dir / name).exists():
                    (self.verified_dir / name).unlink(missing_ok=True)
        report = GcReport(staging, blobs, freed, not complete)
        if staging or blobs:
            log.info("snapshot gc %s", report)
        return report

    def _remove_abandoned_staging(self) -> int:
        """Remove the staging areas no live operation holds (under the store lock)."""
        removed = 0
        for name in os.listdir(self.staging_dir):
            d = self.staging_dir / name
            lock = _Lock(d / ".lock", blocking=False)
            try:
                if not lock.acquire():
                    continue
            except (FileNotFoundError, NotADirectoryError):
                pass
            try:
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)
                else:
                    d.unlink(missing_ok=True)
                removed += 1
            finally:
                lock.release()
        return removed

    def _remove_unreferenced_blobs(self, keep: set[str]) -> tuple[int, int]:
        """Remove every blob not in ``keep`` (and stray files); return (count, bytes freed).

        Only with a complete set of references, under the store lock.
        """
        blobs = freed = 0
        for name in os.listdir(self.blobs_dir):
            if name in keep:
                continue
            if not _DIGEST_RE.fullmatch(name):  # a stray temp file
                (self.blobs_dir / name).unlink(missing_ok=True)
                continue
            got = self._remove_blob(name)
            if got is not None:
                blobs += 1
                freed += got
        _files.fsync_dir(self.blobs_dir)
        return blobs, freed

    # ---- export and import -------------------------------------------------------

    def export(
        self, digest: str, out: Path, progress: Progress | None = None, *,
        compress: bool = False,
    ) -> Path:
        """Write the snapshot to one tar file (PAX, sparse blobs in GNU sparse 1.0 form).

        The archive holds ``manifests/<digest>.json`` first, then ``blobs/sha256/<hex>``;
        GNU tar extracts it (``tar -xSf``). Blobs are re-hashed while they are read, so a
        damaged store never produces a good-looking export. The file is written to a
        temporary name and renamed to ``out`` when complete.

        Args:
            digest: the snapshot.
            out: destination file.
            progress: ``progress(done_bytes, total_bytes)`` over the blobs' data.
            compress: gzip (level 1) the archive.

        Returns:
            ``out``.

        Raises:
            SnapshotNotFound: no such snapshot.
            IntegrityError: a blob does not match its digest.
            ResourceExhausted: the disk is full.
            InternalError: another I/O error.
        """
        m = self.get(digest)
        raw = self._read_manifest_bytes(digest)
        tmp = out.with_name(f".{out.name}.{secrets.token_hex(6)}.tmp")
        try:
            with os_errors("export the snapshot", out):
                _write_archive(tmp, m, raw, progress, compress=compress)
                os.replace(tmp, out)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return out

    def import_(self, path: Path, progress: Progress | None = None) -> Manifest:
        """Import a file written by `export`, verifying every digest on the way.

        Every blob the manifest names must be in the file and match its digest, even
        when the store holds the snapshot already (a manifest alone proves nothing),
        and the work done is the same either way: an import tells nothing about what
        the store holds. Importing a stored snapshot again returns it.

        Args:
            path: the export file (plain or gzipped tar).
            progress: ``progress(done_bytes, total_bytes)`` over the file.

        Returns:
            The stored `Manifest` (same digest as on the exporting store).

        Raises:
            InvalidRequest: not a boxd export, or truncated.
            CorruptData: a blob is missing from the file, or a blob or the manifest
                does not match its digest.
            ResourceExhausted: the disk is full.
            InternalError: another I/O error.
        """
        with self.stage() as staging:
            raw, staged = _read_archive(path, self, staging, progress)
            manifest = self._publish(staging.directory, raw, staged)
        return manifest


# ---- the export file: a PAX tar, sparse blobs in GNU sparse 1.0 form ----------------

_BLOCK = 512
_RECORD = 20 * _BLOCK
_NOT_EXPORT_HINT = "the file is truncated or not a boxd snapshot export; export it again"


def _tar_header(name: str, size: int, pax: dict[str, str] | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o444
    info.mtime = 0  # exports of one snapshot are byte-identical
    info.uname = info.gname = ""
    if pax:
        info.pax_headers = pax
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _pad(n: int) -> bytes:
    return bytes(-n % _BLOCK)


class _Counter:
    def __init__(self, total: int, progress: Progress | None) -> None:
        self.done = 0
        self.total = total
        self.progress = progress

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _write_archive(
    tmp: Path, m: Manifest, raw: bytes, progress: Progress | None, *, compress: bool
) -> None:
    blobs = sorted({e.digest: e.size for e in m.blobs.values()}.items())
    fds: list[tuple[str, int, int, list[tuple[int, int]]]] = []
    with contextlib.ExitStack() as opened:
        for digest, size in blobs:
            path = _blob_path(m.root, digest)
            try:
                fd = opened.enter_context(OwnedFd.open(path, os.O_RDONLY)).fd
            except FileNotFoundError:
                raise IntegrityError(
                    f"snapshot {m.digest[:12]}: blob {digest[:12]} is missing",
                    hint=_FIX_HINT, digest=m.digest, path=str(path),
                ) from None
            fds.append((digest, fd, size, []))
            if os.fstat(fd).st_size != size:
                raise IntegrityError(
                    f"snapshot {m.digest[:12]}: blob {digest[:12]} has the wrong size",
                    hint=_FIX_HINT, digest=m.digest, path=str(path),
                )
            fds[-1][3].extend(_files.data_regions(fd, size))
        counter = _Counter(
            len(raw) + sum(n for *_, regions in fds for _, n in regions), progress
        )
        with open(tmp, "xb", opener=private_opener) as rawf:
            gz = gzip.GzipFile(fileobj=rawf, mode="wb", compresslevel=1, mtime=0) if compress \
                else None
            out = cast(IO[bytes], gz if gz is not None else rawf)
            written = _write_members(out, m, raw, fds, counter)
            out.write(bytes(2 * _BLOCK + (-(written + 2 * _BLOCK) % _RECORD)))
            if gz is not None:
                gz.close()  # writes the gzip trailer; leaves rawf open
            rawf.flush()
            os.fsync(rawf.fileno())


def _write_members(
    out: IO[bytes], m: Manifest, raw: bytes,
    fds: list[tuple[str, int, int, list[tuple[int, int]]]], counter: _Counter,
) -> int:
    written = 0

    def emit(data: bytes | memoryview) -> None:
        nonlocal written
        out.write(data)
        written += len(data)

    emit(_tar_header(f"manifests/{m.digest}.json", len(raw)))
    emit(raw + _pad(len(raw)))
    counter.add(len(raw))
    buf = bytearray(_files.CHUNK)
    view = memoryview(buf)
    for digest, fd, size, regions in fds:
        name = f"blobs/sha256/{digest}"
        data_len = sum(n for _, n in regions)
        if regions == [(0, size)] or size == 0:
            emit(_tar_header(name, size))
            sparse_map = b""
        else:
            entries = [*regions]
            if not entries or sum(entries[-1]) < size:
                entries.append((size, 0))  # GNU convention: the map ends at the real size
            sparse_map = f"{len(entries)}\n".encode() + b"".join(
                f"{o}\n{n}\n".encode() for o, n in entries
            )
            sparse_map += _pad(len(sparse_map))
            emit(_tar_header(
                f"blobs/sha256/GNUSparseFile.0/{digest}", len(sparse_map) + data_len,
                {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                 "GNU.sparse.name": name, "GNU.sparse.realsize": str(size)},
            ))
            emit(sparse_map)
        h = hashlib.sha256()
        pos = 0
        for off, length in regions:
            _files.hash_zeros(h, off - pos)
            end = off + length
            while off < end:
                n = os.preadv(fd, [view[: min(_files.CHUNK, end - off)]], off)
                if n == 0:
                    raise InternalError(f"blob {digest[:12]} shrank while exporting")
                h.update(view[:n])
                emit(view[:n])
                off += n
                counter.add(n)
            pos = end
        _files.hash_zeros(h, size - pos)
        emit(_pad(len(sparse_map) + data_len))
        if h.hexdigest() != digest:
            raise IntegrityError(
                f"snapshot {m.digest[:12]}: blob {digest[:12]} does not match its digest",
                hint=_FIX_HINT, digest=m.digest, path=str(_blob_path(m.root, digest)),
            )
    return written


# ---- reading an export: a strict reader of exactly what _write_archive writes --------
#
# Not tarfile: its PAX parser is quadratic on some headers (CVE-2024-6232; the fix is in
# later Pythons only) and holds the GIL meanwhile, freezing the daemon; and it reads
# whatever a header claims into memory (a PAX header, a GNU sparse map) before looking at
# it. This reader takes only the member types and PAX keys boxd writes, bounds every size
# before reading it, and checks every claimed size against what the file can hold, so the
# work an import does is bounded by the bytes sent (and the zeros of holes by the
# manifest's blob sizes, themselves bounded).

#: A PAX extended header boxd writes is < 300 bytes.
_MAX_PAX = 64 << 10
#: PAX keys boxd writes; and keys other PAX writers add for fields boxd ignores.
_PAX_KEYS: Final = frozenset({
    "path", "size", "GNU.sparse.major", "GNU.sparse.minor", "GNU.sparse.name",
    "GNU.sparse.realsize",
})
_PAX_IGNORED: Final = frozenset({"mtime", "atime", "ctime", "uid", "gid", "uname", "gname"})
#: A snapshot has 3 blobs (memory, state, disk); an import takes at most this many.
_MAX_IMPORT_BLOBS = 64
#: Largest blob (and sum of blobs) an import takes: twice boxd's largest disk (256 GiB).
#: Holes cost hashing their zeros (~0.7 s a GiB): this bounds what a small file can ask.
_MAX_BLOB_SIZE = 512 << 30
#: Entries of one GNU sparse map (data regions and holes alternating): 16 bytes of memory
#: each while the blob is read.
_MAX_SPARSE_ENTRIES = 1 << 22
#: deflate expands at most 1032-fold: a gzip file of N bytes holds at most this many N.
_GZIP_RATIO = 1032
_ZERO_BLOCK = bytes(_BLOCK)
_OCTAL_RE = re.compile(rb"[0-7]{1,12}")
_DECIMAL_RE = re.compile(r"[0-9]{1,20}")
_TYPE_NAMES: Final = {
    b"1": "hard link", b"2": "symlink", b"3": "character device", b"4": "block device",
    b"5": "directory", b"6": "fifo", b"7": "contiguous file", b"g": "global header",
    b"L": "GNU long name", b"K": "GNU long link", b"S": "GNU sparse file",
}
_GZIP_ERRORS: tuple[type[BaseException], ...] = (gzip.BadGzipFile, EOFError, zlib.error)


@dataclass(frozen=True)
class _Member:
    name: str
    size: int  # bytes of data in the archive (a sparse member's map and data regions)
    realsize: int | None  # a sparse member's logical size


class _ArchiveReader:
    """The export's tar stream (plain, or gzip detected by its magic), read strictly."""

    def __init__(self, rawf: IO[bytes], total: int) -> None:
        self.rawf = rawf
        self.total = total
        head = rawf.read(2)
        rawf.seek(0)
        self.gz = gzip.GzipFile(fileobj=rawf, mode="rb") if head == b"\x1f\x8b" else None
        self.f: IO[bytes] = cast(IO[bytes], self.gz) if self.gz is not None else rawf
        #: An upper bound of the tar stream's length: what a claimed size is checked against.
        self.limit = total * _GZIP_RATIO if self.gz is not None else total
        self.pos = 0

    @staticmethod
    def invalid(why: str) -> InvalidRequest:
        return InvalidRequest(f"the snapshot file {why}", hint=_NOT_EXPORT_HINT, field="file")

    def left(self) -> int:
        """At most this many bytes of the tar stream are left."""
        return self.limit - self.pos

    def readinto(self, view: memoryview) -> int:
        try:
            n = cast(io.BufferedIOBase, self.f).readinto(view)
        except _GZIP_ERRORS as exc:
            raise InvalidRequest(
                f"the snapshot file is not a complete boxd snapshot export: {exc}",
                hint=_NOT_EXPORT_HINT, field="file",
            ) from exc
        self.pos += n
        return n

    def read_exact(self, n: int) -> bytes:
        if n > self.left():
            raise self.invalid("is truncated")
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.readinto(view[got:])
            if not k:
                raise self.invalid("is truncated")
            got += k
        return bytes(buf)

    def close(self) -> None:
        if self.gz is not None:
            self.gz.close()

    def next_member(self) -> _Member | None:
        """The next regular member (with its PAX header applied), or None at the end."""
        pax: dict[str, str] | None = None
        while True:
            block = self.read_exact(_BLOCK)
            if block == _ZERO_BLOCK:
                if pax is not None:
                    raise self.invalid("has an extended header for no member")
                return None
            size = self._header_size(block)
            flag = block[156:157]
            if flag == b"x":
                if pax is not None:
                    raise self.invalid("has two extended headers for one member")
                pax = self._read_pax(size)
                continue
            if flag not in (b"0", b"\0"):
                kind = _TYPE_NAMES.get(flag, f"type {flag!r}")
                raise self.invalid(f"has a member boxd does not write (a {kind})")
            return self._member(self._header_name(block), size, pax or {})

    def _header_size(self, block: bytes) -> int:
        """The size a ustar header block gives, once its magic and checksum are checked."""
        if block[257:263] != b"ustar\0":
            raise self.invalid("is not a boxd snapshot export (not a POSIX tar)")
        if _octal(block[148:156]) != sum(block[:148]) + 256 + sum(block[156:]):
            raise self.invalid("has a damaged member header (bad checksum)")
        size = _octal(block[124:136])
        if size is None:
            raise self.invalid("has a member header with a bad size")
        return size

    def _read_pax(self, size: int) -> dict[str, str]:
        """Read and parse the data of a PAX extended header of ``size`` bytes."""
        if size > _MAX_PAX:
            raise self.invalid(
                f"has an extended header of {size} bytes (boxd writes < 1 KiB; "
                f"at most {_MAX_PAX} are read)"
            )
        return _parse_pax(self.read_exact(size + len(_pad(size)))[:size], self.invalid)

    def _header_name(self, block: bytes) -> str:
        """A ustar header's member name: its prefix field, then its name field."""
        try:
            name = _cstr(block[0:100])
            prefix = _cstr(block[345:500])
        except UnicodeDecodeError:
            raise self.invalid("has a member name that is not ASCII") from None
        return f"{prefix}/{name}" if prefix else name

    def _member(self, name: str, size: int, pax: dict[str, str]) -> _Member:
        name = pax.get("path", name)
        if "size" in pax:
            size = _decimal(pax["size"], self.invalid)
        realsize = None
        if any(k.startswith("GNU.sparse.") for k in pax):
            if (pax.get("GNU.sparse.major"), pax.get("GNU.sparse.minor")) != ("1", "0") \
                    or "GNU.sparse.name" not in pax or "GNU.sparse.realsize" not in pax:
                raise self.invalid("has a sparse member in a form boxd does not write")
            name = pax["GNU.sparse.name"]
            realsize = _decimal(pax["GNU.sparse.realsize"], self.invalid)
        if size + len(_pad(size)) > self.left():
            raise self.invalid(
                f"is truncated: member {name[:120]!r} claims {size} bytes, more than the "
                "file holds"
            )
        return _Member(name, size, realsize)

    def sparse_map(self, member: _Member, realsize: int) -> array.array[int]:
        """Read a GNU sparse 1.0 map: ``[off0, len0, off1, len1, ...]``.

        The map is decimal lines at the start of the member's data (the entry count,
        then offset and length of each data region), padded to a block. Entries are in
        order, do not overlap and end within ``realsize``; only the last may be empty
        (GNU's end marker); their lengths add up to the data after the map.
        """
        bad = self.invalid("has a blob with a bad sparse map")
        numbers = _SparseMapNumbers(member.size, realsize, bad)
        pending = b""
        used = 0
        while not numbers.complete():
            if used + _BLOCK > member.size:
                raise bad
            lines = (pending + self.read_exact(_BLOCK)).split(b"\n")
            used += _BLOCK
            pending = lines.pop()  # a number continued in the next block, or padding
            for line in lines:
                if numbers.complete():
                    break  # the padding after the map
                numbers.take(line)
            if len(pending) > 20 and not numbers.complete():
                raise bad
        if sum(numbers.entries[1::2]) != member.size - used:
            raise bad
        return numbers.entries


class _SparseMapNumbers:
    """The numbers of a GNU sparse 1.0 map, each checked as it is taken.

    First the entry count, then an offset and a length for each data region; ``bad`` is
    raised for the first number that does not fit (see `_ArchiveReader.sparse_map`).
    """

    def __init__(self, member_size: int, realsize: int, bad: InvalidRequest) -> None:
        self.member_size = member_size
        self.realsize = realsize
        self.bad = bad
        self.entries: array.array[int] = array.array("q")
        self.count = -1
        self.end = 0  # where the last data region taken ends

    def complete(self) -> bool:
        return self.count >= 0 and len(self.entries) == 2 * self.count

    def take(self, line: bytes) -> None:
        if not line.isdigit() or len(line) > 20:
            raise self.bad
        value = int(line)
        if self.count < 0:
            # every entry takes >= 4 bytes of map and all but the last >= 1 of data
            if value < 1 or value > _MAX_SPARSE_ENTRIES or 4 * value > self.member_size:
                raise self.bad
            self.count = value
        elif len(self.entries) % 2 == 0:  # an offset
            if value < self.end or value > self.realsize:
                raise self.bad
            self.entries.append(value)
        else:  # a length
            self.end = self.entries[-1] + value
            last = len(self.entries) == 2 * self.count - 1
            if self.end > self.realsize or (value == 0 and not last):
                raise self.bad
            self.entries.append(value)


def _octal(field: bytes) -> int | None:
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    return int(digits, 8) if _OCTAL_RE.fullmatch(digits) else None


def _decimal(value: str, invalid: Callable[[str], InvalidRequest]) -> int:
    if not _DECIMAL_RE.fullmatch(value):
        raise invalid(f"has a bad number in an extended header: {value[:40]!r}")
    return int(value)


def _cstr(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("ascii")


def _parse_pax(data: bytes, invalid: Callable[[str], InvalidRequest]) -> dict[str, str]:
    """Parse PAX records (``"<len> <key>=<value>\\n"``) in one linear pass.

    Only the keys boxd writes (and a few harmless ones) are taken, each at most once.
    """
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        sp = data.find(b" ", pos, pos + 8)
        field = data[pos:sp]
        if sp < 0 or not field.isdigit():
            raise invalid("has a malformed extended header")
        end = pos + int(field)
        if end <= sp + 2 or end > len(data) or data[end - 1] != 0x0A:
            raise invalid("has a malformed extended header")
        key, eq, value = data[sp + 1 : end - 1].partition(b"=")
        name = key.decode("ascii", "replace")
        if not eq or name in out:
            raise invalid("has a malformed extended header")
        if name not in _PAX_KEYS and name not in _PAX_IGNORED:
            raise invalid(f"has an extended header key boxd does not write ({name[:40]!r})")
        try:
            out[name] = value.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid("has an extended header that is not UTF-8") from None
        pos = end
    return out


def _read_archive(
    path: Path, store: SnapshotStore, staging: Staging, progress: Progress | None
) -> tuple[bytes, list[tuple[BlobRef, Path]]]:
    # Messages speak of "the snapshot file": the path is the daemon's spool file.
    try:
        rawf = open(path, "rb")  # noqa: SIM115 - closed below, after the reader
    except FileNotFoundError:
        raise InvalidRequest(f"no such file: {path}", field="path") from None
    except OSError as exc:
        raise InternalError(f"could not open {path}: {exc.strerror or exc}") from exc
    try:
        total = os.fstat(rawf.fileno()).st_size
        reader = _ArchiveReader(rawf, total)
        try:
            with os_errors("import the snapshot file", store.staging_dir):
                return _read_members(reader, store, staging, lambda: progress and progress(
                    rawf.tell(), total))
        finally:
            with contextlib.suppress(*_GZIP_ERRORS):
                reader.close()
    finally:
        rawf.close()


def _check_claims(manifest: Manifest, invalid: Callable[[str], InvalidRequest]) -> None:
    """What a received manifest may name: 1 to 64 blobs of sane sizes, shallow meta."""
    if not manifest.blobs:
        raise invalid("has a manifest naming no blobs")
    if len(manifest.blobs) > _MAX_IMPORT_BLOBS:
        raise invalid(f"has a manifest naming {len(manifest.blobs)} blobs (at most "
                      f"{_MAX_IMPORT_BLOBS})")
    sizes: dict[str, int] = {}
    for kind, e in manifest.blobs.items():
        if e.size > _MAX_BLOB_SIZE:
            raise invalid(f"has a manifest claiming a {e.size}-byte {kind} blob (at most "
                          f"{_MAX_BLOB_SIZE})")
        if sizes.setdefault(e.digest, e.size) != e.size:
            raise invalid(f"has a manifest giving blob {e.digest[:12]} two sizes")
    if sum(sizes.values()) > _MAX_BLOB_SIZE:
        raise invalid(f"has a manifest claiming {sum(sizes.values())} bytes of blobs (at "
                      f"most {_MAX_BLOB_SIZE})")
    if _depth(manifest.meta) > _MAX_META_DEPTH:
        raise invalid(f"has a manifest whose meta nests deeper than {_MAX_META_DEPTH}")


def _corrupt(why: str, digest: str) -> CorruptData:
    return CorruptData(
        f"the snapshot file is corrupt: {why}", field="file", digest=digest,
        hint="export the snapshot again and import the new file",
    )


def _read_manifest_member(src: _ArchiveReader, store: SnapshotStore) -> tuple[bytes, Manifest]:
    """The archive's first member: the manifest (its raw bytes checked against its name)."""
    first = src.next_member()
    match = re.fullmatch(r"manifests/([0-9a-f]{64})\.json", first.name) if first else None
    if first is None or match is None or first.realsize is not None \
            or first.size > _MAX_MANIFEST:
        raise src.invalid("does not start with a snapshot manifest")
    digest = match.group(1)
    raw = src.read_exact(first.size + len(_pad(first.size)))[: first.size]
    if hashlib.sha256(raw).hexdigest() != digest:
        raise _corrupt(f"the manifest does not match its digest {digest[:12]}", digest)
    return raw, _parse_manifest(raw, digest, store.root)


def _read_members(
    src: _ArchiveReader, store: SnapshotStore, staging: Staging, tick: Callable[[], object],
) -> tuple[bytes, list[tuple[BlobRef, Path]]]:
    invalid = src.invalid
    raw, manifest = _read_manifest_member(src, store)
    digest = manifest.digest
    _check_claims(manifest, invalid)
    # Every blob is read, hashed and staged, stored already or not (the store drops
    # duplicates when publishing): nothing here depends on what the store holds.
    needed = {e.digest: e.size for e in manifest.blobs.values()}
    got: dict[str, Path] = {}
    # At most one member per blob the manifest names: then the end of the archive.
    while (member := src.next_member()) is not None:
        match = re.fullmatch(r"blobs/sha256/([0-9a-f]{64})", member.name)
        if match is None:
            raise invalid(f"has an unexpected member {member.name[:120]!r}")
        blob = match.group(1)
        if blob not in needed or blob in got:
            raise invalid(f"has an unexpected blob {blob[:12]}")
        size = needed[blob]
        if (member.size if member.realsize is None else member.realsize) != size:
            raise _corrupt(f"blob {blob[:12]} has the wrong size", digest)
        dst = staging.directory / f"import-{blob}"
        if _stage_blob(src, member, blob, size, dst, tick) != blob:
            raise _corrupt(f"blob {blob[:12]} does not match its digest", digest)
        got[blob] = dst
    missing = set(needed) - set(got)
    if missing:
        raise _corrupt(
            f"{len(missing)} of the {len(needed)} blobs its manifest names are not in it",
            digest,
        )
    staged: list[tuple[BlobRef, Path]] = []
    for kind, e in manifest.blobs.items():
        p = got[e.digest]
        staged.append((BlobRef(kind, e.digest, e.size, p.stat().st_blocks * 512), p))
    tick()
    return raw, staged


def _stage_blob(
    src: _ArchiveReader, member: _Member, blob: str, size: int, dst: Path,
    tick: Callable[[], object],
) -> str:
    """Write blob member ``blob`` (``size`` bytes, holes kept) to ``dst``; its sha256.

    Reads the member's data through its padding; ``dst`` must not exist.
    """
    regions = array.array("q", [0, size]) if member.realsize is None \
        else src.sparse_map(member, size)
    view = memoryview(bytearray(_files.CHUNK))
    h = hashlib.sha256()
    with OwnedFd.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600) as owned:
        fd = owned.fd
        pos = 0
        for i in range(0, len(regions), 2):
            off, length = regions[i], regions[i + 1]
            _files.hash_zeros(h, off - pos)
            end = off + length
            while off < end:
                n = src.readinto(view[: min(_files.CHUNK, end - off)])
                if not n:
                    raise src.invalid(f"is truncated (in blob {blob[:12]})")
                chunk = view[:n]
                h.update(chunk)
                _files.write_nonzero(fd, chunk, off)
                off += n
                tick()
            pos = end
        _files.hash_zeros(h, size - pos)
        os.ftruncate(fd, size)
    src.read_exact(len(_pad(member.size)))
    return h.hexdigest()
