"""Import OCI and Docker images into boxd's image store (`boxd.storage.oci`).

Sources use skopeo's transport syntax::

    oci:DIR[:REF]                  an OCI image layout directory
    oci-archive:FILE[:REF]         a tar of one
    docker-archive:FILE[:REPO:TAG] what `docker save` writes
    docker://HOST[:PORT]/REPO[:TAG|@DIGEST]
                                   a registry (API v2; token or basic auth from
                                   ~/.docker/config.json or ``creds``; ``insecure``
                                   allows plain HTTP)

Every blob is verified against its digest as it is stored; a layer already in the store
(another image's) is not fetched again. An import that fails leaves no name behind, and
the blobs it wrote alone go with the next collection.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from boxd.errors import CorruptData, HostSetupError, InvalidRequest, NotFound
from boxd.storage.oci import MANIFEST_MEDIA, Descriptor, ImageStore, parse_digest

from ._oci_parts import (
    INDEXES,
    NAME_RE,
    TAG_RE,
    Source,
    docker_credentials,
    manifest_json,
    parse_source,
    pick,
)

__all__ = [
    "CHAINS",
    "ImageConfig",
    "ImageInfo",
    "Source",
    "chain_ids",
    "docker_credentials",
    "image_by_digest",
    "import_image",
    "inspect_image",
    "list_images",
    "parse_name",
    "parse_source",
    "remove_image",
    "resolve_image",
    "unpack_image",
]

Progress = Callable[[str, float | None], None]
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
_CHUNK = 1 << 20


def _noop(_step: str, _fraction: float | None) -> None:
    return None


# ------------------------------------------------------------------- names and sources


def parse_name(text: str) -> str:
    """``NAME[:TAG]`` as ``name:tag`` (tag ``latest`` when absent).

    Raises:
        InvalidRequest: the name or tag is not one boxd stores.
    """
    name, sep, tag = text.rpartition(":") if ":" in text.rsplit("/", 1)[-1] else (text, "", "")
    tag = tag if sep else "latest"
    if len(text) > 330 or not NAME_RE.match(name):
        raise InvalidRequest(
            f"invalid image name {text!r}",
            hint="use lower-case letters, digits and . _ - / separators, then :TAG "
                 "(e.g. envs/cartpole:v1)")
    if not TAG_RE.match(tag):
        raise InvalidRequest(f"invalid image tag {tag!r} in {text!r}",
                             hint="a tag is up to 128 of A-Z a-z 0-9 _ . - (e.g. v1)")
    return f"{name}:{tag}"


# ------------------------------------------------------------------- what an image is


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image's config that decide how it runs."""

    env: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    exposed_ports: tuple[str, ...] = ()
    healthcheck: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, doc: Any) -> ImageConfig:
        c = doc.get("config") if isinstance(doc, dict) else None
        c = c if isinstance(c, dict) else {}

        def strs(v: Any) -> tuple[str, ...]:
            return tuple(str(x) for x in v) if isinstance(v, list) else ()

        raw_health, raw_labels = c.get("Healthcheck"), c.get("Labels")
        health: dict[str, Any] = raw_health if isinstance(raw_health, dict) else {}
        labels: dict[str, Any] = raw_labels if isinstance(raw_labels, dict) else {}
        return cls(
            env=strs(c.get("Env")), entrypoint=strs(c.get("Entrypoint")),
            cmd=strs(c.get("Cmd")), working_dir=str(c.get("WorkingDir") or ""),
            user=str(c.get("User") or ""),
            exposed_ports=tuple(sorted(str(p) for p in (c.get("ExposedPorts") or {}))),
            healthcheck=strs(health.get("Test")),
            labels={str(k): str(v) for k, v in labels.items()},
        )


@dataclass(frozen=True)
class ImageInfo:
    """An image in the store."""

    name: str
    digest: str  # the manifest's
    config_digest: str
    layers: tuple[Descriptor, ...]
    size: int  # compressed layers + config, as stored
    architecture: str
    os: str
    created: str
    config: ImageConfig


