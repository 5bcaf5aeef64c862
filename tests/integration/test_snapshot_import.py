"""Importing a snapshot proves possession of all its bytes, through the real API."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import httpx
import pytest

from boxd import Boxd, errors

pytestmark = pytest.mark.vm


def _rewrite(src: Path, dest: Path, *, blobs: bool, flip: bool = False) -> Path:
    """Copy an export with only its manifest (``blobs=False``), or with every blob's
    middle byte flipped."""
    with tarfile.open(src) as tin, tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tout:
        for i, member in enumerate(tin.getmembers()):
            if i > 0 and not blobs:
                break
            f = tin.extractfile(member)
            data = bytearray(f.read() if f is not None else b"")
            if i > 0 and flip:
                data[len(data) // 2] ^= 0xFF
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            tout.addfile(info, io.BytesIO(bytes(data)))
    return dest


def test_import_needs_every_blob_and_corruption_is_a_4xx(  # type: ignore[no-untyped-def]
    daemon, client, machine, tmp_path
) -> None:
    snap = client.snapshots.save(machine.id, "tenant-a-env")
    export = client.snapshots.export(snap.id, tmp_path / "a.boxd")
    claim = _rewrite(export, tmp_path / "claim.boxd", blobs=False)
    flipped = _rewrite(export, tmp_path / "flipped.boxd", blobs=True, flip=True)
    other = client.keys.create("tenant-b", account="tenant-b-import")
    try:
        with Boxd(api_key=other.secret) as b:
            # Another account holding only the manifest gets nothing, and learns nothing:
            # the answer is the one a store without the snapshot gives.
            with pytest.raises(errors.CorruptData) as info:
                b.snapshots.import_(claim, name="stolen")
            assert "blobs its manifest names are not in it" in info.value.message
            assert b.snapshots.list() == []
            with pytest.raises(errors.CorruptData) as info:
                b.snapshots.import_(flipped, name="stolen")
            assert "does not match its digest" in info.value.message
            assert str(daemon.home) not in str(info.value) and "/dev/shm" not in str(info.value)
            assert b.snapshots.list() == []
            # the owner's own manifest-only file fails the same way
            with pytest.raises(errors.CorruptData):
                client.snapshots.import_(claim, name="again")
            # a 4xx naming the field, and no daemon path in the body
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)),
                              timeout=120) as http:
                raw = http.post(
                    "http://boxd/v1/snapshots/import", content=claim.read_bytes(),
                    headers={"Authorization": f"Bearer {other.secret}"},
                )
            assert raw.status_code == 400, raw.text
            body = raw.json()["error"]
            assert body["code"] == "corrupt_data" and body["details"]["field"] == "file"
            assert str(daemon.home) not in raw.text and "/dev/shm" not in raw.text
            # the whole file imports into the other account
            got = b.snapshots.import_(export, name="shared-env")
            assert got.digest == snap.digest and [s.name for s in b.snapshots.list()] == [
                "shared-env"]
            b.snapshots.delete(got.id)
            b.keys.revoke(other.id)
    finally:
        client.snapshots.delete(snap.id)
