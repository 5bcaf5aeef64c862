"""Importing container images into the store: every transport, layers stored once,
digests verified, bad input refused with nothing left behind (issue 41, item 1).

The registry case runs a real registry (Debian's docker-registry) on loopback."""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import tarfile
import threading
from pathlib import Path

import pytest
from tests._support.oci import (
    Image,
    make_image,
    push,
    registry,
    sha,
    tar_dir,
    write_docker_archive,
    write_layout,
)

from boxd.errors import CorruptData, IntegrityError, InvalidRequest, NotFound
from boxd.images.oci import (
    docker_credentials,
    import_image,
    inspect_image,
    list_images,
    parse_name,
    parse_source,
    remove_image,
    unpack_image,
)
from boxd.storage.oci import ImageStore

BASE = {"bin/tool": b"#!/bin/sh\necho base\n", "etc/os": b"test\n"}
APP = {"app/main.py": b"print('hi')\n"}
CONFIG = {"Env": ["PATH=/usr/bin", "MODE=test"], "Entrypoint": ["/bin/tool"],
          "Cmd": ["serve"], "WorkingDir": "/app", "User": "1000:1000",
          "ExposedPorts": {"8000/tcp": {}}, "Labels": {"org.example": "yes"},
          "Healthcheck": {"Test": ["CMD", "/bin/tool", "health"]}}


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


def _blobs(store: ImageStore) -> set[str]:
    return {p.name for p in store.blobs.iterdir() if not p.name.startswith(".")}


def test_oci_dir_import_keeps_config_and_verifies(store: ImageStore, tmp_path: Path) -> None:
    img = make_image([BASE, APP], config=CONFIG)
    layout = write_layout(tmp_path / "layout", {"v1": img})
    info = import_image(store, f"oci:{layout}:v1", "envs/app:v1")
    assert info.name == "envs/app:v1"
    assert info.digest == img.digest
    assert [d.digest for d in info.layers] == [sha(b) for b in img.layers]
    c = info.config
    assert c.env == ("PATH=/usr/bin", "MODE=test") and c.entrypoint == ("/bin/tool",)
    assert c.cmd == ("serve",) and c.working_dir == "/app" and c.user == "1000:1000"
    assert c.exposed_ports == ("8000/tcp",) and c.labels == {"org.example": "yes"}
    assert c.healthcheck == ("CMD", "/bin/tool", "health")
    assert inspect_image(store, "envs/app:v1") == info
    # The store is itself an OCI layout that names the image: another tool can read it.
    index = json.loads((store.root / "index.json").read_text())
    assert index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == \
        "envs/app:v1"


def test_layers_shared_by_two_images_are_stored_once(store: ImageStore, tmp_path: Path) -> None:
    a = make_image([BASE, APP])
    b = make_image([BASE, {"other": b"x"}])
    import_image(store, f"oci:{write_layout(tmp_path / 'a', {'a': a})}", "a")
    before = _blobs(store)
    import_image(store, f"oci:{write_layout(tmp_path / 'b', {'b': b})}", "b")
    added = _blobs(store) - before
    # b's base layer is a's: only its own layer, config and manifest are new.
    assert added == {sha(x)[7:] for x in (b.layers[1], b.config, b.manifest)}
    # Removing a frees only what a alone held; b still reads whole.
    remove_image(store, "a")
    assert sha(a.layers[0])[7:] in _blobs(store)
    assert sha(a.layers[1])[7:] not in _blobs(store)
    assert inspect_image(store, "b:latest").digest == b.digest
    remove_image(store, "b")
    assert _blobs(store) == set()


def test_a_corrupt_layer_is_refused_and_names_nothing(store: ImageStore,
                                                      tmp_path: Path) -> None:
    img = make_image([BASE, APP])
    layout = write_layout(tmp_path / "layout", {"v1": img})
    bad = layout / "blobs" / "sha256" / sha(img.layers[1])[7:]
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="digest"):
        import_image(store, f"oci:{layout}", "broken")
    assert list_images(store) == []
    assert not any(p.name.startswith(".in-") for p in store.blobs.iterdir())
    store.collect()
    assert _blobs(store) == set()


