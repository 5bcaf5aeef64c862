"""A snapshot import bounds what it parses before parsing it (hardening round 3, the
critical defect): hostile tar files are refused fast, in little memory, whatever Python
the daemon runs on (tarfile's PAX parser is quadratic on 3.11.7, CVE-2024-6232)."""

from __future__ import annotations

import gzip
import hashlib
import json
import tarfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from boxd.errors import CorruptData, InvalidRequest
from boxd.storage import SnapshotStore, snapshots

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "store")


def _header(name: str, size: int, flag: bytes = b"0", linkname: str = "") -> bytes:
    """A POSIX (ustar) header, built by hand so any claim can be made."""
    info = tarfile.TarInfo(name)
    info.size = size if size < 8 << 30 else 0
    info.type = flag
    info.linkname = linkname
    info.mode, info.mtime, info.uname, info.gname = 0o444, 0, "", ""
    block = bytearray(info.tobuf(tarfile.USTAR_FORMAT))
    assert len(block) == 512
    if size >= 8 << 30:  # out of reach of tarfile's checks: write the octal field directly
        block[124:136] = f"{size:012o}".encode()
        block[148:156] = b" " * 8
        block[148:156] = f"{sum(block):06o}\0 ".encode()
    return bytes(block)


def _pax(records: bytes, claimed: int | None = None) -> bytes:
    size = len(records) if claimed is None else claimed
    return _header("././@PaxHeader", size, b"x") + records + bytes(-len(records) % 512)


def _record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def _manifest(blobs: dict[str, tuple[str, int]], **extra: object) -> tuple[bytes, str]:
    doc = {"format": 1, "meta": {"name": "env"},
           "blobs": {k: {"digest": d, "size": s} for k, (d, s) in blobs.items()}, **extra}
    raw = snapshots._canonical(doc)
    return raw, hashlib.sha256(raw).hexdigest()


def _member(name: str, data: bytes) -> bytes:
    return _header(name, len(data)) + data + bytes(-len(data) % 512)


def _end() -> bytes:
    return bytes(1024)


def _with_manifest(raw: bytes, digest: str, *rest: bytes) -> bytes:
    return _member(f"manifests/{digest}.json", raw) + b"".join(rest)


def _one_blob(size: int) -> tuple[bytes, str, str]:
    blob = "ab" * 32
    raw, digest = _manifest({"memory": (blob, size)})
    return raw, digest, blob


def _import(store: SnapshotStore, tmp_path: Path, data: bytes, *, gz: bool = False,
            name: str = "x.boxd") -> None:
    path = tmp_path / name
    path.write_bytes(gzip.compress(data, 1) if gz else data)
    store.import_(path)


def _clean(store: SnapshotStore) -> None:
    assert store.list() == []
    assert list(store.blobs_dir.iterdir()) == []
    assert list(store.staging_dir.iterdir()) == []


@pytest.fixture
def peak() -> Iterator[Callable[[], int]]:
    """Peak bytes allocated by Python since the test began (tracemalloc)."""
    tracemalloc.start()
    yield lambda: tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()


def test_a_pax_header_of_digits_is_refused_at_once(store: SnapshotStore, tmp_path: Path) -> None:
    """CVE-2024-6232: 200 KB of digits held tarfile (and the GIL) for ~60 s."""
    raw, digest, _ = _one_blob(512)
    data = _pax(b"1" * 200_000) + _header("x", 0) + _end()
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="extended header of 200000 bytes") as info:
        _import(store, tmp_path, _with_manifest(raw, digest, data))
    assert time.monotonic() - started < 2
    assert info.value.details["field"] == "file"
    # the manifest's own header too
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="extended header"):
        _import(store, tmp_path, _pax(b"1" * 200_000) + _with_manifest(raw, digest, _end()))
    assert time.monotonic() - started < 2
    # and within the cap, digits are a malformed record, parsed in one linear pass
    with pytest.raises(InvalidRequest, match="malformed extended header"):
        _import(store, tmp_path, _pax(b"1" * 60_000) + _with_manifest(raw, digest, _end()))
    _clean(store)