class _Reader(Protocol):
    """One source, read: the manifest to store, and its blobs by digest."""

    def manifest(self) -> tuple[bytes, str]: ...
    def blob(self, desc: Descriptor) -> Iterator[bytes]: ...
    def close(self) -> None: ...


# ------------------------------------------------------------------- the store's API


def import_image(store: ImageStore, source: str, name: str, *, creds: str | None = None,
                 insecure: bool = False, progress: Progress | None = None,
                 owned: str = "") -> ImageInfo:
    """Import ``source`` into ``store`` as ``name`` and return it.

    A blob the store holds is not fetched again only when a name starting with
    ``owned`` (the caller's own images: ``"<account>/"``) reaches it. Every other blob
    is read from the source and verified, stored or not, so a manifest that names a
    digest (another account's private layer, say) claims nothing without its bytes.

    Raises:
        InvalidRequest: a malformed source or name.
        NotFound: the source (file, directory, image, tag) does not exist.
        CorruptData / IntegrityError: the source is not a valid image, or a blob does
            not match its digest (nothing is named then).
        ConnectionError-like `InvalidRequest`: a registry that cannot be reached.
    """
    report = progress or _noop
    target = parse_name(name)
    src = parse_source(source)
    store.ensure()
    with store.importing():
        reader = _open(src, creds=creds, insecure=insecure)
        try:
            if isinstance(reader, _DockerArchive):
                manifest = reader.copy_into(store, report)
            else:
                manifest = _copy(reader, store, report, store.reachable(owned))
        finally:
            reader.close()
        store.tag(target, manifest)
    report("imported", 1.0)
    return inspect_image(store, target)


def _copy(reader: _Reader, store: ImageStore, report: Progress, held: set[str]) -> Descriptor:
    raw, media = reader.manifest()
    doc = manifest_json(raw, "manifest")
    config = Descriptor.parse(doc.get("config"))
    layers = [Descriptor.parse(d) for d in doc.get("layers") or []]
    total = sum(d.size for d in layers) + config.size or 1
    done = 0
    for i, d in enumerate([config, *layers]):
        step = "config" if i == 0 else f"layer {i}/{len(layers)} {d.digest[7:19]}"
        if not (d.digest in held and store.has(d.digest, d.size)):
            report(step, done / total)
            store.ingest(_counted(reader.blob(d), step, done, total, report), d.digest,
                         d.size)
        else:
            report(f"{step} (stored)", done / total)
        done += d.size
    digest = store.ingest_bytes(raw).digest
    return Descriptor(media, digest, len(raw))


def _counted(chunks: Iterator[bytes], step: str, done: int, total: int,
             report: Progress) -> Iterator[bytes]:
    """``chunks``, reporting the fraction of the whole import at most every 1 %."""
    last = -1.0
    for chunk in chunks:
        done += len(chunk)
        if done / total - last >= 0.01:
            last = done / total
            report(step, min(last, 1.0))
        yield chunk


def inspect_image(store: ImageStore, name: str) -> ImageInfo:
    """The image named ``name``.

    Raises:
        NotFound: no such image.
    """
    target = parse_name(name)
    desc = store.refs().get(target)
    if desc is None:
        raise NotFound(f"no image named {target!r}",
                       hint="see `boxd image list`; import one with `boxd image import`")
    return _info(store, target, desc)


