"""QEMU disks of container images made per layer chain (issue 41: "the base stored
once", on QEMU too): the first chain a raw ext4, each chain above a qcow2 of what its
layer changed, written with debugfs and backed by the disk below. The disk a guest
boots must hold exactly what the image's tree holds (``mkfs.ext4 -d`` of the whole
tree is the reference): whiteouts, opaque directories, hard links, symlinks, setuid
bits, owners, long and odd names, fifos, xattrs; and images on one base share it."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from tests._support.oci import entries_tar, image_of_tars, write_layout

from boxd.images import disk_format, image_disk, qcow2_backing, virtual_size
from boxd.images._rootfs import make_ext4
from boxd.images.oci import import_image, inspect_image, unpack_image
from boxd.storage.oci import ImageStore

LONG = "l" * 255  # the longest name ext4 takes
CAP = b"\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"

BASE = [
    {"path": "bin", "kind": "dir"},
    {"path": "bin/busybox", "data": b"\x7fELF busybox v1", "mode": 0o4755},
    {"path": "bin/sh2", "kind": "hardlink", "target": "bin/busybox", "mode": 0o4755},
    {"path": "bin/sh", "kind": "symlink", "target": "busybox"},
    {"path": "bin/true", "data": b"true"},  # two links no layer above touches
    {"path": "bin/false", "kind": "hardlink", "target": "bin/true"},
    {"path": "bin/ping", "data": b"ping", "mode": 0o755,
     "xattrs": {"security.capability": CAP, "user.mark": b"\xff\x00binary",
                "trusted.overlay.opaque": b"y"}},  # the host's: dropped
    {"path": "etc", "kind": "dir"},
    {"path": "etc/gone", "data": b"whited out above"},
    {"path": "etc/keep", "data": b"kept"},
    {"path": "opq", "kind": "dir"},
    {"path": "opq/old", "data": b"old"},
    {"path": "opq/sub", "kind": "dir"},
    {"path": "opq/sub/deep", "data": b"deep"},
    {"path": "home", "kind": "dir"},
    {"path": "home/app", "kind": "dir", "uid": 1000, "gid": 1000},
    {"path": "home/app/.profile", "data": b"PS1=$\n", "uid": 1000, "gid": 1000, "mode": 0o600},
    {"path": "srv", "kind": "dir"},
    {"path": "srv/tree", "kind": "dir"},
    *({"path": f"srv/tree/f{i}", "data": b"x" * 5000} for i in range(20)),
    {"path": f"var/{LONG}", "data": b"long name"},
    {"path": "run/fifo", "kind": "fifo", "mode": 0o600},
]
MIDDLE = [
    {"path": "etc/.wh.gone"},
    {"path": "opq/.wh..wh..opq"},
    {"path": "opq/new", "data": b"new"},
    # busybox replaced: bin/sh2 keeps the old inode (its links count drops to 1)
    {"path": "bin/busybox", "data": b"\x7fELF busybox v2", "mode": 0o4755},
    # a new link to a lower file: bin/sh2's inode gains a link
    {"path": "bin/cat", "kind": "hardlink", "target": "bin/sh2", "mode": 0o4755},
    {"path": "bin/su", "data": b"su", "mode": 0o4711},
    {"path": "bin/sh", "kind": "symlink", "target": "cat"},  # a symlink retargeted
    {"path": "home/app", "kind": "dir", "mode": 0o700, "uid": 1000, "gid": 1000},
    {"path": "home/app/notes", "data": b"mine", "uid": 1000, "gid": 1000},
    {"path": "home/app/big", "data": os.urandom(300_000), "uid": 100000, "gid": 70000},
    {"path": 'etc/we"ird name #1', "data": b"quoted"},
    {"path": 'etc/-da\\sh; rm ""x"" ', "data": b"no command in a name"},
    {"path": f"{LONG}/{LONG}", "data": b"long path"},
]
TOP = [
    {"path": ".wh.srv"},  # a whole subtree
    {"path": "srv", "kind": "dir", "mode": 0o750},  # and made again
    {"path": "srv/only", "data": b"top", "xattrs": {"user.note": b"top's own\x00binary"}},
    {"path": "usr/local/bin/tool", "data": b"tool", "mode": 0o700, "uid": 1000},
    {"path": "bin/.wh.cat"},  # a link removed: bin/sh2's inode back to 1 link
]


def _need_tools() -> None:
    if os.geteuid() != 0:  # an unpack in a user namespace keeps only uid 0
        pytest.skip("the images' owners (uid 1000, 100000) and capabilities need root")
    for tool in ("mkfs.ext4", "debugfs", "e2fsck", "resize2fs", "qemu-img"):
        if shutil.which(tool) is None and shutil.which(tool, path="/usr/sbin:/sbin") is None:
            pytest.skip(f"no {tool} on this host")


def _tree(tmp_path: Path, layers: list[list[dict[str, object]]], name: str = "t") -> Path:
    store = ImageStore(tmp_path / "store")
    layout = write_layout(tmp_path / f"layout-{name}",
                          {"x": image_of_tars([entries_tar(rows) for rows in layers])})
    import_image(store, f"oci:{layout}", name)
    return unpack_image(store, inspect_image(store, name), tmp_path / "roots")


def _raw(disk: Path, tmp_path: Path) -> Path:
    """The disk as one raw file (debugfs reads no qcow2)."""
    out = tmp_path / f"{disk.name}.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(disk), str(out)], check=True)
    return out


def _listing(raw: Path, tmp_path: Path, tree: Path) -> dict[str, str]:
    """Every path of the file system (as rdump finds them) and of ``tree``, with what
    ``mkfs.ext4 -d`` decides about it: type, mode, owner, size (files), links, mtime,
    xattrs, symlink target, contents."""
    out = tmp_path / f"dump-{raw.name}"
    out.mkdir()
    subprocess.run(["debugfs", "-R", f"rdump / {out}", str(raw)], capture_output=True,
                   check=True)
    found = {str(p.relative_to(out)) for p in out.rglob("*")}
    paths = ["", *sorted(found | {str(p.relative_to(tree)) for p in tree.rglob("*")})]
    script = tmp_path / f"stat-{raw.name}"
    script.write_text("".join(f'stat "/{p.replace(chr(34), 2 * chr(34))}"\n' for p in paths))
    r = subprocess.run(["debugfs", "-f", str(script), str(raw)], capture_output=True,
                       text=True, check=True)
    stats = r.stdout.split("debugfs: stat ")[1:]
    assert len(stats) == len(paths)
    view = {}
    for p, text in zip(paths, stats, strict=True):
        kind = re.search(r"Type: (\S+)", text)
        if kind is None:
            continue  # not on this disk
        keep = [kind.group(0), *re.findall(
            r"Mode: +\d+|User: +\d+ +Group: +\d+|Links: \d+|mtime: \S+|"
            r"Fast link dest: .*|Device major/minor number: \S+|^  \S+ \(\d+\) = .*",
            text, re.M)]
        if kind.group(1) == "regular" and p in found:
            keep += re.findall(r"Size: \d+", text)
            keep.append(repr((out / p).read_bytes()[:64]))
        if p and (out / p).is_symlink():
            keep.append(os.readlink(out / p))
        view[p] = " ".join(keep)
    return view


def test_a_chain_disk_holds_exactly_what_the_tree_holds(tmp_path: Path) -> None:
    _need_tools()
    top = _tree(tmp_path, [BASE, MIDDLE, TOP])
    # the layers' xattrs are in the trees (a capability, binary values), and one set on
    # the top's own directory here
    base = top.with_name(os.readlink(top.with_name(
        os.readlink(top.with_name(top.name + ".below")) + ".below")))
    assert os.getxattr(base / "bin/ping", "security.capability") == CAP
    assert os.getxattr(top / "bin/ping", "user.mark") == b"\xff\x00binary"
    assert not any(n.startswith("trusted.") for n in os.listxattr(top / "bin/ping"))
    assert os.getxattr(top / "srv/only", "user.note") == b"top's own\x00binary"
    os.setxattr(top / "etc", "user.dir", b"on a directory")
    disk = image_disk(top, tmp_path / "disks", group=os.getgid())
    assert disk == tmp_path / "disks" / f"{top.name}.qcow2"
    assert disk_format(disk) == "qcow2"
    chain = subprocess.run(["qemu-img", "info", "--backing-chain", str(disk)],
                           capture_output=True, text=True, check=True).stdout
    assert chain.count("image: ") == 3 and f"{base.name}.ext4" in chain  # one per layer
    for f in (tmp_path / "disks").glob("*.*[24w]"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f
    whole = tmp_path / "whole.ext4"
    make_ext4(top, whole)
    got = _listing(_raw(disk, tmp_path), tmp_path, top)
    want = _listing(whole, tmp_path, top)
    # every path, as mkfs.ext4 -d of the tree makes it (but the root and lost+found:
    # mkfs makes those, with its own clock's time)
    mine = {"", "lost+found"}
    assert {k: v for k, v in got.items() if k not in mine} == {
        k: v for k, v in want.items() if k not in mine}
    assert "lost+found" in got
    # and what that means, against the tree itself
    assert not {"etc/gone", "opq/old", "opq/sub", "srv/tree", "bin/cat"} & got.keys()
    assert {"opq/new", f"var/{LONG}", f"{LONG}/{LONG}", 'etc/we"ird name #1',
            'etc/-da\\sh; rm ""x"" '} <= got.keys()
    assert "Mode:  04711" in got["bin/su"] and "Mode:  04755" in got["bin/busybox"]
    assert "Links: 1" in got["bin/sh2"] and "v1" in got["bin/sh2"]
    assert "Links: 2" in got["bin/true"] and "Links: 2" in got["bin/false"]
    assert "Fast link dest: \"cat\"" in got["bin/sh"]
    assert "User:  1000   Group:  1000" in got["home/app"] and "Mode:  0700" in got["home/app"]
    assert "User: 100000   Group: 70000" in got["home/app/big"]
    assert "Type: FIFO" in got["run/fifo"] and "Mode:  0600" in got["run/fifo"]
    assert "security.capability (20)" in got["bin/ping"] and "user.mark (8)" in got["bin/ping"]
    assert "user.note (16)" in got["srv/only"] and "user.dir" in got["etc"]
    assert "Mode:  0750" in got["srv"]
    # a hard link made in a layer above its file's layer
    mid = top.with_name(os.readlink(top.with_name(top.name + ".below")))
    mid_disk = image_disk(mid, tmp_path / "disks")
    assert "Links: 2" in _listing(_raw(mid_disk, tmp_path), tmp_path, mid)["bin/cat"]


def test_images_on_one_base_store_it_once(tmp_path: Path) -> None:
    """Two images on one 8 MB base: their disks together take the base once and two
    small deltas, where whole disks took the base twice."""
    _need_tools()
    base = [{"path": "usr", "kind": "dir"},
            *({"path": f"usr/lib{i}.so", "data": os.urandom(400_000)} for i in range(20))]
    tops = [_tree(tmp_path, [base, [{"path": f"app{i}/main", "data": os.urandom(50_000)},
                                    {"path": "usr/.wh.lib3.so"}]], f"app{i}")
            for i in range(2)]
    dest = tmp_path / "disks"
    disks = [image_disk(t, dest) for t in tops]
    assert len({d.name for d in disks}) == 2 and all(disk_format(d) == "qcow2" for d in disks)
    used = {p.name: p.stat().st_blocks * 512 for p in dest.iterdir() if p.suffix != ".lock"}
    assert len(used) == 3  # the base's ext4 and one delta per image
    base_disk = max(used.values())
    assert base_disk > 8_000_000
    deltas = sorted(used.values())[:2]
    assert all(d < 500_000 for d in deltas), used  # 50 KB of files, some metadata blocks
    assert sum(used.values()) < 1.2 * base_disk  # whole disks: 2 x base_disk
    # the guest sees a disk the size of a whole one
    assert virtual_size(disks[0]) == make_ext4(tops[0], tmp_path / "whole.ext4")


def test_a_chain_debugfs_cannot_make_is_packed_whole(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    _need_tools()
    top = _tree(tmp_path, [BASE[:3], [{"path": "srv/a", "data": b"a"}]])
    os.mknod(top / "srv/sock", 0o600 | stat.S_IFSOCK)  # debugfs makes no sockets
    with caplog.at_level(logging.WARNING, logger="boxd.images"):
        disk = image_disk(top, tmp_path / "disks")
    assert disk == tmp_path / "disks" / f"{top.name}.ext4" and disk_format(disk) == "raw"
    assert "event=image_disk_unshared" in caplog.text and "socket" in caplog.text
    assert "Type: socket" in _listing(disk, tmp_path, top)["srv/sock"]


def test_disks_made_before_chains_stay_in_use(tmp_path: Path) -> None:
    """A whole ``<top chain>.ext4`` made before (machines' overlays name it) is the
    image's disk still, and a tree with no note of the chain below is packed whole."""
    _need_tools()
    top = _tree(tmp_path, [BASE[:3], [{"path": "srv/a", "data": b"a"}]])
    dest = tmp_path / "disks"
    dest.mkdir()
    make_ext4(top, dest / f"{top.name}.ext4")
    before = (dest / f"{top.name}.ext4").stat().st_ino
    assert image_disk(top, dest) == dest / f"{top.name}.ext4"
    assert (dest / f"{top.name}.ext4").stat().st_ino == before
    assert sorted(p.suffix for p in dest.iterdir()) == [".ext4"]
    other = _tree(tmp_path, [BASE[:3], [{"path": "srv/b", "data": b"b"}]], "other")
    top.with_name(other.name + ".below").unlink()
    assert image_disk(other, dest) == dest / f"{other.name}.ext4"


def test_a_chain_that_needs_more_room_grows_its_disk(tmp_path: Path) -> None:
    """The first chain's ext4 has 256 MiB of headroom; a layer that adds more gets a
    disk grown offline (resize2fs) under its changes, as big as a whole one would be."""
    _need_tools()
    top = _tree(tmp_path, [BASE[:3], [{"path": "srv/a", "data": b"a"}]])
    with open(top / "srv/big", "wb") as f:  # 300 MB allocated, a few bytes written
        os.posix_fallocate(f.fileno(), 0, 300 << 20)
        f.write(b"start")
    if os.stat(top / "srv/big").st_blocks * 512 < 300 << 20:
        pytest.skip("this file system does not allocate with fallocate")
    base = top.with_name(os.readlink(top.with_name(top.name + ".below")))
    base_disk = image_disk(base, tmp_path / "disks")
    disk = image_disk(top, tmp_path / "disks")
    assert virtual_size(disk) > base_disk.stat().st_size + (200 << 20)
    assert virtual_size(disk) == make_ext4(top, tmp_path / "whole.ext4")
    listing = _listing(_raw(disk, tmp_path), tmp_path, top)
    assert "Size: 314572800" in listing["srv/big"] and "start" in listing["srv/big"]


def test_a_machines_overlay_backs_on_the_top_chains_qcow2(tmp_path: Path) -> None:
    """QEMU's `create_disk` on an image tree: the overlay's backing file is the top
    chain's qcow2 (QEMU follows the chain below it), and a machine disk smaller than
    that qcow2's virtual size is refused."""
    import asyncio
    import json

    from boxd.engine.qemu import QemuEngine
    from boxd.engine.qemu._probe import AccelChoice
    from boxd.errors import InvalidRequest

    _need_tools()
    top = _tree(tmp_path, [BASE[:3], [{"path": "srv/a", "data": b"a"}]])
    dest = tmp_path / "disks"
    engine = QemuEngine("qemu-system-x86_64", AccelChoice("tcg", "test"),
                        runtime=tmp_path / "rootfs.img", image_disks=dest)
    layer = tmp_path / "machine.qcow2"
    asyncio.run(engine.create_disk(layer, top, "raw", 1))
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", str(layer)],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["backing-filename"] == str(dest / f"{top.name}.qcow2")
    assert info["backing-filename-format"] == "qcow2"
    # an image whose top chain's disk the guest sees as 3 GiB (made before)
    big = _tree(tmp_path, [BASE[:3], [{"path": "srv/b", "data": b"b"}]], "big")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(dest / f"{big.name}.qcow2"),
                    "3G"], check=True)
    with pytest.raises(InvalidRequest, match="at least 3 GiB; the machine's is 2 GiB"):
        asyncio.run(engine.create_disk(tmp_path / "l2.qcow2", big, "raw", 2))
    assert not (tmp_path / "l2.qcow2").exists()