def test_a_huge_pax_header_in_a_small_gzip_is_not_read(
    store: SnapshotStore, tmp_path: Path, peak: Callable[[], int]
) -> None:
    """A 2 MB gzip body with a 2 GiB PAX header raised the daemon's RSS by 2 GiB."""
    raw, digest, _ = _one_blob(512)
    path = tmp_path / "big-pax.boxd.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(_with_manifest(raw, digest))
        f.write(_header("././@PaxHeader", 2 * GiB, b"x"))
        for _ in range(64):  # 64 MiB of the claimed 2 GiB: the file is ~64 KB
            f.write(b"9" * MiB)
    assert path.stat().st_size < 2 * MiB
    before = peak()
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="extended header of 2147483648 bytes"):
        store.import_(path)
    assert time.monotonic() - started < 2
    assert peak() - before < 50 * MiB
    _clean(store)


def _sparse_member(blob: str, realsize: int, sparse_map: bytes, data_len: int) -> bytes:
    pad = bytes(-len(sparse_map) % 512)
    pax = b"".join(_record(k, v) for k, v in (
        ("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"),
        ("GNU.sparse.name", f"blobs/sha256/{blob}"), ("GNU.sparse.realsize", str(realsize))))
    return _pax(pax) + _header(f"blobs/sha256/GNUSparseFile.0/{blob}",
                               len(sparse_map) + len(pad) + data_len) + sparse_map + pad


def test_a_large_sparse_map_is_bounded(
    store: SnapshotStore, tmp_path: Path, peak: Callable[[], int]
) -> None:
    """A 19.6 KB gzip body's GNU sparse map raised the daemon's RSS by 425 MiB."""
    size = 16 * GiB
    raw, digest, blob = _one_blob(size)
    # a map claiming 10 million entries: refused on its count, before any entry is read
    huge = b"10000000\n" + b"0\n1\n" * 5_000_000
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="bad sparse map"):
        _import(store, tmp_path, _with_manifest(
            raw, digest, _sparse_member(blob, size, huge, 10_000_000), _end()), gz=True)
    assert time.monotonic() - started < 2
    # entries that cannot be (all at offset 0: overlapping) end the map at the second
    before = peak()
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="bad sparse map"):
        _import(store, tmp_path, _with_manifest(
            raw, digest, _sparse_member(blob, size, b"4000000\n" + b"0\n1\n" * 4_000_000,
                                        4_000_000), _end()), gz=True)
    assert time.monotonic() - started < 2
    assert peak() - before < 50 * MiB
    # a map claiming more data than the file holds
    with pytest.raises(InvalidRequest, match="truncated"):
        _import(store, tmp_path, _with_manifest(
            raw, digest, _sparse_member(blob, size, b"1\n0\n1000000000\n", 1 << 30), _end()))
    _clean(store)


def test_a_small_file_claiming_a_huge_blob_is_refused_quickly(
    store: SnapshotStore, tmp_path: Path
) -> None:
    """A 4 KB body claiming a 10 GiB blob cost 6.9 s of daemon CPU."""
    raw, digest, blob = _one_blob(10 * GiB)
    # as a regular member: more than the file can hold
    data = _with_manifest(raw, digest, _header(f"blobs/sha256/{blob}", 10 * GiB), _end())
    assert len(data) < 4096
    for gz in (False, True):
        started = time.monotonic()
        with pytest.raises(InvalidRequest, match="truncated"):
            _import(store, tmp_path, data, gz=gz)
        assert time.monotonic() - started < 1
    # as a sparse member (holes cost only hashing their zeros, ~0.7 s a GiB): the
    # manifest may not claim more than any blob boxd makes (the old reader hashed 1 TiB)
    raw, digest, blob = _one_blob(1 << 40)
    data = _with_manifest(raw, digest, _sparse_member(blob, 1 << 40, b"1\n0\n512\n", 512),
                          bytes(512), _end())
    assert len(data) < 5000
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="1099511627776-byte memory blob"):
        _import(store, tmp_path, data)
    assert time.monotonic() - started < 1
    # nor, in all, more than one such blob
    raw, digest = _manifest({f"k{i}": (f"{i:064x}", 400 * GiB) for i in range(64)})
    with pytest.raises(InvalidRequest, match="bytes of blobs"):
        _import(store, tmp_path, _with_manifest(raw, digest, _end()))
    _clean(store)


@pytest.mark.parametrize(("flag", "what"), [
    (b"2", "symlink"), (b"1", "hard link"), (b"L", "GNU long name"), (b"5", "directory"),
    (b"g", "global header"), (b"S", "GNU sparse file"), (b"3", "character device"),
])
def test_member_types_boxd_never_writes_are_refused(
    store: SnapshotStore, tmp_path: Path, flag: bytes, what: str
) -> None:
    raw, digest, blob = _one_blob(512)
    payload = b"x" * 100 if flag in (b"L", b"g") else b""
    odd = _header(f"blobs/sha256/{blob}", len(payload), flag, linkname="/etc/passwd" if flag in (
        b"1", b"2") else "") + payload + bytes(-len(payload) % 512)
    with pytest.raises(InvalidRequest, match=what):
        _import(store, tmp_path, _with_manifest(raw, digest, odd, _end()))
    # the first member too
    with pytest.raises(InvalidRequest, match=what):
        _import(store, tmp_path, odd + _with_manifest(raw, digest, _end()))
    _clean(store)