def test_oci_archive_and_docker_archive(store: ImageStore, tmp_path: Path) -> None:
    img = make_image([BASE, APP], config=CONFIG)
    archive = tar_dir(write_layout(tmp_path / "layout", {"v2": img}), tmp_path / "img.tar")
    info = import_image(store, f"oci-archive:{archive}:v2", "from-archive:v2")
    assert info.digest == img.digest

    saved = write_docker_archive(tmp_path / "saved.tar", img, "app:v3")
    info = import_image(store, f"docker-archive:{saved}", "from-docker")
    # docker save keeps layers uncompressed: their digests are the diff ids.
    assert [d.digest for d in info.layers] == img.diff_ids
    assert info.config.cmd == ("serve",)
    with pytest.raises(NotFound, match="no image tagged"):
        import_image(store, f"docker-archive:{saved}:app:nope", "x")


def test_registry_import_shares_layers_and_pins_digests(store: ImageStore,
                                                        tmp_path: Path) -> None:
    img = make_image([BASE, APP], config=CONFIG)
    with registry(tmp_path) as base:
        push(base, "envs/app", "v1", img)
        host = base.removeprefix("http://")
        info = import_image(store, f"docker://{host}/envs/app:v1", "reg:v1", insecure=True)
        assert info.digest == img.digest
        pinned = import_image(store, f"docker://{host}/envs/app@{img.digest}", "reg:pinned",
                              insecure=True)
        assert pinned.digest == img.digest
        with pytest.raises(NotFound, match="does not exist"):
            import_image(store, f"docker://{host}/envs/app:nope", "x", insecure=True)
    assert {i.name for i in list_images(store)} == {"reg:v1", "reg:pinned"}


def test_concurrent_imports_and_removals_lose_no_name(store: ImageStore,
                                                      tmp_path: Path) -> None:
    layouts = []
    for i in range(6):
        img = make_image([BASE, {f"f{i}": bytes([i]) * 1000}])
        layouts.append(write_layout(tmp_path / f"l{i}", {"x": img}))
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            import_image(store, f"oci:{layouts[i]}", f"img{i}")
            if i % 2:
                remove_image(store, f"img{i}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {i.name for i in list_images(store)} == {"img0:latest", "img2:latest",
                                                    "img4:latest"}
    for i in (0, 2, 4):  # every kept image's blobs survived the others' collection
        info = inspect_image(store, f"img{i}")
        assert all(store.has(d.digest, d.size) for d in info.layers)


