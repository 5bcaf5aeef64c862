"""Container images (issue 41): import, new → ready, and the disk that images sharing a
base take.

Figures (each image is made here, offline: an OCI layout whose base layer is 600 MB of
this host's own files, real binaries and text, ~170 MB compressed, plus a small layer
of its own):

- ``import oci: (N MB)``: `boxd image import` of the layout (N MB compressed), each run
  a new name after the last was removed. Baseline, same run: ``cp`` + ``sha256sum`` of
  the same blobs, the floor of an importer that verifies and stores. Target: ≤ 10 s.
  ``tar -xzf`` of the layers is shown beside it: the floor of the unpack that the
  image's first machine does.
- ``new → ready, image`` against ``new → ready, default image`` on each engine that
  runs images: the same machine size, from the image and from boxd's own root; the
  first new of an image unpacks it and is shown apart (``first new``). Target: ≤ 1.5x.
- ``disk, 10 images on one base``: ``du`` of the image store and the unpacked roots
  after ten images sharing the base were imported and each booted once on gVisor,
  against the same for one image. Target: the base stored once (a ratio near 1, not
  10). QEMU boots disks made from the trees once per layer chain (the base's ext4, a
  qcow2 of each image's own layer on it): ``disk, 10 images on one base, QEMU's
  disks`` is ``du`` of the chains' disks after each of the ten booted once on QEMU,
  against one image's.

Run ``python bench/bench_images.py`` as root with the daemon's data directory at
``$BOXD_HOME`` (default /var/lib/boxd); ``BENCH_IMG_MB`` sets the base's size,
``BENCH_IMG_N`` the runs per figure (default 5).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import Row, row_from, say, standalone

GROUP = "images"
SOURCES = ("/usr/lib/x86_64-linux-gnu", "/usr/share", "/usr/lib")


def _host_files(limit: int) -> Iterator[Path]:
    """Regular files of this host, up to ``limit`` bytes in all (a stable order)."""
    total = 0
    for top in SOURCES:
        for dirpath, dirs, files in os.walk(top):
            dirs.sort()
            for name in sorted(files):
                p = Path(dirpath) / name
                try:
                    if p.is_symlink() or not p.is_file():
                        continue
                    size = p.stat().st_size
                except OSError:
                    continue
                if total + size > limit:
                    return
                total += size
                yield p


def _layer(dest: Path, files: Iterator[Path] | dict[str, bytes]) -> tuple[str, str, int]:
    """A gzip layer at ``dest``: (its digest, its diff id, its size)."""
    raw = dest.with_suffix(".tar")
    with tarfile.open(raw, "w", format=tarfile.PAX_FORMAT) as tar:
        if isinstance(files, dict):
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o755
                tar.addfile(info, io.BytesIO(data))
        else:
            for p in files:
                tar.add(p, arcname=str(p).lstrip("/"), recursive=False)
    h = hashlib.sha256()
    with open(raw, "rb") as src:
        while chunk := src.read(1 << 20):
            h.update(chunk)
    diff = h.hexdigest()
    with open(raw, "rb") as src, open(dest, "wb") as dst, \
            gzip.GzipFile(fileobj=dst, mode="wb", compresslevel=6, mtime=0) as out:
        shutil.copyfileobj(src, out, 1 << 20)
    raw.unlink()
    h = hashlib.sha256()
    with open(dest, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest(), diff, dest.stat().st_size


def _layout(root: Path, base: tuple[Path, str, str, int], top: dict[str, bytes]) -> Path:
    """An OCI layout at ``root``: ``base`` (a made layer) and a layer of ``top``."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    base_path, base_digest, base_diff, base_size = base
    os.link(base_path, blobs / base_digest)
    top_digest, top_diff, top_size = _layer(root / "top.tar.gz", top)
    (root / "top.tar.gz").rename(blobs / top_digest)
    cfg = json.dumps({"architecture": "amd64", "os": "linux",
                      "config": {"Cmd": ["/bin/sh"]},
                      "rootfs": {"type": "layers",
                                 "diff_ids": [f"sha256:{base_diff}", f"sha256:{top_diff}"]},
                      }).encode()
    cfg_digest = hashlib.sha256(cfg).hexdigest()
    (blobs / cfg_digest).write_bytes(cfg)
    gz = "application/vnd.oci.image.layer.v1.tar+gzip"
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": f"sha256:{cfg_digest}", "size": len(cfg)},
        "layers": [{"mediaType": gz, "digest": f"sha256:{base_digest}", "size": base_size},
                   {"mediaType": gz, "digest": f"sha256:{top_digest}", "size": top_size}],
    }).encode()
    m_digest = hashlib.sha256(manifest).hexdigest()
    (blobs / m_digest).write_bytes(manifest)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": f"sha256:{m_digest}", "size": len(manifest),
        "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}))
    return root