def test_pax_keys_boxd_never_writes_are_refused(store: SnapshotStore, tmp_path: Path) -> None:
    raw, digest, blob = _one_blob(512)
    for key in ("linkpath", "GNU.sparse.map", "SCHILY.xattr.user.x", "hdrcharset"):
        with pytest.raises(InvalidRequest, match="key boxd does not write"):
            _import(store, tmp_path, _with_manifest(
                raw, digest, _pax(_record(key, "0")), _member(f"blobs/sha256/{blob}",
                                                               bytes(512)), _end()))
    with pytest.raises(InvalidRequest, match="malformed"):  # a key twice
        _import(store, tmp_path, _with_manifest(
            raw, digest, _pax(_record("size", "512") * 2),
            _member(f"blobs/sha256/{blob}", bytes(512)), _end()))
    _clean(store)


def test_members_beyond_the_manifests_blobs_are_refused(
    store: SnapshotStore, tmp_path: Path
) -> None:
    data = b"boxd" * 128
    blob = hashlib.sha256(data).hexdigest()
    raw, digest = _manifest({"memory": (blob, len(data))})
    member = _member(f"blobs/sha256/{blob}", data)
    extra = _member("blobs/sha256/" + "cd" * 32, data)
    with pytest.raises(InvalidRequest, match="unexpected blob"):
        _import(store, tmp_path, _with_manifest(raw, digest, member, member, _end()))
    with pytest.raises(InvalidRequest, match="unexpected blob"):
        _import(store, tmp_path, _with_manifest(raw, digest, member, extra, _end()))
    with pytest.raises(InvalidRequest, match="unexpected member"):
        _import(store, tmp_path, _with_manifest(raw, digest, member, _member("x", b""), _end()))
    # a manifest naming thousands of blobs is refused before any member is read
    many = {f"k{i}": (f"{i:064x}", 1) for i in range(10_000)}
    raw2, digest2 = _manifest(many)
    with pytest.raises(InvalidRequest, match="naming 10000 blobs"):
        _import(store, tmp_path, _with_manifest(raw2, digest2, _end()))
    raw3, digest3 = _manifest({"memory": (blob, len(data)), "disk": (blob, 2 * len(data))})
    with pytest.raises(InvalidRequest, match="two sizes"):
        _import(store, tmp_path, _with_manifest(raw3, digest3, member, _end()))
    _clean(store)
    # and the well-formed file imports
    _import(store, tmp_path, _with_manifest(raw, digest, member, _end()))
    assert [m.digest for m in store.list()] == [digest]


def test_a_deeply_nested_manifest_is_invalid_not_500(store: SnapshotStore, tmp_path: Path) -> None:
    raw = b'{"format":1,"blobs":{},"meta":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    digest = hashlib.sha256(raw).hexdigest()
    with pytest.raises(InvalidRequest, match="nested too deeply") as info:
        _import(store, tmp_path, _with_manifest(raw, digest, _end()))
    assert type(info.value) is InvalidRequest
    data = b"x" * 512
    blob = hashlib.sha256(data).hexdigest()
    meta: object = "leaf"
    for _ in range(100):
        meta = {"a": meta}
    raw = json.dumps({"format": 1, "blobs": {"memory": {"digest": blob, "size": 512}},
                      "meta": meta}).encode()
    digest = hashlib.sha256(raw).hexdigest()
    with pytest.raises(InvalidRequest, match="nests deeper"):
        _import(store, tmp_path, _with_manifest(raw, digest, _member(f"blobs/sha256/{blob}",
                                                                      data), _end()))
    _clean(store)


def test_a_manifest_naming_no_blobs_is_not_a_snapshot(
    store: SnapshotStore, tmp_path: Path
) -> None:
    raw, digest = _manifest({})
    with pytest.raises(InvalidRequest, match="naming no blobs") as info:
        _import(store, tmp_path, _with_manifest(raw, digest, _end()))
    assert not isinstance(info.value, CorruptData)
    _clean(store)


