"""A Python base image made offline, for the tests that build Python images with
``boxd image build``: boxd's own guest root (Debian's minbase with python3, pip and
venv, made by mmdebstrap from the host's apt sources) written as a one-layer OCI layout.

It stands in for ``python:3.11-slim``, which a user imports from a registry
(``boxd image import docker://HOST/library/python:3.11-slim python:3.11-slim``): the
same Python version, with ``python3`` and ``pip`` on PATH (in /usr/bin here, in
/usr/local/bin there), so a Dockerfile that says ``python3`` builds on either. The
layout is cached under ``.cache/`` by guest image key (writing it tars ~230 MB).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from tests._support.daemon import IMAGE_CACHE, REPO

LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar"
#: The tree's own marker (boxd.images._tree): not a file of the image.
_MARKER = ".boxd-complete"


def python_base_layout() -> Path:
    """An OCI layout (``oci:DIR``, its only image) of boxd's default guest root, made
    once per guest image key."""
    from boxd.config import Paths
    from boxd.images import Recipe, ensure_image, rootfs_tree

    os.environ.setdefault("BOXD_IMAGE_CACHE", str(IMAGE_CACHE))
    image = ensure_image(Paths(REPO / ".cache" / "py-base-home"), Recipe())
    tree = rootfs_tree(image.rootfs)
    dest = REPO / ".cache" / f"oci-python-base-{image.key}"
    if (dest / "index.json").exists():
        return dest
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    blobs = tmp / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    layer = tmp / "layer.tar"
    subprocess.run(["tar", "--sort=name", "--numeric-owner", "--mtime=@1700000000",
                    f"--exclude=./{_MARKER}", "-C", str(tree), "-cf", str(layer), "."],
                   check=True)
    digest = _sha256(layer)
    size = layer.stat().st_size
    layer.rename(blobs / digest)
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": "2026-12-05T00:00:00Z",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                           "/sbin:/bin", "LANG=C.UTF-8"], "Cmd": ["python3"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{digest}"]},
        "history": [{"created": "2026-12-05T00:00:00Z", "created_by": "boxd guest root"}],
    }).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _put(blobs, config), "size": len(config)},
        "layers": [{"mediaType": LAYER_MEDIA, "digest": f"sha256:{digest}", "size": size}],
    }).encode()
    (tmp / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (tmp / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": _put(blobs, manifest), "size": len(manifest)}]}))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _put(blobs: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
