"""Container images made by the tests, with the standard library only: an OCI layout
(a directory, or a tar of one), a `docker save` archive, a push to a registry, and a
real registry (Debian's docker-registry) on a loopback port."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

Files = Mapping[str, bytes]


def layer_tar(files: Files) -> bytes:
    """An uncompressed layer: ``files`` (path -> content) as a tar, with fixed metadata
    so the same files give the same digest."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o755, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Image:
    """An image's blobs: config, layers (gzip), manifest."""

    config: bytes
    layers: list[bytes]  # compressed
    diff_ids: list[str]
    manifest: bytes

    @property
    def digest(self) -> str:
        return sha(self.manifest)

    def blobs(self) -> dict[str, bytes]:
        out = {sha(self.config): self.config, sha(self.manifest): self.manifest}
        out.update({sha(b): b for b in self.layers})
        return out


def make_image(layers: list[Files], *, config: Mapping[str, object] | None = None,
               arch: str = "amd64") -> Image:
    return image_of_tars([layer_tar(f) for f in layers], config=config, arch=arch)


def image_of_tars(tars: list[bytes], *, config: Mapping[str, object] | None = None,
                  arch: str = "amd64") -> Image:
    """An image of the layers ``tars`` (uncompressed tars, gzipped here)."""
    gz = [gzip.compress(t, mtime=0) for t in tars]
    cfg = json.dumps({
        "architecture": arch, "os": "linux", "created": "2026-12-05T00:00:00Z",
        "config": dict(config or {}),
        "rootfs": {"type": "layers", "diff_ids": [sha(t) for t in tars]},
        # One entry per layer, as every builder writes (buildah checks the two agree).
        "history": [{"created": "2026-12-05T00:00:00Z", "created_by": f"layer {i}"}
                    for i in range(len(tars))],
    }).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha(cfg), "size": len(cfg)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": sha(b), "size": len(b)} for b in gz],
    }).encode()
    return Image(cfg, gz, [sha(t) for t in tars], manifest)


def write_layout(root: Path, images: Mapping[str, Image]) -> Path:
    """An OCI layout at ``root`` holding ``images`` under their ref names."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    entries = []
    for ref, img in images.items():
        for digest, data in img.blobs().items():
            (blobs / digest[7:]).write_bytes(data)
        entries.append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": img.digest, "size": len(img.manifest),
                        "annotations": {"org.opencontainers.image.ref.name": ref}})
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": entries}))
    return root


def tar_dir(src: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as tar:
        for p in sorted(src.rglob("*")):
            tar.add(p, arcname=str(p.relative_to(src)), recursive=False)
    return dest


def write_docker_archive(dest: Path, img: Image, tag: str) -> Path:
    """What `docker save` writes for ``img`` (layers uncompressed, named by diff id)."""
    with tarfile.open(dest, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add("config.json", img.config)
        names = []
        for i, gz in enumerate(img.layers):
            names.append(f"layer{i}/layer.tar")
            add(names[-1], gzip.decompress(gz))
        add("manifest.json", json.dumps(
            [{"Config": "config.json", "RepoTags": [tag], "Layers": names}]).encode())
    return dest


def push(base: str, repo: str, tag: str, img: Image,
         auth: tuple[str, str] | None = None) -> None:
    """Push ``img`` to a registry at ``base`` (http://host:port) as ``repo:tag``."""
    with httpx.Client(base_url=base, auth=auth, timeout=30) as c:
        for digest, data in img.blobs().items():
            if digest == img.digest:
                continue
            r = c.post(f"/v2/{repo}/blobs/uploads/")
            r.raise_for_status()
            loc = r.headers["location"]
            sep = "&" if "?" in loc else "?"  # keep the upload's own _state parameters
            c.put(f"{loc}{sep}digest={digest}", content=data,
                  headers={"Content-Type": "application/octet-stream"}).raise_for_status()
        c.put(f"/v2/{repo}/manifests/{tag}", content=img.manifest, headers={
            "Content-Type": "application/vnd.oci.image.manifest.v1+json"}).raise_for_status()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def registry(tmp: Path, htpasswd: Path | None = None) -> Iterator[str]:
    """Debian's docker-registry on a loopback port; yields its http://127.0.0.1:PORT."""
    binary = shutil.which("docker-registry")
    if binary is None:
        raise RuntimeError("docker-registry is not installed: scripts/setup-host.sh "
                           "server,dev installs it")
    port = _free_port()
    auth = (f"auth:\n  htpasswd:\n    realm: boxd-test\n    path: {htpasswd}\n"
            if htpasswd else "")
    conf = tmp / "registry.yml"
    conf.write_text(
        f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {tmp / 'registry'}\nhttp:\n  addr: 127.0.0.1:{port}\n{auth}")
    proc = subprocess.Popen([binary, "serve", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(f"{base}/v2/", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("docker-registry did not start") from None
                time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def entries_tar(rows: list[dict[str, object]]) -> bytes:
    """A layer from rows, in order: ``{"path", "kind", ...}`` with kind ``file`` (``data``),
    ``dir``, ``symlink`` / ``hardlink`` (``target``), ``fifo``; optional ``mode``,
    ``uid``, ``gid``, ``mtime``, ``xattrs`` (name -> bytes, as PAX ``SCHILY.xattr.``
    records, as docker writes them). Whiteouts are files named ``.wh.NAME`` (``.wh..wh..opq``:
    an opaque directory)."""
    kinds = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
             "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}
    modes = {"file": 0o644, "dir": 0o755, "symlink": 0o777, "hardlink": 0o644, "fifo": 0o644}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for row in rows:
            kind = str(row.get("kind", "file"))
            info = tarfile.TarInfo(str(row["path"]))
            info.type = kinds[kind]
            info.mode = int(row.get("mode", modes[kind]))  # type: ignore[call-overload]
            info.uid = int(row.get("uid", 0))  # type: ignore[call-overload]
            info.gid = int(row.get("gid", 0))  # type: ignore[call-overload]
            info.mtime = int(row.get("mtime", 1_700_000_000))  # type: ignore[call-overload]
            if kind in ("symlink", "hardlink"):
                info.linkname = str(row["target"])
            xattrs: dict[str, bytes] = row.get("xattrs", {})  # type: ignore[assignment]
            info.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape")
                                for k, v in xattrs.items()}
            data = bytes(row.get("data", b""))  # type: ignore[arg-type]
            info.size = len(data) if kind == "file" else 0
            tar.addfile(info, io.BytesIO(data) if kind == "file" else None)
    return buf.getvalue()