def test_headers_are_checked(store: SnapshotStore, tmp_path: Path) -> None:
    raw, digest, _ = _one_blob(512)
    good = _with_manifest(raw, digest, _end())
    bad = bytearray(good)
    bad[0] ^= 1  # the name, under the checksum
    with pytest.raises(InvalidRequest, match="checksum"):
        _import(store, tmp_path, bytes(bad))
    with pytest.raises(InvalidRequest, match="truncated"):  # no end-of-archive marker
        _import(store, tmp_path, good[:-1024])
    with pytest.raises(InvalidRequest, match="not a complete"):  # a cut gzip stream
        path = tmp_path / "cut.gz"
        path.write_bytes(gzip.compress(good)[:-30])
        store.import_(path)
    _clean(store)


def test_a_sparse_round_trip_through_the_strict_reader(
    store: SnapshotStore, tmp_path: Path
) -> None:
    """What export writes imports (plain and gzip), holes staying holes."""
    src = tmp_path / "ram"
    with open(src, "wb") as f:
        f.truncate(64 * MiB)
        for off in (0, 5 * MiB, 33 * MiB + 4096, 64 * MiB - 4096):
            f.seek(off)
            f.write(bytes(range(256)) * 16)
    (tmp_path / "state").write_bytes(b"state" * 1000)
    (tmp_path / "empty").write_bytes(b"")
    with store.stage() as st:
        st.add_blob("memory", src)
        st.add_blob("state", tmp_path / "state")
        st.add_blob("disk", tmp_path / "empty")
        m = st.commit({"name": "env"})
    for compress in (False, True):
        out = store.export(m.digest, tmp_path / f"e{compress}.boxd", compress=compress)
        other = SnapshotStore(tmp_path / f"other{compress}")
        assert other.import_(out) == m
        other.verify(m.digest)
        assert m.blob_path("memory").stat().st_blocks * 512 < 2 * MiB
        got = other.get(m.digest).blob_path("memory")
        assert got.stat().st_blocks * 512 < 2 * MiB
    # tarfile reads our export the same way (the format did not change)
    with tarfile.open(tmp_path / "eFalse.boxd") as tf:
        assert tf.getmembers()[0].name == f"manifests/{m.digest}.json"


def test_an_import_runs_beside_the_event_loop(tmp_path: Path) -> None:
    """The daemon answers while an import is parsed (the PAX freeze held every thread)."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient
    from tests._support.api_fakes import FakeMachines, host_info

    from boxd.api import create_app
    from boxd.api.services.keys import KeyService
    from boxd.control.plane import Snapshots
    from boxd.state import Database

    store = SnapshotStore(tmp_path / "store")
    db = Database(tmp_path / "state.db")
    keys = KeyService(db)
    service = Snapshots(SimpleNamespace(repos=None, cluster=None), store)  # type: ignore[arg-type]
    app = create_app(machines=FakeMachines(), snapshots=service, keys=keys,
                     host_info=host_info, upload_dir=tmp_path / "uploads")
    secret = keys.create(keys.ensure_local_account(), "t").secret
    # a well-formed file whose blob is 4 GiB of holes and a wrong digest: seconds of hashing
    raw, digest, blob = _one_blob(4 * GiB)
    slow = _with_manifest(raw, digest, _sparse_member(blob, 4 * GiB, b"1\n0\n512\n", 512),
                          b"z" * 512, _end())
    # and the quadratic PAX header (the old parser froze every thread on it for ~60 s)
    pax = _with_manifest(raw, digest, _pax(b"1" * 200_000), _end())
    client = TestClient(app, raise_server_exceptions=False)
    client.headers["Authorization"] = f"Bearer {secret}"
    try:
        for body in (slow, pax):
            answers: list[int] = []

            def post(data: bytes = body, answers: list[int] = answers) -> None:
                answers.append(client.post("/v1/snapshots/import", content=data).status_code)

            t = threading.Thread(target=post)
            began = time.monotonic()
            t.start()
            latencies = []
            while t.is_alive():
                started = time.monotonic()
                assert client.get("/v1/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.05)
            t.join()
            took = time.monotonic() - began
            assert answers == [400]
            # A loop held by the import answers nothing until it ends (one answer as
            # slow as the import itself); beside it, every answer is a small part of
            # the import's time. Relative, so a loaded host (the import and the health
            # checks both slower) does not fail it; 0.5 s absolute did.
            assert max(latencies, default=0) < max(0.5, took / 4), (took, latencies)
    finally:
        client.close()
        db.close()
