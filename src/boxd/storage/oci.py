"""The OCI image store: imported container images, their layers stored once.

The store is an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/``),
so skopeo, umoci or buildah can read it as ``oci:<dir>``. A blob is named by the
sha256 of its bytes and verified while it is written: a blob that does not match the
digest its manifest promised is never stored. Images that share a layer share its file.
``index.json`` names each image (``org.opencontainers.image.ref.name``); removing a
name and collecting blobs no name reaches frees what only that image held.

Writes are atomic (a temporary file in the same directory, fsync, rename); the index
is rewritten under an exclusive lock, so concurrent imports and removals never lose
each other's names or delete a blob an import has just written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from boxd.errors import CorruptData, IntegrityError, NotFound

__all__ = [
    "INDEX_MEDIA",
    "MANIFEST_MEDIA",
    "REF_ANNOTATION",
    "Descriptor",
    "ImageStore",
    "parse_digest",
]

REF_ANNOTATION = "org.opencontainers.image.ref.name"
INDEX_MEDIA = "application/vnd.oci.image.index.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST_MEDIA = "application/vnd.docker.distribution.manifest.v2+json"
MAX_JSON = 4 << 20  # a manifest or config larger than this is refused, not read
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHUNK = 1 << 20


def parse_digest(digest: str) -> str:
    """``digest`` if it is a sha256 digest (the only algorithm boxd stores), else raise."""
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise CorruptData(f"not a sha256 digest: {str(digest)[:80]!r}",
                          hint="digests look like sha256:<64 hex digits>")
    return digest


@dataclass(frozen=True)
class Descriptor:
    """What an OCI descriptor says of a blob: its media type, digest and size."""

    media_type: str
    digest: str
    size: int

    @classmethod
    def parse(cls, raw: Any) -> Descriptor:
        if not isinstance(raw, dict):
            raise CorruptData("a descriptor is not a JSON object")
        size = raw.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CorruptData(f"descriptor of {raw.get('digest')!r} has no valid size")
        return cls(str(raw.get("mediaType", "")), parse_digest(str(raw.get("digest"))), size)

    def to_json(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


class ImageStore:
    """An OCI layout on disk that holds boxd's imported images."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs" / "sha256"

    # ---------------------------------------------------------------- set-up

    def ensure(self) -> ImageStore:
        self._dirs()
        with self.locked():
            layout = self.root / "oci-layout"
            if not layout.exists():
                _write_atomic(layout, json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
            if not (self.root / "index.json").exists():
                self._write_index([])
        return self

    def _dirs(self) -> None:
        """The store's folders, each the daemon's alone (0700; ``parents=True`` would
        make the missing ones with the default mode)."""
        for d in (self.root, self.root / "blobs", self.blobs):
            d.mkdir(exist_ok=True, mode=0o700)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The index's exclusive lock: every rewrite of ``index.json`` takes it."""
        with self._flock(".lock", fcntl.LOCK_EX):
            yield

    @contextlib.contextmanager
    def importing(self) -> Iterator[None]:
        """Held (shared) by an import from its first blob to its name, so collection
        (exclusive) never removes the blobs of an image not yet named."""
        with self._flock(".gc-lock", fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def _flock(self, name: str, how: int) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)  # the daemon's alone
        fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with open(fd, "rb", closefd=True):  # one owner of the fd: the file object
            fcntl.flock(fd, how)
            yield

    # ---------------------------------------------------------------- blobs

    def path(self, digest: str) -> Path:
        return self.blobs / parse_digest(digest).split(":", 1)[1]

    def has(self, digest: str, size: int | None = None) -> bool:
        try:
            st = self.path(digest).stat()
        except FileNotFoundError:
            return False
        return size is None or st.st_size == size

    def ingest(self, chunks: Iterable[bytes], digest: str | None = None,
               size: int | None = None) -> Descriptor:
        """Store the bytes of ``chunks`` as a blob, verified against ``digest`` and
        ``size`` when given; return its descriptor (media type empty).

        Raises:
            IntegrityError: the bytes do not match the expected digest or size; nothing
                is stored.
        """
        if digest is not None:
            parse_digest(digest)
        self._dirs()
        h = hashlib.sha256()
        n = 0
        tmp = tempfile.NamedTemporaryFile(  # noqa: SIM115 - renamed or unlinked below
            dir=self.blobs, prefix=".in-", delete=False)
        try:
            with tmp:
                for chunk in chunks:
                    n += len(chunk)
                    if size is not None and n > size:
                        raise IntegrityError(
                            f"blob {digest} is longer than the {size} bytes its descriptor "
                            "says", hint="the source is corrupt or changed during the import")
                    h.update(chunk)
                    tmp.write(chunk)
                tmp.flush()
                os.fsync(tmp.fileno())
            got = "sha256:" + h.hexdigest()
            if digest is not None and got != digest:
                raise IntegrityError(
                    f"blob {digest} has the digest {got} ({n} bytes)",
                    hint="the source is corrupt or changed during the import; nothing was "
                         "stored")
            if size is not None and n != size:
                raise IntegrityError(f"blob {digest} has {n} bytes, its descriptor says {size}",
                                     hint="the source is corrupt; nothing was stored")
            os.chmod(tmp.name, 0o600)
            os.replace(tmp.name, self.path(got))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp.name)
            raise
        return Descriptor("", got, n)

    def receive(self, digest: str, size: int, offset: int, data: bytes) -> bool:
        """Write one chunk of the blob ``digest`` (``size`` bytes in all), pushed in
        order from offset 0 by one sender (a cluster's control plane, see
        `boxd.control.ray`); after the last chunk the blob is verified and stored: True.

        Raises:
            CorruptData: a chunk that does not follow the bytes received so far.
            IntegrityError: the bytes do not match ``digest`` and ``size``; nothing is
                stored.
        """
        self._dirs()
        part = self.blobs / f".push-{parse_digest(digest).split(':', 1)[1]}"
        flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if offset == 0 else 0)
        try:
            fd = os.open(part, flags, 0o600)
        except FileNotFoundError:
            raise CorruptData(f"a chunk at {offset} of blob {digest} came before its start",
                              hint="push the blob again from offset 0") from None
        try:
            got = os.fstat(fd).st_size
            if got != offset:
                raise CorruptData(f"a chunk at {offset} of blob {digest} does not follow the "
                                  f"{got} bytes received", hint="push the blob again from 0")
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        if offset + len(data) < size:
            return False
        try:
            with open(part, "rb") as f:
                self.ingest(iter(lambda: f.read(1 << 20), b""), digest=digest, size=size)
        finally:
            part.unlink(missing_ok=True)
        return True

    def ingest_bytes(self, data: bytes, digest: str | None = None) -> Descriptor:
        return self.ingest([data], digest, None if digest is None else len(data))

    def open(self, digest: str) -> IO[bytes]:
        try:
            return self.path(digest).open("rb")
        except FileNotFoundError:
            raise NotFound(f"blob {digest} is not in the image store",
                           hint="import the image again") from None

    def read_json(self, digest: str) -> Any:
        """A JSON blob (manifest, config), verified against its digest on the way in."""
        with self.open(digest) as f:
            data = f.read(MAX_JSON + 1)
        if len(data) > MAX_JSON:
            raise CorruptData(f"blob {digest} is over {MAX_JSON} bytes: not a manifest")
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise IntegrityError(f"stored blob {digest} no longer matches its digest",
                                 hint="remove the image and import it again")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise CorruptData(f"blob {digest} is not JSON: {exc}") from None

    # ---------------------------------------------------------------- names

    def refs(self) -> dict[str, Descriptor]:
        """Every image name and its manifest's descriptor."""
        out: dict[str, Descriptor] = {}
        for m in self._read_index():
            name = (m.get("annotations") or {}).get(REF_ANNOTATION)
            if isinstance(name, str):
                out[name] = Descriptor.parse(m)
        return out

    def tag(self, name: str, manifest: Descriptor) -> None:
        """Name ``manifest`` (already stored) ``name``, replacing what had that name."""
        if not self.has(manifest.digest, manifest.size):
            raise NotFound(f"manifest {manifest.digest} is not in the image store")
        with self.locked():
            entries = [m for m in self._read_index()
                       if (m.get("annotations") or {}).get(REF_ANNOTATION) != name]
            entries.append({**manifest.to_json(), "annotations": {REF_ANNOTATION: name}})
            self._write_index(entries)

    def untag(self, name: str) -> Descriptor | None:
        """Remove the name; return what it named (None if nothing)."""
        with self.locked():
            entries = self._read_index()
            keep = [m for m in entries
                    if (m.get("annotations") or {}).get(REF_ANNOTATION) != name]
            gone = [m for m in entries if m not in keep]
            if gone:
                self._write_index(keep)
        return Descriptor.parse(gone[0]) if gone else None

    def collect(self, keep: Iterable[str] = ()) -> list[str]:
        """Remove every blob no name reaches (manifest, its config and layers, an
        index's manifests) and no manifest digest in ``keep`` does (an image a machine
        or snapshot still runs, its name removed). Return the digests removed. Blobs
        being written (temporary files) are kept, and no import is between its first
        blob and its name meanwhile (`importing`)."""
        if not self.blobs.is_dir():
            return []  # nothing stored yet (a node no image was pushed to)
        with self._flock(".gc-lock", fcntl.LOCK_EX), self.locked():
            live: set[str] = set()
            for desc in self.refs().values():
                self._reach(desc, live)
            for digest in keep:
                self._reach(Descriptor(MANIFEST_MEDIA, digest, 0), live)
            removed = []
            for f in self.blobs.iterdir():
                if f.name.startswith("."):
                    continue
                digest = "sha256:" + f.name
                if digest not in live:
                    f.unlink(missing_ok=True)
                    removed.append(digest)
            return removed

    def reachable(self, prefix: str) -> set[str]:
        """The digests of every blob the names starting with ``prefix`` reach."""
        live: set[str] = set()
        for name, desc in self.refs().items():
            if name.startswith(prefix):
                self._reach(desc, live)
        return live

    def _reach(self, desc: Descriptor, live: set[str]) -> None:
        live.add(desc.digest)
        if not self.has(desc.digest):
            return
        doc = self.read_json(desc.digest)
        for child in doc.get("manifests") or []:  # an index
            self._reach(Descriptor.parse(child), live)
        if isinstance(doc.get("config"), dict):
            live.add(Descriptor.parse(doc["config"]).digest)
        for layer in doc.get("layers") or []:
            live.add(Descriptor.parse(layer).digest)

    def _read_index(self) -> list[dict[str, Any]]:
        try:
            doc = json.loads((self.root / "index.json").read_bytes())
        except FileNotFoundError:
            return []
        manifests = doc.get("manifests") if isinstance(doc, dict) else None
        return [m for m in manifests or [] if isinstance(m, dict)]

    def _write_index(self, manifests: list[dict[str, Any]]) -> None:
        doc = {"schemaVersion": 2, "mediaType": INDEX_MEDIA, "manifests": manifests}
        _write_atomic(self.root / "index.json", json.dumps(doc, indent=1).encode())


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with open(fd, "wb") as f:  # the file object owns fd from here
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