def resolve_image(store: ImageStore, account: str, ref: str) -> ImageInfo:
    """The image of ``account`` that ``ref`` names: ``NAME[:TAG]`` (as `boxd image
    list` shows it) or its manifest digest ``sha256:...``. The store names the account's
    images ``<account>/NAME:TAG``; the returned info keeps that full name.

    Raises:
        NotFound: the account has no such image.
        InvalidRequest: ``ref`` is not a name or a digest.
    """
    prefix = f"{account}/"
    if ref.startswith("sha256:"):
        for name, desc in sorted(store.refs().items()):
            if name.startswith(prefix) and desc.digest == ref:
                return _info(store, name, desc)
        shown = ref[:19] + "..."
    else:
        shown = parse_name(ref)
        found = store.refs().get(prefix + shown)
        if found is not None:
            return _info(store, prefix + shown, found)
    raise NotFound(f"no image {shown!r} is imported for this account",
                   hint="import it first with `boxd image import SOURCE NAME[:TAG]` "
                        "(`boxd image list` shows the imported ones)")


def image_by_digest(store: ImageStore, name: str, digest: str) -> ImageInfo:
    """The image whose manifest is ``digest`` (named ``name`` in what is returned),
    whatever names it now has.

    Raises:
        NotFound: its manifest is no longer in the store (removed and collected).
    """
    return _info(store, name, Descriptor(MANIFEST_MEDIA, parse_digest(digest), 0))


def list_images(store: ImageStore) -> list[ImageInfo]:
    """Every image in the store, by name."""
    return [_info(store, n, d) for n, d in sorted(store.refs().items())]


def remove_image(store: ImageStore, name: str,
                 keep: Iterable[str] | None = ()) -> ImageInfo:
    """Remove the name and the blobs only it held, but those of the manifests ``keep``
    names (images that machines or snapshots still run; None: unknown, so no blob is
    removed); return what was removed.

    Raises:
        NotFound: no such image.
    """
    info = inspect_image(store, name)
    store.untag(info.name)
    if keep is not None:
        store.collect(keep)
    return info


def _info(store: ImageStore, name: str, desc: Descriptor) -> ImageInfo:
    doc = store.read_json(desc.digest)
    config = Descriptor.parse(doc.get("config"))
    layers = tuple(Descriptor.parse(d) for d in doc.get("layers") or [])
    cfg = store.read_json(config.digest)
    return ImageInfo(
        name=name, digest=desc.digest, config_digest=config.digest, layers=layers,
        size=config.size + sum(d.size for d in layers),
        architecture=str(cfg.get("architecture", "")), os=str(cfg.get("os", "")),
        created=str(cfg.get("created", "")), config=ImageConfig.parse(cfg),
    )


# ------------------------------------------------------------------- readers


def _open(src: Source, *, creds: str | None, insecure: bool) -> _Reader | _DockerArchive:
    if src.transport == "oci":
        return _OciDir(Path(src.path), src.ref)
    if src.transport == "oci-archive":
        return _OciArchive(Path(src.path), src.ref)
    if src.transport == "docker-archive":
        return _DockerArchive(Path(src.path), src.ref)
    from boxd.images._registry import RegistryReader

    return RegistryReader(src, creds=creds, insecure=insecure)


class _Layout:
    """An OCI layout read through ``open_file`` (a directory or a tar)."""

    what = "the layout"

    def __init__(self, ref: str | None) -> None:
        self.ref = ref

    def open_file(self, rel: str) -> IO[bytes]:
        raise NotImplementedError

    def manifest(self) -> tuple[bytes, str]:
        with self.open_file("index.json") as f:
            index = manifest_json(f.read(4 << 20), "index.json")
        entry = pick(index, self.ref, self.what)
        desc = Descriptor.parse(entry)
        raw = self._read(desc)
        media = desc.media_type or str(manifest_json(raw, "manifest").get("mediaType", ""))
        if media in INDEXES:  # a multi-platform image: its manifest for this host
            inner = Descriptor.parse(pick(manifest_json(raw, "index"), None, self.what))
            return self._read(inner), inner.media_type or MANIFEST_MEDIA
        return raw, media or MANIFEST_MEDIA

    def _read(self, desc: Descriptor) -> bytes:
        if desc.size > 4 << 20:
            raise CorruptData(f"{self.what}: manifest {desc.digest} is over 4 MiB")
        return b"".join(self.blob(desc))

    def blob(self, desc: Descriptor) -> Iterator[bytes]:
        with self.open_file("blobs/sha256/" + desc.digest.split(":", 1)[1]) as f:
            while chunk := f.read(_CHUNK):
                yield chunk

    def close(self) -> None:
        return None


