"""Which container images the control plane's machines and snapshots still run: what a
collection of unpacked images (`boxd.images._collect`) and of image blobs must keep
after the images' names are removed."""

from __future__ import annotations

from boxd.errors import IntegrityError
from boxd.state import Repos
from boxd.storage import SnapshotStore


def images_in_use(repos: Repos, store: SnapshotStore) -> set[str]:
    """The manifest digests of the images every machine record and every stored
    snapshot runs.

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


__all__ = ["images_in_use"]