@pytest.mark.parametrize("text", ["", "UPPER", "a b", "x:", "-lead", "a//b", "n:" + "t" * 200])
def test_bad_names_are_refused(text: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_name(text)


def test_names_default_to_latest() -> None:
    assert parse_name("envs/cartpole") == "envs/cartpole:latest"
    assert parse_name("localhost/x:v1") == "localhost/x:v1"


@pytest.mark.parametrize("text,hint", [
    ("ftp:thing", "oci:DIR"), ("oci:", "oci:DIR"), ("docker://alpine", "registry host"),
    ("docker://alpine:3", "registry host"), ("docker://h.io/x@sha256:12", "sha256"),
])
def test_bad_sources_say_the_syntax(text: str, hint: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_source(text)
    assert hint in str(err.value) + err.value.hint


def test_sources_parse() -> None:
    s = parse_source("docker://localhost:5000/envs/app:v1")
    assert (s.host, s.repo, s.reference) == ("localhost:5000", "envs/app", "v1")
    s = parse_source("docker://reg.example/app")
    assert (s.repo, s.reference) == ("app", "latest")
    assert parse_source("oci:/x/y:tag").ref == "tag"
    assert parse_source("oci-archive:/x/y.tar").ref is None


def test_missing_sources_are_not_found(store: ImageStore, tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        import_image(store, f"oci:{tmp_path / 'none'}", "x")
    with pytest.raises(NotFound):
        import_image(store, f"oci-archive:{tmp_path / 'none.tar'}", "x")
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(CorruptData):
        import_image(store, f"docker-archive:{tmp_path / 'junk.tar'}", "x")
    with pytest.raises(NotFound):
        inspect_image(store, "nothing")


def test_docker_config_credentials(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    auth = base64.b64encode(b"me:secret").decode()
    cfg.write_text(json.dumps({"auths": {"https://reg.example:5000/v1/": {"auth": auth}}}))
    assert docker_credentials("reg.example:5000", cfg) == ("me", "secret")
    assert docker_credentials("other", cfg) is None


# --- root trees: layers applied in a chroot ----------------------------------------


def _tar_entries(entries: list[tuple[str, str, object]]) -> bytes:
    """A layer from (kind, path, data) rows: file (bytes), dir, symlink (target),
    hardlink (target), in order (whiteouts are files named .wh.*)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for kind, path, data in entries:
            info = tarfile.TarInfo(path)
            info.mtime = 1_700_000_000
            if kind == "file":
                assert isinstance(data, bytes)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
                continue
            if kind == "suid":
                assert isinstance(data, bytes)
                info.size, info.mode, info.uid, info.gid = len(data), 0o4755, 0, 0
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                         "hardlink": tarfile.LNKTYPE}[kind]
            # A hard link's entry carries its file's mode, as tar writes it.
            info.mode = {"dir": 0o755, "symlink": 0o777, "hardlink": 0o4755}[kind]
            if kind in ("symlink", "hardlink"):
                info.linkname = str(data)
            tar.addfile(info)
    return buf.getvalue()


def _raw_image(layers: list[bytes], gz: bool = True) -> Image:
    blobs = [gzip.compress(b, mtime=0) if gz else b for b in layers]
    media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else "")
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                      "rootfs": {"type": "layers", "diff_ids": [sha(b) for b in layers]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha(cfg), "size": len(cfg)},
        "layers": [{"mediaType": media, "digest": sha(b), "size": len(b)} for b in blobs],
    }).encode()
    return Image(cfg, blobs, [sha(b) for b in layers], manifest)


def _unpacked(store: ImageStore, tmp_path: Path, img: Image) -> Path:
    import_image(store, f"oci:{write_layout(tmp_path / 'layout', {'x': img})}", "t")
    return unpack_image(store, inspect_image(store, "t"), tmp_path / "roots")


def test_unpack_applies_layers_and_whiteouts(store: ImageStore, tmp_path: Path) -> None:
    lower = _tar_entries([
        ("dir", "etc", None), ("file", "etc/keep", b"k"), ("file", "etc/gone", b"g"),
        ("dir", "opq", None), ("file", "opq/old", b"o"), ("dir", "var", None),
        ("symlink", "var/run", "/run"), ("dir", "run", None),
        ("suid", "bin/su", b"#!"), ("hardlink", "bin/su2", "bin/su"),
    ])
    upper = _tar_entries([
        ("file", "etc/.wh.gone", b""), ("file", "opq/new", b"n"),
        ("file", "opq/.wh..wh..opq", b""), ("file", "var/run/pid", b"42"),
        ("file", "etc/keep", b"k2"),
    ])
    root = _unpacked(store, tmp_path, _raw_image([lower, upper]))
    assert (root / "etc/keep").read_bytes() == b"k2"
    assert not (root / "etc/gone").exists()
    assert sorted(os.listdir(root / "opq")) == ["new"]  # lower's emptied, its own kept
    # An absolute symlink resolves inside the tree: the write landed in <root>/run.
    assert os.readlink(root / "var/run") == "/run"
    assert (root / "run/pid").read_bytes() == b"42"
    assert os.stat(root / "bin/su").st_mode & 0o4000  # setuid kept
    assert os.stat(root / "bin/su").st_ino == os.stat(root / "bin/su2").st_ino
    assert not any(p.name.startswith(".wh.") for p in root.rglob("*"))
    # Made once per digest: a second call returns the same tree untouched.
    assert unpack_image(store, inspect_image(store, "t"), tmp_path / "roots") == root


def test_unpack_never_writes_outside_the_tree(store: ImageStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("safe")
    hostile = _tar_entries([
        ("symlink", "escape", str(outside)),  # an absolute link to a host directory
        ("symlink", "up", "../../../../../../../.."),
        ("file", f"{outside}/victim", b"pwned"),  # an absolute member name
        ("file", "../../../../../outside-file", b"pwned"),
        ("file", "ok", b"fine"),
    ])
    hostile2 = _tar_entries([
        ("file", "escape/victim", b"pwned"),  # written through the link
        ("file", "up/tmp/boxd-escape-test", b"pwned"),
        ("hardlink", "hl", str(outside / "victim")),
        ("file", "escape/.wh.victim", b""),  # a whiteout through the link
    ])
    root = _unpacked(store, tmp_path, _raw_image([hostile, hostile2], gz=False))
    assert (outside / "victim").read_text() == "safe"
    assert not Path("/tmp/boxd-escape-test").exists()
    assert not (tmp_path.parent / "outside-file").exists()
    assert (root / "ok").read_bytes() == b"fine"
    # What the links pointed at was made inside the tree instead: the absolute name and
    # the link lead to <root>/<outside>/victim, the hard link to it, and the whiteout
    # through the link removed that copy, not the host's.
    assert (root / "hl").read_bytes() == b"pwned"
    assert not (root / str(outside).lstrip("/") / "victim").exists()
    assert (root / "tmp/boxd-escape-test").read_bytes() == b"pwned"


def test_unpack_refuses_a_corrupt_layer_and_leaves_nothing(store: ImageStore,
                                                          tmp_path: Path) -> None:
    img = _raw_image([b"this is not a tar archive" * 40], gz=True)
    with pytest.raises(CorruptData, match="not a valid tar"):
        _unpacked(store, tmp_path, img)
    roots = tmp_path / "roots"
    assert [p for p in roots.rglob("*")
            if p not in (roots / "chains", roots / ".gc-lock")] == []  # the lock: empty


def test_images_that_share_base_layers_share_their_files(store: ImageStore,
                                                         tmp_path: Path) -> None:
    """Ten images on one base: the base's files are one inode each on disk, and what an
    image's own layer changes (a file replaced, one whited out, a mode) stays its own."""
    base = _tar_entries([("dir", "usr", None), ("file", "usr/big", b"b" * 100_000),
                         ("file", "usr/conf", b"base"), ("suid", "usr/su", b"#!")])
    roots = tmp_path / "roots"
    trees = []
    for i in range(10):
        top = _tar_entries([("file", f"app{i}", str(i).encode()),
                            ("file", "usr/conf", f"own {i}".encode()),
                            *([("file", "usr/.wh.su", b"")] if i == 0 else [])])
        layout = write_layout(tmp_path / f"layout{i}", {"x": _raw_image([base, top])})
        import_image(store, f"oci:{layout}", f"t{i}")
        trees.append(unpack_image(store, inspect_image(store, f"t{i}"), roots))
    assert len({os.stat(t / "usr/big").st_ino for t in trees}) == 1  # stored once
    assert [(t / "usr/conf").read_bytes() for t in trees] == [
        f"own {i}".encode() for i in range(10)]
    assert not (trees[0] / "usr/su").exists()
    assert all(os.stat(t / "usr/su").st_mode & 0o4000 for t in trees[1:])
    assert sorted(p.name for p in trees[3].iterdir()) == ["app3", "usr"]
    # the image's name leads to its tree; a second unpack reuses it
    assert (roots / inspect_image(store, "t3").digest[7:]).resolve() == trees[3]
    assert unpack_image(store, inspect_image(store, "t3"), roots) == trees[3]


def test_the_store_is_the_daemons_alone(store: ImageStore, tmp_path: Path) -> None:
    """Every folder and file of the store is 0700/0600, whatever the umask: another
    local user lists and reads nothing of it (tests/integration/test_file_access.py
    walks the whole data directory as `nobody`)."""
    old = os.umask(0o022)
    try:
        import_image(store, f"oci:{write_layout(tmp_path / 'l', {'a': make_image([BASE])})}",
                     "a")
    finally:
        os.umask(old)
    for path in [store.root, *store.root.rglob("*")]:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_a_pushed_blob_is_stored_once_whole_and_verified(store: ImageStore) -> None:
    """A cluster's control plane pushes image blobs to a node chunk by chunk
    (`ImageStore.receive`): stored when whole and matching, never out of order or
    corrupt."""
    data = os.urandom(3000)
    digest = sha(data)
    assert store.receive(digest, len(data), 0, data[:1000]) is False
    assert not store.has(digest)
    with pytest.raises(CorruptData, match="does not follow"):
        store.receive(digest, len(data), 2000, data[2000:])
    assert store.receive(digest, len(data), 1000, data[1000:2000]) is False
    assert store.receive(digest, len(data), 2000, data[2000:]) is True
    assert store.path(digest).read_bytes() == data
    with pytest.raises(CorruptData, match="before its start"):
        store.receive(sha(b"x"), 2, 1, b"x")
    bad = sha(b"other bytes")
    store.receive(bad, 4, 0, b"abc")
    with pytest.raises(IntegrityError):
        store.receive(bad, 4, 3, b"d")
    assert not store.has(bad)
    assert [p.name for p in store.blobs.iterdir() if p.name.startswith(".")] == []
    assert store.receive(sha(b""), 0, 0, b"") is True  # an empty blob is one empty chunk