class _OciDir(_Layout):
    def __init__(self, root: Path, ref: str | None) -> None:
        super().__init__(ref)
        if not (root / "index.json").is_file():
            raise NotFound(f"{root} is not an OCI image layout (no index.json)",
                           hint="point oci: at a directory that skopeo copy or "
                                "buildah push wrote")
        self.root = root
        self.what = f"the OCI layout {root}"

    def open_file(self, rel: str) -> IO[bytes]:
        try:
            return (self.root / rel).open("rb")
        except FileNotFoundError:
            raise CorruptData(f"{self.what} lacks {rel}") from None


class _Tar:
    """A tar file whose members are opened by name."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise NotFound(f"no archive at {path}", hint="check the path")
        try:
            self.tar = tarfile.open(path, "r:*")  # noqa: SIM115 - closed by close()
            self.members = {os.path.normpath(m.name): m for m in self.tar.getmembers()
                            if m.isfile()}
        except (tarfile.TarError, EOFError) as exc:
            raise CorruptData(f"{path} is not a tar archive: {exc}") from None

    def open_file(self, rel: str) -> IO[bytes]:
        m = self.members.get(os.path.normpath(rel))
        f = self.tar.extractfile(m) if m is not None else None
        if f is None:
            raise CorruptData(f"the archive lacks {rel}")
        return f

    def close(self) -> None:
        self.tar.close()


class _OciArchive(_Layout):
    def __init__(self, path: Path, ref: str | None) -> None:
        super().__init__(ref)
        self.tar = _Tar(path)
        self.what = f"the archive {path}"

    def open_file(self, rel: str) -> IO[bytes]:
        return self.tar.open_file(rel)

    def close(self) -> None:
        self.tar.close()


class _DockerArchive:
    """What `docker save` writes: ``manifest.json`` names a config and layer tars. The
    import stores them as an OCI manifest (layers as uncompressed tar blobs)."""

    def __init__(self, path: Path, ref: str | None) -> None:
        self.tar = _Tar(path)
        self.path = path
        self.ref = ref

    def close(self) -> None:
        self.tar.close()

    def _entry(self) -> dict[str, Any]:
        with self.tar.open_file("manifest.json") as f:
            try:
                entries = json.loads(f.read(4 << 20))
            except ValueError as exc:
                raise CorruptData(f"{self.path}: manifest.json is not JSON: {exc}") from None
        if not isinstance(entries, list) or not entries:
            raise CorruptData(f"{self.path}: manifest.json names no image")
        if self.ref is None:
            return dict(entries[0])
        for e in entries:
            if self.ref in (e.get("RepoTags") or []):
                return dict(e)
        raise NotFound(f"{self.path} holds no image tagged {self.ref!r}")

    def copy_into(self, store: ImageStore, report: Progress) -> Descriptor:
        entry = self._entry()
        paths = [str(p) for p in entry.get("Layers") or []]
        report("config", 0.0)
        with self.tar.open_file(str(entry.get("Config"))) as f:
            config = store.ingest(_chunks(f))
        layers = []
        for i, rel in enumerate(paths):
            report(f"layer {i + 1}/{len(paths)}", i / max(len(paths), 1))
            with self.tar.open_file(rel) as f:
                layers.append(store.ingest(_chunks(f)))
        doc = {
            "schemaVersion": 2, "mediaType": MANIFEST_MEDIA,
            "config": {**config.to_json(), "mediaType": CONFIG_MEDIA},
            "layers": [{**d.to_json(), "mediaType": LAYER_TAR} for d in layers],
        }
        raw = json.dumps(doc, separators=(",", ":")).encode()
        return Descriptor(MANIFEST_MEDIA, store.ingest_bytes(raw).digest, len(raw))


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        yield chunk


# ------------------------------------------------------------------- root trees

_GZIP = ("application/vnd.oci.image.layer.v1.tar+gzip",
         "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
         "application/vnd.docker.image.rootfs.diff.tar.gzip",
         "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip")
_PLAIN = ("application/vnd.oci.image.layer.v1.tar",
          "application/vnd.oci.image.layer.nondistributable.v1.tar", "")


def unpack_image(store: ImageStore, info: ImageInfo, roots: Path) -> Path:
    """The image's root tree (its layers applied in order), shared read-only by what
    uses it; returns its path.

    Trees are made per layer chain: ``roots/chains/<id>`` is the tree of the first k
    layers, its id the hash of the chain below it and the k-th layer's digest. A chain
    starts as hard links of the one below (`_link_tree`: new directories, the same
    file inodes) and applies its own layer, so images that share base layers share
    those layers' file data on disk however many are unpacked. ``roots/chains/<id>.below``
    names the chain under each (QEMU builds its disks per chain on it:
    `boxd.images._disk`). ``roots/<digest>`` is a symbolic link naming the image's chain,
    made last: an image is unpacked once.

    A layer replaces a file by unlinking it first (`boxd.images._unpack`), so a
    chain never writes through a link into the tree below it. The layers are applied
    by a child process chrooted into the tree, so no path in a layer reaches outside it.

    Raises:
        CorruptData: a layer is not a tar of a supported compression.
        HostSetupError: the tree cannot be made (no root and no user namespaces).
    """
    with roots_lock(roots, fcntl.LOCK_SH):  # no collection meanwhile (`_collect`)
        return _unpack_image(store, info, roots)


@contextlib.contextmanager
def roots_lock(roots: Path, mode: int) -> Iterator[None]:
    """``roots/.gc-lock`` held in ``mode``: unpacks share it, a collection of unneeded
    trees (`boxd.images._collect`) holds it alone."""
    roots.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(roots / ".gc-lock", "a+b") as f:
        fcntl.flock(f.fileno(), mode)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


#: The folder of an image roots folder where each layer chain is unpacked, as
#: ``chains/<chain id>`` (a chain is named by its layers' digests: the same id is the
#: same tree in every data directory).
CHAINS = "chains"


def _unpack_image(store: ImageStore, info: ImageInfo, roots: Path) -> Path:
    final = roots / info.digest.split(":", 1)[1]
    ids = chain_ids([d.digest for d in info.layers])
    if final.is_dir():
        _note_below(roots / CHAINS, ids)  # an image unpacked before chains were noted
        return final.resolve()
    specs = [_compression(d, info.name) for d in info.layers]
    roots.mkdir(parents=True, exist_ok=True, mode=0o700)  # the trees inside: the image's modes
    chains = roots / CHAINS
    chains.mkdir(exist_ok=True, mode=0o700)
    below: Path | None = None
    for d, how, chain in zip(info.layers, specs, ids, strict=True):
        here = chains / chain
        if not here.is_dir():
            _make_chain(store, here, below, d.digest, how, info.name)
        below = here
    _note_below(chains, ids)
    if below is None:  # an image of no layers: an empty root
        below = chains / hashlib.sha256(b"").hexdigest()
        below.mkdir(mode=0o755, exist_ok=True)
    # a name of this call's own: two unpacks of one image at once each make a link
    link = roots / f".{final.name[:12]}-{os.getpid()}-{secrets.token_hex(4)}-link"
    link.symlink_to(Path(CHAINS) / below.name)
    os.replace(link, final)  # the last step: a root named by its image is whole
    return below


def chain_ids(layers: list[str]) -> list[str]:
    """The id of each layer chain of an image whose layers are ``layers`` (digests, in
    order): the k-th is the hash of the (k-1)-th and the k-th layer's digest, the name
    of its tree under ``<roots>/chains`` (`unpack_image`)."""
    out: list[str] = []
    chain = ""
    for digest in layers:
        chain = hashlib.sha256(f"{chain}|{digest}".encode()).hexdigest()
        out.append(chain)
    return out


def _note_below(chains: Path, ids: list[str]) -> None:
    """``chains/<id>.below``, a symbolic link naming the chain under each chain but the
    first: what a QEMU image disk is built on (`boxd.images._disk.chain_below`). The
    target follows from the id, so a second writer's link is the same."""
    for below, chain in itertools.pairwise(ids):
        note = chains / f"{chain}.below"
        if (chains / chain).is_dir() and not note.is_symlink():
            with contextlib.suppress(FileExistsError):
                note.symlink_to(below)