def _engines(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Two nodes' QEMU engines, each with its own guest root (built apart: other bytes)."""
    from boxd.engine.qemu import QemuEngine
    from boxd.engine.qemu._probe import AccelChoice

    out = []
    for n in ("a", "b"):
        runtime = tmp_path / f"{n}-cache" / "3a1b263fa04c100e" / "rootfs.img"
        runtime.parent.mkdir(parents=True)
        runtime.write_bytes(f"guest root built on {n}".encode() * 1000)
        out.append(QemuEngine("qemu-system-x86_64", AccelChoice("tcg", "test"),
                              runtime=runtime, image_disks=tmp_path / f"{n}-disks",
                              received_roots=tmp_path / f"{n}-received"))
    return out


def _fetcher(fetched: list[str]):  # type: ignore[no-untyped-def]
    def of(src: Path):  # type: ignore[no-untyped-def]
        async def fetch(dest: Path) -> int:
            fetched.append(src.name)
            shutil.copyfile(src, dest)
            return src.stat().st_size
        return fetch
    return of


def test_an_image_disk_chain_moves_to_another_node_byte_for_byte(tmp_path: Path) -> None:
    """A cross-node fork of a QEMU image machine: each node packs its own disks of a
    tree (they differ byte for byte), so the sender's chain goes along under names of
    its bytes (`root_files`), and so does the guest root its agent runs from; the
    receiver keeps them beside its own, re-pointed at its copies (`receive_root`),
    notes the guest root in the template, fetches each once, and a node asked for a
    disk it made itself uses it."""
    import asyncio

    from boxd.engine.base import MemoryImage
    from boxd.errors import InvalidRequest

    _need_tools()
    top = _tree(tmp_path, [BASE[:3], [{"path": "srv/a", "data": b"a"}]])
    a, b = _engines(tmp_path)
    a_dir, b_dir = a.image_disks, b.image_disks
    assert a.portable_image_templates and a_dir is not None and b_dir is not None
    assert a.runtime is not None and b.received_roots is not None
    asyncio.run(a.create_disk(tmp_path / "a-layer.qcow2", top, "raw", 1))
    asyncio.run(b.create_disk(tmp_path / "b-layer.qcow2", top, "raw", 1))  # b's own packing
    mine = [a_dir / f"{top.with_name(os.readlink(f'{top}.below')).name}.ext4",
            a_dir / f"{top.name}.qcow2"]
    assert (mine[0].read_bytes() != (b_dir / mine[0].name).read_bytes()), \
        "two packings of one tree are alike: nothing would need to move"
    tpl = tmp_path / "a-tpl"
    tpl.mkdir()
    files = a.root_files(tmp_path / "a-layer.qcow2", MemoryImage(tpl / "mem", tpl / "state", 1))
    assert [f.path for f in files] == [*mine, a.runtime]  # bottom first, then its guest root
    assert [f.name.split(".")[::2] for f in files] == [
        [mine[0].name.split(".")[0], "ext4"], [top.name, "qcow2"], ["rootfs", "img"]]
    fetched: list[str] = []
    of = _fetcher(fetched)
    into = tmp_path / "b-tpl"
    into.mkdir()
    got = asyncio.run(b.receive_root([(f.name, of(f.path)) for f in files], into))
    assert got == b_dir / files[1].name and fetched == [m.name for m in mine] + ["rootfs.img"]
    assert qcow2_backing(got) == b_dir / files[0].name  # re-pointed at b's copy
    subprocess.run(["qemu-img", "compare", "-q", str(mine[1]), str(got)], check=True)
    assert (b_dir / files[0].name).read_bytes() == mine[0].read_bytes()
    assert stat.S_IMODE(got.stat().st_mode) == 0o640
    # the template continues on a's guest root, kept here (`_runtime_of` reads the note)
    noted = Path((into / "runtime").read_text())
    assert noted.parent == b.received_roots and noted.read_bytes() == a.runtime.read_bytes()
    # a frozen layer re-pointed at it opens as a qcow2 chain
    layer = tmp_path / "recv-layer.qcow2"
    shutil.copyfile(tmp_path / "a-layer.qcow2", layer)
    asyncio.run(b.retarget_disk(layer, got, "raw"))
    info = subprocess.run(["qemu-img", "info", "--backing-chain", str(layer)],
                          capture_output=True, text=True, check=True).stdout
    assert f"backing file: {got}" in info and "backing file format: qcow2" in info
    onward = b.root_files(layer, MemoryImage(into / "mem", into / "state", 1))
    assert [f.name for f in onward] == [f.name for f in files]  # the same bytes, onward
    # again: nothing fetched; and back on the node that made them, its own files
    fetched.clear()
    assert asyncio.run(b.receive_root([(f.name, of(f.path)) for f in files], into)) == got
    back = tmp_path / "a-back"
    back.mkdir()
    assert asyncio.run(a.receive_root([(f.name, of(f.path)) for f in files], back)) == mine[1]
    assert fetched == [] and Path((back / "runtime").read_text()) == a.runtime
    with pytest.raises(InvalidRequest, match="not an image disk's name"):
        asyncio.run(b.receive_root([("../../etc/passwd", of(mine[0]))], into))


def test_a_guest_root_built_apart_and_a_snapshots_disk_go_along_too(tmp_path: Path) -> None:
    """Not only images: a QEMU machine of boxd's own image sits on the node's guest
    root, and two nodes' guest roots of one key are built apart (other bytes); a machine
    started from a snapshot sits on the snapshot's disk, which a node may not hold.
    Before, the receiver re-pointed the bottom layer at its own guest root either way:
    a child of a snapshot's machine lost the snapshot's disk."""
    import asyncio

    from boxd.engine.base import MemoryImage

    _need_tools()
    a, b = _engines(tmp_path)
    assert a.runtime is not None and b.received_roots is not None
    img = MemoryImage(tmp_path / "mem", tmp_path / "state", 1)
    fetched: list[str] = []
    of = _fetcher(fetched)
    into = tmp_path / "tpl"
    into.mkdir()
    # boxd's own image: its guest root
    layer = tmp_path / "on-root.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(a.runtime), "-F",
                    "raw", str(layer), "1G"], check=True)
    (root,) = a.root_files(layer, img)
    assert root.path == a.runtime and root.name.startswith("rootfs.")
    got = asyncio.run(b.receive_root([(root.name, of(root.path))], into))
    assert got is not None and got.parent == b.received_roots
    assert got.read_bytes() == a.runtime.read_bytes() and not (into / "runtime").exists()
    assert asyncio.run(a.receive_root([(root.name, of(root.path))], into)) == a.runtime
    assert fetched == ["rootfs.img"]
    # a snapshot's disk (a standalone qcow2 named by its digest)
    snap = tmp_path / "blobs" / ("ab" * 32)
    snap.parent.mkdir()
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(snap), "1G"], check=True)
    layer2 = tmp_path / "on-snap.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(snap), "-F",
                    "qcow2", str(layer2), "1G"], check=True)
    (disk,) = a.root_files(layer2, img)
    assert disk.path == snap and disk.name.startswith("disk.") and disk.name.endswith(".qcow2")
    got = asyncio.run(b.receive_root([(disk.name, of(disk.path))], into))
    assert got == b.received_roots / disk.name and qcow2_backing(got) is None
    asyncio.run(b.retarget_disk(layer2, got, "raw"))
    info = subprocess.run(["qemu-img", "info", str(layer2)], capture_output=True, text=True,
                          check=True).stdout
    assert f"backing file: {got}" in info and "backing file format: qcow2" in info


def test_received_whole_disks_no_layer_sits_on_are_collected(tmp_path: Path) -> None:
    """`unused_received`: a snapshot's disk received with a peer's template goes once no
    layer sits on it; guest roots (a template may note one as its runtime), files of
    other names and temporary ones stay."""
    from boxd.images import unused_received

    names = ["disk." + "a" * 20 + ".qcow2", "disk." + "b" * 20 + ".qcow2",
             "rootfs." + "c" * 20 + ".img", "disk.x.qcow2", ".disk." + "d" * 20 + ".qcow2"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    gone = unused_received(tmp_path, {str(tmp_path / names[0])})
    assert gone == [tmp_path / names[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {names[1]})
    assert unused_received(tmp_path / "none", set()) == []
