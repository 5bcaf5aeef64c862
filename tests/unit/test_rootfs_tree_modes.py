"""gVisor's unpacked guest root keeps the image's setuid, setgid and sticky bits.

``debugfs rdump`` chowns each file after its chmod, which clears setuid and setgid
(sudo, su, passwd lose them); `rootfs_tree` sets them again from the image's own modes,
also on a tree an older boxd unpacked. A real ext4 image (``mke2fs -d``), real debugfs.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from boxd.images import rootfs_tree

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mke2fs") or not shutil.which("debugfs"),
    reason="needs root (setuid files owned by root), mke2fs and debugfs")


def _image(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "usr" / "bin").mkdir(parents=True)
    (src / "odd name dir").mkdir()
    for rel, mode in (("usr/bin/sudo", 0o4755), ("usr/bin/wall", 0o2755),
                      ("usr/bin/plain", 0o755), ("odd name dir/su id", 0o4711)):
        (src / rel).write_bytes(b"#!/bin/sh\n")
        os.chmod(src / rel, mode)
    (src / "tmp").mkdir(mode=0o1777)
    os.chmod(src / "tmp", 0o1777)
    img = tmp_path / "image" / "rootfs.img"
    img.parent.mkdir()
    subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-d", str(src), str(img), "8M"],
                   check=True, capture_output=True)
    return img


def _modes(tree: Path) -> dict[str, int]:
    return {rel: stat.S_IMODE((tree / rel).stat().st_mode) for rel in (
        "usr/bin/sudo", "usr/bin/wall", "usr/bin/plain", "odd name dir/su id", "tmp")}


WANT = {"usr/bin/sudo": 0o4755, "usr/bin/wall": 0o2755, "usr/bin/plain": 0o755,
        "odd name dir/su id": 0o4711, "tmp": 0o1777}


def test_the_tree_keeps_setuid_and_setgid_bits(tmp_path: Path) -> None:
    tree = rootfs_tree(_image(tmp_path))
    assert _modes(tree) == WANT


def test_a_tree_unpacked_before_gets_them_in_place(tmp_path: Path) -> None:
    img = _image(tmp_path)
    tree = rootfs_tree(img)
    for rel in ("usr/bin/sudo", "usr/bin/wall", "odd name dir/su id"):
        os.chmod(tree / rel, 0o755)  # as an older boxd's rdump left them
    (tree / ".boxd-modes").unlink()
    inode = (tree / "usr/bin/sudo").stat().st_ino
    assert rootfs_tree(img) == tree
    assert _modes(tree) == WANT
    assert (tree / "usr/bin/sudo").stat().st_ino == inode  # fixed in place, not unpacked