def _compression(d: Descriptor, name: str) -> str:
    if d.media_type in _GZIP:
        return "gzip"
    if d.media_type in _PLAIN:
        return ""
    raise CorruptData(f"layer {d.digest} of {name} is {d.media_type!r}",
                      hint="boxd unpacks tar and tar+gzip layers; convert the image "
                           "(e.g. skopeo copy --dest-compress-format gzip)")


def _make_chain(store: ImageStore, here: Path, below: Path | None, digest: str, how: str,
                name: str) -> None:
    """The tree ``here``: ``below``'s tree linked, then the layer ``digest`` applied;
    made in a temporary directory and renamed into place (another process making the
    same chain meanwhile wins; its tree is used)."""
    tmp = Path(tempfile.mkdtemp(dir=here.parent, prefix=f".{here.name[:12]}-"))
    os.chmod(tmp, 0o755)
    try:
        if below is not None:
            _link_tree(below, tmp, name)
        with store.open(digest) as f:
            _run_unpack(tmp, [f"{f.fileno()}:{how}"], [f.fileno()], name)
        try:
            os.rename(tmp, here)
        except OSError:  # another unpack of the same chain won: use its tree
            if not here.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _link_tree(src: Path, dest: Path, name: str) -> None:
    """``src``'s tree in ``dest``: directories made anew with their modes, owners,
    times and xattrs; every other entry a hard link to ``src``'s (GNU cp)."""
    prefix = [] if os.geteuid() == 0 else ["unshare", "--map-root-user"]
    cmd = [*prefix, "cp", "-a", "--link", "--no-target-directory", f"{src}/.", str(dest)]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=3600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostSetupError(f"cannot unpack {name}: {exc}",
                             hint="run the daemon as root, or enable user namespaces") from None
    if r.returncode != 0:
        tail = " | ".join(r.stderr.decode(errors="replace").strip().splitlines()[-3:])
        raise HostSetupError(f"unpacking {name} failed: linking its lower layers: {tail}",
                             hint="check the disk holding the data directory has room")


def _run_unpack(dest: Path, args: list[str], fds: list[int], name: str) -> None:
    prefix = [] if os.geteuid() == 0 else ["unshare", "--map-root-user"]
    cmd = [*prefix, sys.executable, "-I", "-S", str(Path(__file__).with_name("_unpack.py")),
           str(dest), *args]
    try:
        r = subprocess.run(cmd, pass_fds=fds, capture_output=True, timeout=3600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostSetupError(f"cannot unpack {name}: {exc}",
                             hint="run the daemon as root, or enable user namespaces") from None
    if r.returncode != 0:
        tail = r.stderr.decode(errors="replace").strip().splitlines()[-3:]
        if any("tar" in line.lower() or "gzip" in line.lower() for line in tail):
            raise CorruptData(f"a layer of {name} is not a valid tar: {' | '.join(tail)}",
                              hint="import the image again from an intact source")
        raise HostSetupError(f"unpacking {name} failed: {' | '.join(tail)}",
                             hint="run the daemon as root, or enable user namespaces "
                                  "(unshare --map-root-user)")