def _du(*paths: Path) -> float:
    """Bytes on disk under ``paths`` (one ``du``: a file linked twice counts once)."""
    there = [str(p) for p in paths if p.exists()]
    if not there:
        return 0.0
    out = subprocess.run(["du", "-s", "-B1", "-c", *there], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    return float(out.split()[0])


def _image_paths(b: Any, store: Path, roots: Path, name: str) -> list[Path]:
    """What the image ``name`` holds on disk: its blobs in the store and its unpacked
    layer chains (named as `boxd.images.oci.unpack_image` names them)."""
    from boxd.images.oci import chain_ids

    img = b.images.get(name)
    blobs = store / "blobs" / "sha256"
    digests = [img.digest, img.config_digest, *(layer.digest for layer in img.layers)]
    return [*(blobs / d.split(":", 1)[1] for d in digests),
            *(roots / "chains" / c for c in chain_ids([lyr.digest for lyr in img.layers]))]


def _disk_paths(b: Any, disks: Path, name: str) -> list[Path]:
    """QEMU's disks of the image ``name``: one per layer chain (`boxd.images._disk`:
    ``<chain>.ext4`` or ``<chain>.qcow2``, whichever was made)."""
    from boxd.images.oci import chain_ids

    chains = chain_ids([layer.digest for layer in b.images.get(name).layers])
    return [disks / f"{c}{suffix}" for c in chains for suffix in (".ext4", ".qcow2")]


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(client: Any | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    from boxd import Boxd, errors
    from boxd.config import Paths

    tell = log or say
    b = client or Boxd()
    n = int(os.environ.get("BENCH_IMG_N", "5"))
    mb = int(os.environ.get("BENCH_IMG_MB", "600"))
    busybox = shutil.which("busybox")
    if busybox is None:
        raise SystemExit("bench_images needs a static busybox (Debian's busybox-static)")
    paths = Paths.default()
    rows: list[Row] = []
    made: list[str] = []
    names: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="boxd-bench-img-"))
    try:
        tell(f"bench_images: a {mb} MB base layer from this host's files")
        base_path = work / "base.tar.gz"
        base = (base_path, *_layer(base_path, _host_files(mb << 20)))
        top = {"bin/busybox": Path(busybox).read_bytes()}
        top["bin/sh"] = top["bin/busybox"]
        layouts = [_layout(work / f"l{i}", base, {**top, f"app/{i}": str(i).encode()})
                   for i in range(10)]
        size_mb = sum(p.stat().st_size for p in (layouts[0] / "blobs/sha256").iterdir()) / 1e6

        def copy_hash() -> None:
            dest = Path(tempfile.mkdtemp(dir=work))
            for blob in sorted((layouts[0] / "blobs/sha256").iterdir()):
                subprocess.run(["cp", str(blob), str(dest)], check=True)
                subprocess.run(["sha256sum", str(dest / blob.name)], check=True,
                               capture_output=True)
            shutil.rmtree(dest)

        def tar_x() -> None:
            dest = Path(tempfile.mkdtemp(dir=work))
            for blob in sorted((layouts[0] / "blobs/sha256").iterdir()):
                if blob.stat().st_size > 4096:
                    subprocess.run(["tar", "-xzf", str(blob), "-C", str(dest)], check=True)
            shutil.rmtree(dest)

        def import_once(i: int) -> None:
            name = f"bench/img-once:{i}"
            b.images.import_(f"oci:{layouts[0]}:v1", name)
            b.images.remove(name)

        tell(f"bench_images: import x{n} against cp + sha256sum")
        b.info()  # the daemon is up before anything is timed
        floor = [_timed(copy_hash) for _ in range(n)]
        untar = [_timed(tar_x) for _ in range(n)]
        imports = []
        for i in range(n):
            imports.append(_timed(lambda i=i: import_once(i)))  # type: ignore[misc]
        what = f"{size_mb:.0f} MB compressed, {mb} MB of files"
        rows.append(row_from(GROUP, "cp + sha256sum of the blobs (host floor)", floor,
                             note=what))
        rows.append(row_from(GROUP, f"import oci: ({size_mb:.0f} MB)", imports,
                             baseline="cp + sha256sum of the blobs (host floor)",
                             baseline_values=floor, note="verify, store, index; then rm"))
        rows.append(row_from(GROUP, "tar -xzf of the layers (host)", untar, note=what))
        store, roots = paths.images_store, paths.image_roots
        names.append("bench/img0:v1")
        b.images.import_(f"oci:{layouts[0]}:v1", names[0])
        engines = [e.name for e in b.info().engines if e.status == "ok"]
        for engine in engines:
            accel = next((e.accelerator or "?" for e in b.info().engines if e.name == engine), "?")

            def new_ready(engine: str = engine, **kw: Any) -> float:
                t = time.perf_counter()
                m = b.machines.new(engine=engine, **kw)
                made.append(m.id)
                b.machines.wait_until_ready(m.id, timeout=600)
                took = time.perf_counter() - t
                b.machines.delete(m.id)
                made.remove(m.id)
                return took

            try:
                first = [new_ready(image=names[0])]
            except errors.InvalidRequest as exc:
                tell(f"bench_images: {engine} runs no images: {exc}")
                continue
            tell(f"bench_images: new -> ready x{n} on {engine}, default and image")
            default = [new_ready() for _ in range(n)]
            image = [new_ready(image=names[0]) for _ in range(n)]
            rows.append(row_from(GROUP, f"new → ready, default image ({engine})", default,
                                 accel=accel))
            rows.append(row_from(GROUP, f"new → ready, image ({engine})", image, accel=accel,
                                 baseline=f"new → ready, default image ({engine})",
                                 baseline_values=default))
            rows.append(row_from(GROUP, f"first new → ready of an image ({engine})", first,
                                 accel=accel, note="unpacks its layers (see tar -xzf)"))
            if engine == "qemu":  # its disks of the image: one per layer chain
                rows += _qemu_disks(b, layouts, names, new_ready, paths.image_disks, tell)
            if engine == "gvisor":  # the trees machines run on, shared by layer chain
                one = _du(*_image_paths(b, store, roots, names[0]))
                for i, layout in enumerate(layouts[1:], 1):
                    if len(names) <= i:  # not yet imported by the QEMU part
                        names.append(f"bench/img{i}:v1")
                        b.images.import_(f"oci:{layout}:v1", names[-1])
                    new_ready(image=names[i])
                ten = _du(*[p for name in names for p in _image_paths(b, store, roots, name)])
                rows.append(row_from(GROUP, "disk, 1 image imported and booted", [one / 1e6],
                                     unit="MB"))
                rows.append(row_from(GROUP, "disk, 10 images on one base, each booted",
                                     [ten / 1e6], unit="MB",
                                     baseline="disk, 1 image imported and booted",
                                     baseline_values=[one / 1e6],
                                     note=f"store + unpacked roots ({engine})"))
    finally:
        for ref in made:
            try:
                b.machines.delete(ref)
            except Exception as exc:  # a benchmark cleans up what it can
                tell(f"bench_images: could not delete {ref}: {exc}")
        for name in names:
            try:
                b.images.remove(name)
            except Exception as exc:
                tell(f"bench_images: could not remove {name}: {exc}")
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _qemu_disks(b: Any, layouts: list[Path], names: list[str],
                new_ready: Callable[..., float], disks: Path,
                tell: Callable[[str], None]) -> list[Row]:
    """QEMU's disks of one image, then of the ten on one base (each booted once on
    QEMU, imported here if the gVisor part has not yet)."""
    one = _du(*_disk_paths(b, disks, names[0]))
    for i, layout in enumerate(layouts[1:], 1):
        if len(names) <= i:
            names.append(f"bench/img{i}:v1")
            b.images.import_(f"oci:{layout}:v1", names[-1])
    tell("bench_images: the ten images booted once each on qemu")
    for name in names[1:]:
        new_ready(image=name)
    ten = _du(*[p for name in names for p in _disk_paths(b, disks, name)])
    return [
        row_from(GROUP, "disk, an image's disks (qemu)", [one / 1e6], unit="MB",
                 note="its layer chains' disks: QEMU's root"),
        row_from(GROUP, "disk, 10 images on one base, QEMU's disks", [ten / 1e6], unit="MB",
                 baseline="disk, an image's disks (qemu)", baseline_values=[one / 1e6],
                 note="the base's ext4 once, a qcow2 per image's own layer"),
    ]


if __name__ == "__main__":
    standalone(run, "images")
