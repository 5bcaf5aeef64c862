"""A QEMU machine of a multi-layer image boots the image's disks made per layer chain
(a raw ext4 of the first layer's tree, a qcow2 of each later layer's changes on it:
issue 41, "the base stored once" on QEMU too), and its guest sees exactly the files
the image's tree holds, the one gVisor serves: whiteouts (a file, an opaque
directory), hard links and their counts, symlinks, setuid bits, owners, long and odd
names, xattrs (a binary security.capability). The image has no shell and a non-root
USER. One VM (QEMU runs under TCG here).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd import errors
from boxd.images.oci import image_by_digest, unpack_image
from boxd.storage.oci import ImageStore
from tests._support.oci import entries_tar, image_of_tars, write_layout
from tests.integration.test_image_machines import _busybox

pytestmark = pytest.mark.vm

IMAGE = "itc/chained:v1"
LONG = "n" * 255
CAP = b"\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"
# What the guest runs, and the host runs on the tree: each path's mode, owner, links,
# size, mtime, symlink target, xattrs and content hash (None: absent).
LISTING = r"""
import hashlib, json, os, stat, sys
root, paths, out = sys.argv[1], json.loads(sys.argv[2]), {}
for p in paths:
    full = os.path.join(root, p)
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        out[p] = None
        continue
    xs = {n: os.getxattr(full, n, follow_symlinks=False).hex()
          for n in sorted(os.listxattr(full, follow_symlinks=False))}
    isdir = stat.S_ISDIR(st.st_mode)
    data = open(full, "rb").read() if stat.S_ISREG(st.st_mode) else b""
    out[p] = [st.st_mode, st.st_uid, st.st_gid, None if isdir else st.st_size,
              None if isdir else int(st.st_mtime),
              os.readlink(full) if stat.S_ISLNK(st.st_mode) else "", xs,
              hashlib.sha256(data).hexdigest()]
print(json.dumps(out, sort_keys=True))
"""
RT = "/opt/boxd-rt"
PYTHON = [f"{RT}/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", "--library-path",
          f"{RT}/usr/lib/x86_64-linux-gnu", f"{RT}/usr/bin/python3.11", "-E", "-s", "-c",
          LISTING]
GONE = ["etc/gone", "opq/old", "opq/sub", "opq/sub/deep"]


def _layers() -> list[bytes]:
    busybox = _busybox()
    base = [
        {"path": "bin", "kind": "dir"},
        {"path": "bin/busybox", "data": busybox, "mode": 0o755},
        {"path": "bin/cat", "kind": "hardlink", "target": "bin/busybox", "mode": 0o755},
        {"path": "bin/ls", "kind": "symlink", "target": "busybox"},
        {"path": "bin/ping", "data": b"not really ping", "mode": 0o755,
         "xattrs": {"security.capability": CAP}},
        {"path": "etc/passwd", "data": b"root:x:0:0::/root:/bin/sh\n"
                                       b"app:x:1000:1000::/home/app:/bin/sh\n"},
        {"path": "etc/group", "data": b"root:x:0:\napp:x:1000:\n"},
        {"path": "etc/gone", "data": b"whited out above"},
        {"path": "opq/old", "data": b"old"},
        {"path": "opq/sub/deep", "data": b"deep"},
        {"path": "home/app", "kind": "dir", "uid": 1000, "gid": 1000},
        {"path": "srv/app/data.txt", "data": b"image data\n"},
    ]
    top = [
        {"path": "etc/.wh.gone"},
        {"path": "opq/.wh..wh..opq"},
        {"path": "opq/new", "data": b"new"},
        {"path": "bin/head", "kind": "hardlink", "target": "bin/busybox", "mode": 0o755},
        {"path": "bin/su", "data": b"setuid", "mode": 0o4755,
         "xattrs": {"user.note": b"the top's own\x00value"}},
        {"path": "home/app", "kind": "dir", "mode": 0o700, "uid": 1000, "gid": 1000},
        {"path": "home/app/notes", "data": b"mine", "mode": 0o600, "uid": 1000, "gid": 1000},
        {"path": f"srv/{LONG}", "data": b"a long name"},
        {"path": 'srv/we"ird name', "data": b"quoted"},
        {"path": "srv/app/data.txt", "data": b"image data, v2\n", "mtime": 1_600_000_000},
    ]
    return [entries_tar(base), entries_tar(top)]


def _listing(tree: Path, paths: list[str]) -> dict[str, object]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-I", "-c", LISTING, str(tree), json.dumps(paths)],
                         capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out))


@pytest.fixture(scope="module")
def image(client, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:  # type: ignore[no-untyped-def]
    """The image imported, and its tree unpacked (in the daemon's data directory, as
    the daemon unpacks it: the tree gVisor serves, the reference), with an xattr set
    on a directory of the top chain's own besides the layers' (a capability on a base
    file, a binary value on one of the top layer's)."""
    root = tmp_path_factory.mktemp("chain-layouts")
    img = image_of_tars(_layers(), config={"Env": ["PATH=/bin"], "User": "app"})
    write_layout(root / "chained", {"v1": img})
    digest = client.images.import_(f"oci:{root / 'chained'}:v1", IMAGE).digest
    home = Path(os.environ["BOXD_HOME"])
    store = ImageStore(home / "oci")
    info = image_by_digest(store, f"local/{IMAGE}", digest)
    tree = unpack_image(store, info, home / "oci-roots")
    os.setxattr(tree / "srv", "user.dir", b"on a directory")
    yield digest, tree
    with contextlib.suppress(errors.NotFound):
        client.images.remove(IMAGE)


def test_the_guest_sees_the_images_tree_through_its_chain_disks(  # type: ignore[no-untyped-def]
        client, image) -> None:
    digest, tree = image
    paths = sorted(str(p.relative_to(tree)) for p in tree.rglob("*"))
    want = _listing(tree, paths + GONE)
    assert want["bin/su"][0] & stat.S_ISUID and want["etc/gone"] is None  # type: ignore[index]
    assert want["bin/ping"][6] == {"security.capability": CAP.hex()}  # type: ignore[index]
    m = client.machines.new("imgchain", engine="qemu", image=IMAGE)
    try:
        m = client.machines.wait_until_ready(m.id, timeout=300)
        assert m.image is not None and m.image.digest == digest
        # the image's disk is its chains': the base's ext4, the top layer's changes
        disks = Path(os.environ["BOXD_HOME"]) / "oci-disks"
        base = os.readlink(tree.with_name(tree.name + ".below"))
        assert {p.name for p in disks.iterdir() if p.suffix != ".lock"} == {
            f"{base}.ext4", f"{tree.name}.qcow2"}
        # a non-root USER, and no shell: argv only
        r = client.machines.exec(m.id, ["busybox", "id", "-u"])
        assert (r.exit_code, r.stdout) == (0, "1000\n"), r
        assert client.machines.exec(m.id, ["cat", "/home/app/notes"]).stdout == "mine"
        r = client.machines.exec(m.id, [*PYTHON, "/", json.dumps(paths + GONE)], user="root")
        assert r.exit_code == 0, r
        got = json.loads(r.stdout)
        assert got == want
        # hard links: bin/busybox, bin/cat (base) and bin/head (top) are one inode
        r = client.machines.exec(m.id, ["busybox", "stat", "-c", "%h %i", "/bin/busybox",
                                        "/bin/cat", "/bin/head"])
        lines = r.stdout.split("\n")[:3]
        assert len(set(lines)) == 1 and lines[0].startswith("3 "), r
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)
