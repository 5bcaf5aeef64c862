"""The content-addressed snapshot store, on real files in tmp_path (no VMs)."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from boxd.errors import (
    CorruptData,
    IntegrityError,
    InvalidRequest,
    ResourceExhausted,
    SnapshotNotFound,
)
from boxd.storage import Manifest, SnapshotStore, _files, snapshots

MiB = 1 << 20


def make_sparse(path: Path, size: int, chunks: dict[int, bytes]) -> Path:
    """A sparse file of ``size`` with ``chunks`` written at their offsets."""
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in chunks.items():
            f.seek(off)
            f.write(data)
    return path


def logical_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(MiB):
            h.update(b)
    return h.hexdigest()


def save(store: SnapshotStore, files: dict[str, Path], **meta: object) -> Manifest:
    with store.stage() as st:
        for kind, path in files.items():
            st.add_blob(kind, path)
        return st.commit({"name": "env", "version": 1, **meta})


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "store")


@pytest.fixture
def machine_files(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "src"
    src.mkdir()
    return {
        "memory": make_sparse(src / "ram", 64 * MiB, {
            0: os.urandom(MiB), 10 * MiB: os.urandom(3 * MiB), 63 * MiB: b"end",
            # written zeros: should become a hole in the store
            20 * MiB: bytes(2 * MiB),
        }),
        "state": make_sparse(src / "state", 5000, {0: os.urandom(5000)}),
        "disk": make_sparse(src / "disk.qcow2", 8 * MiB, {0: os.urandom(MiB)}),
    }


def test_sparse_file_stays_sparse_and_digest_is_logical_sha256(
    store: SnapshotStore, machine_files: dict[str, Path]
) -> None:
    ram = machine_files["memory"]
    with store.stage() as st:
        ref = st.add_blob("memory", ram)
        m = st.commit({"name": "env"})
    assert ref.digest == logical_sha256(ram)
    assert ref.size == 64 * MiB
    stored = m.blob_path("memory")
    assert stored.stat().st_size == 64 * MiB
    # 1 + 3 MiB random + "end": the 2 MiB of written zeros became a hole too.
    assert stored.stat().st_blocks * 512 < 6 * MiB
    assert ref.stored == stored.stat().st_blocks * 512
    assert logical_sha256(stored) == ref.digest
    assert stored.stat().st_mode & 0o777 == (0o440 if store.group is not None else 0o400)


def test_manifest_is_canonical_and_named_by_its_hash(
    store: SnapshotStore, machine_files: dict[str, Path]
) -> None:
    m = save(store, machine_files, created_at=1.5, cpu_model="max")
    path = store.manifest_path(m.digest)
    raw = path.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == m.digest
    assert b" " not in raw and b"\n" not in raw
    assert set(m.blobs) == {"memory", "state", "disk"}
    assert m.meta["cpu_model"] == "max"
    assert store.get(m.digest) == m
    assert store.exists(m.digest)
    assert [x.digest for x in store.list()] == [m.digest]
    with pytest.raises(SnapshotNotFound):
        store.get("0" * 64)
    with pytest.raises(InvalidRequest):
        store.get("../../etc/passwd")


def test_move_takes_the_file(store: SnapshotStore, tmp_path: Path) -> None:
    src = make_sparse(tmp_path / "ram", 4 * MiB, {MiB: b"x" * 4096})
    digest = logical_sha256(src)
    with store.stage() as st:
        ref = st.add_blob("memory", src, move=True)
        m = st.commit({})
    assert not src.exists()
    assert ref.digest == digest
    assert logical_sha256(m.blob_path("memory")) == digest


def test_dedup_between_snapshots(store: SnapshotStore, machine_files: dict[str, Path]) -> None:
    a = save(store, machine_files, version=1)
    disk_inode = a.blob_path("disk").stat().st_ino
    make_sparse(machine_files["memory"], 64 * MiB, {5 * MiB: b"changed"})
    b = save(store, machine_files, version=2)
    assert a.digest != b.digest
    assert a.blobs["disk"] == b.blobs["disk"]
    assert a.blobs["memory"] != b.blobs["memory"]
    assert b.blob_path("disk").stat().st_ino == disk_inode
    assert len(list(store.blobs_dir.iterdir())) == 4  # 2 memory + shared state + disk
    assert len(list(store.staging_dir.iterdir())) == 0


def test_delete_frees_only_unshared_blobs_and_respects_in_use(
    store: SnapshotStore, machine_files: dict[str, Path]
) -> None:
    a = save(store, machine_files, version=1)
    make_sparse(machine_files["memory"], 64 * MiB, {5 * MiB: b"changed"})
    b = save(store, machine_files, version=2)
    removed = store.delete(a.digest)
    assert removed == [a.blobs["memory"].digest]
    assert not store.exists(a.digest)
    assert b.blob_path("disk").exists() and b.blob_path("memory").exists()
    # A running machine maps b's memory: deleting b keeps that blob; gc keeps it pinned.
    pinned = {b.blobs["memory"].digest}
    store.delete(b.digest, in_use=lambda: pinned)
    assert b.blob_path("memory").exists()
    assert not b.blob_path("disk").exists()
    assert store.gc(in_use=lambda: pinned).blobs == 0
    assert store.gc().blobs == 1
    assert list(store.blobs_dir.iterdir()) == []
    with pytest.raises(SnapshotNotFound):
        store.delete(b.digest)


def test_interrupted_save_leaves_no_manifest_and_gc_cleans(
    store: SnapshotStore, machine_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RuntimeError), store.stage() as st:
        st.add_blob("memory", machine_files["memory"])
        raise RuntimeError("engine died")
    assert store.list() == []
    assert list(store.staging_dir.iterdir()) == []

    # A crash between moving blobs and renaming the manifest: blobs are orphans.
    real_replace = os.replace

    def crash_on_manifest(src: object, dst: object) -> None:
        if str(dst).endswith(".json"):
            raise KeyboardInterrupt
        real_replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", crash_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        save(store, machine_files)
    monkeypatch.undo()
    assert store.list() == []
    assert len(list(store.blobs_dir.iterdir())) == 3
    # A staging directory left by a killed process (no lock held) is removed too.
    (store.staging_dir / "deadbeef").mkdir()
    (store.staging_dir / "deadbeef" / "blob-memory").write_bytes(b"x")
    report = store.gc()
    assert report.blobs == 3 and report.staging_dirs == 1
    assert list(store.blobs_dir.iterdir()) == []
    assert list(store.staging_dir.iterdir()) == []


def test_gc_skips_live_staging(store: SnapshotStore, machine_files: dict[str, Path]) -> None:
    with store.stage() as st:
        st.add_blob("state", machine_files["state"])
        assert store.gc().staging_dirs == 0
        m = st.commit({})
    assert store.exists(m.digest)


def test_verify_detects_a_flipped_byte(
    store: SnapshotStore, machine_files: dict[str, Path]
) -> None:
    m = save(store, machine_files)
    store.verify(m.digest)
    path = m.blob_path("memory")
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(10 * MiB + 7)
        byte = f.read(1)
        f.seek(10 * MiB + 7)
        f.write(bytes([byte[0] ^ 1]))
    store.verify(m.digest, kinds=["disk", "state"])
    with pytest.raises(IntegrityError) as exc_info:
        store.verify(m.digest)
    err = exc_info.value
    assert err.path == str(path)  # type: ignore[attr-defined]
    assert err.digest == m.digest  # type: ignore[attr-defined]
    assert "save it again" in err.hint


def test_verify_detects_a_corrupt_manifest(
    store: SnapshotStore, machine_files: dict[str, Path]
) -> None:
    m = save(store, machine_files)
    p = store.manifest_path(m.digest)
    os.chmod(p, 0o644)
    p.write_bytes(p.read_bytes().replace(b'"env"', b'"enw"'))
    with pytest.raises(IntegrityError):
        store.verify(m.digest)
    # gc still protects the blobs a damaged manifest names
    assert store.gc().blobs == 0


def test_ensure_verified_caches_and_catches_later_changes(
    store: SnapshotStore, machine_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshots, "_RACY_WINDOW_NS", 20_000_000)
    m = save(store, machine_files)
    calls: list[Path] = []
    real_hash = _files.hash_file

    def counting(path: Path, progress: object = None) -> tuple[str, int]:
        calls.append(path)
        return real_hash(path)

    monkeypatch.setattr(_files, "hash_file", counting)
    import time

    time.sleep(0.05)  # past the racy window of the files' timestamps
    store.ensure_verified(m.digest)
    assert len(calls) == 3
    store.ensure_verified(m.digest)
    store.ensure_verified(m.digest)
    assert len(calls) == 3  # remembered
    path = m.blob_path("state")
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(IntegrityError):
        store.ensure_verified(m.digest)


def test_export_import_round_trip(
    store: SnapshotStore, machine_files: dict[str, Path], tmp_path: Path
) -> None:
    m = save(store, machine_files, created_at=123.0)
    seen: list[tuple[int, int]] = []
    out = store.export(m.digest, tmp_path / "env.boxd", progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1]
    # sparse in the archive too: 64 MiB of RAM, ~5 MiB of data
    assert out.stat().st_size < 12 * MiB
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    other = SnapshotStore(tmp_path / "other")
    m2 = other.import_(out)
    assert m2 == Manifest(m.digest, m.blobs, m.meta)
    assert m2.digest == m.digest
    other.verify(m2.digest)
    assert m2.blob_path("memory").stat().st_blocks * 512 < 6 * MiB
    assert other.import_(out).digest == m.digest  # twice: a no-op
    assert list(other.staging_dir.iterdir()) == []
    # and exports are deterministic
    assert store.export(m.digest, tmp_path / "again.boxd").read_bytes() == out.read_bytes()


def test_export_gzip_round_trip(
    store: SnapshotStore, machine_files: dict[str, Path], tmp_path: Path
) -> None:
    m = save(store, machine_files)
    out = store.export(m.digest, tmp_path / "env.boxd.gz", compress=True)
    assert SnapshotStore(tmp_path / "other").import_(out).digest == m.digest


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
def test_export_is_a_tar_gnu_tar_extracts(
    store: SnapshotStore, machine_files: dict[str, Path], tmp_path: Path
) -> None:
    m = save(store, machine_files)
    out = store.export(m.digest, tmp_path / "env.tar")
    dest = tmp_path / "x"
    dest.mkdir()
    subprocess.run(["tar", "-xSf", str(out), "-C", str(dest)], check=True)
    ram = dest / "blobs" / "sha256" / m.blobs["memory"].digest
    assert logical_sha256(ram) == m.blobs["memory"].digest
    assert (dest / "manifests" / f"{m.digest}.json").exists()


def test_truncated_or_corrupt_export_fails_cleanly(
    store: SnapshotStore, machine_files: dict[str, Path], tmp_path: Path
) -> None:
    m = save(store, machine_files)
    out = store.export(m.digest, tmp_path / "env.boxd")
    data = out.read_bytes()
    other = SnapshotStore(tmp_path / "other")
    for cut in (100, 3000, len(data) // 2, len(data) - 20000):
        bad = tmp_path / f"cut{cut}.boxd"
        bad.write_bytes(data[:cut])
        with pytest.raises(InvalidRequest):
            other.import_(bad)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # inside the RAM data
    (tmp_path / "flip.boxd").write_bytes(bytes(flipped))
    with pytest.raises(CorruptData):
        other.import_(tmp_path / "flip.boxd")
    (tmp_path / "junk").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(InvalidRequest):
        other.import_(tmp_path / "junk")
    assert other.list() == []
    assert list(other.blobs_dir.iterdir()) == []
    assert list(other.staging_dir.iterdir()) == []


def test_disk_full_is_resource_exhausted(
    store: SnapshotStore, machine_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(ResourceExhausted) as exc_info, store.stage() as st:
        st.add_blob("memory", machine_files["memory"])
    assert exc_info.value.hint
    monkeypatch.undo()
    assert list(store.staging_dir.iterdir()) == []


def test_bad_inputs(store: SnapshotStore, tmp_path: Path) -> None:
    with store.stage() as st:
        with pytest.raises(InvalidRequest):
            st.add_blob("memory", tmp_path / "missing")
        with pytest.raises(InvalidRequest):
            st.add_blob("Bad Kind", tmp_path)
        with pytest.raises(InvalidRequest):
            st.commit({})  # no blobs
        (tmp_path / "f").write_bytes(b"x")
        st.add_blob("state", tmp_path / "f")
        with pytest.raises(InvalidRequest):
            st.add_blob("state", tmp_path / "f")
        with pytest.raises(InvalidRequest):
            st.commit({"when": object()})


def test_store_is_private_to_the_daemon_and_qemus_group(
    tmp_path: Path, machine_files: dict[str, Path]
) -> None:
    """Blobs hold guest memory and disks: no other user may list or read them."""
    own = SnapshotStore(tmp_path / "own", group=None)
    m = save(own, machine_files)
    for d in (own.root, own.blobs_dir, own.manifests_dir, own.staging_dir, own.verified_dir):
        assert d.stat().st_mode & 0o777 == 0o700, d
    assert m.blob_path("memory").stat().st_mode & 0o777 == 0o400
    assert own.manifest_path(m.digest).stat().st_mode & 0o777 == 0o400
    gid = os.getgid()
    shared = SnapshotStore(tmp_path / "shared", group=gid)
    m = save(shared, machine_files)
    for d in (shared.root, shared.root / "blobs", shared.blobs_dir):
        st = d.stat()
        assert (st.st_mode & 0o777, st.st_gid) == (0o710, gid), d
    st = m.blob_path("state").stat()
    assert (st.st_mode & 0o777, st.st_gid) == (0o440, gid)
    assert shared.manifests_dir.stat().st_mode & 0o777 == 0o700


def _rewrite_export(src: Path, dest: Path, keep: int | None = None, flip: bool = False) -> Path:
    """Copy an export keeping its manifest and ``keep`` blob members (all if None);
    ``flip`` corrupts one data byte of every blob kept."""
    import io
    import tarfile

    with tarfile.open(src) as tin, tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tout:
        members = tin.getmembers()
        for i, member in enumerate(members):
            if i > 0 and keep is not None and i > keep:
                break
            f = tin.extractfile(member)
            data = bytearray(f.read() if f is not None else b"")
            if i > 0 and flip:
                data[len(data) // 2] ^= 0xFF
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            tout.addfile(info, io.BytesIO(bytes(data)))
    return dest


def test_a_manifest_alone_claims_nothing(
    store: SnapshotStore, machine_files: dict[str, Path], tmp_path: Path
) -> None:
    """Defect 3: the ~600-byte manifest of a stored snapshot must not import it."""
    m = save(store, machine_files)
    export = store.export(m.digest, tmp_path / "env.boxd")
    claim = _rewrite_export(export, tmp_path / "claim.boxd", keep=0)
    assert claim.stat().st_size < 20_000
    empty = SnapshotStore(tmp_path / "empty")
    answers = []
    for target in (store, empty):  # holds the snapshot / does not
        with pytest.raises(CorruptData) as info:
            target.import_(claim)
        answers.append((type(info.value), info.value.message, info.value.details))
    # the same answer either way: an import tells nothing about what the store holds
    assert answers[0] == answers[1]
    assert "3 of the 3 blobs" in answers[0][1]
    assert empty.list() == [] and list(empty.blobs_dir.iterdir()) == []


def test_import_reads_every_blob_even_when_stored(
    store: SnapshotStore, machine_files: dict[str, Path], tmp_path: Path
) -> None:
    m = save(store, machine_files)
    export = store.export(m.digest, tmp_path / "env.boxd")
    some = _rewrite_export(export, tmp_path / "some.boxd", keep=1)
    with pytest.raises(CorruptData, match="2 of the 3 blobs"):
        store.import_(some)
    flipped = _rewrite_export(export, tmp_path / "flip.boxd", flip=True)
    with pytest.raises(CorruptData, match="does not match its digest") as info:
        store.import_(flipped)
    assert str(tmp_path) not in str(info.value)
    assert store.import_(export).digest == m.digest  # the whole file still imports
    store.verify(m.digest)
    assert list(store.staging_dir.iterdir()) == []
