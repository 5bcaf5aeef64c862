"""A container image's unpacked root packed into an ext4 disk (QEMU boots on it): the
files, modes and links go in as they are, once per image."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from boxd.images import image_disk
from boxd.images._disk import DISK_MODE


def _debugfs(disk: Path, request: str) -> str:
    out = subprocess.run(["debugfs", "-R", request, str(disk)], capture_output=True,
                         text=True, check=True)
    return out.stdout


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    if shutil.which("mkfs.ext4") is None or shutil.which("debugfs") is None:
        pytest.skip("no e2fsprogs (mkfs.ext4, debugfs) on this host")
    root = tmp_path / "roots" / ("ab" * 32)
    (root / "bin").mkdir(parents=True)
    (root / "bin/busybox").write_bytes(b"\x7fELF not really")
    (root / "bin/busybox").chmod(0o4755)
    (root / "bin/sh").symlink_to("busybox")
    os.link(root / "bin/busybox", root / "bin/cat")
    (root / "srv/app").mkdir(parents=True)
    (root / "srv/app/data.txt").write_text("image data\n")
    return root


def test_the_tree_becomes_an_ext4_disk_once(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "disks"
    disk = image_disk(tree, dest, group=os.getgid())
    assert disk == dest / f"{tree.name}.ext4"
    assert disk.stat().st_mode & 0o777 == DISK_MODE
    assert _debugfs(disk, "cat /srv/app/data.txt") == "image data\n"
    assert "busybox" in _debugfs(disk, "stat /bin/sh")  # the symlink's target
    stat = _debugfs(disk, "stat /bin/busybox")
    assert "Mode:  04755" in stat and "Links: 2" in stat  # setuid; the hard link kept
    # made once: a second call finds it (nothing rebuilt, same inode)
    ino = disk.stat().st_ino
    (tree / "srv/app/data.txt").write_text("changed\n")
    assert image_disk(tree, dest).stat().st_ino == ino
    assert [p.name for p in dest.iterdir() if p.name.endswith(".ext4")] == [disk.name]


def test_a_disk_smaller_than_the_images_files_is_refused(tree: Path, tmp_path: Path) -> None:
    import asyncio

    from boxd.engine.qemu import QemuEngine
    from boxd.engine.qemu._probe import AccelChoice
    from boxd.errors import InvalidRequest

    if shutil.which("qemu-img") is None:
        pytest.skip("no qemu-img on this host")
    dest = tmp_path / "disks"
    engine = QemuEngine("qemu-system-x86_64", AccelChoice("tcg", "test"),
                        runtime=tmp_path / "rootfs.img", image_disks=dest)
    assert engine.image_roots
    layer = tmp_path / "l.qcow2"
    asyncio.run(engine.create_disk(layer, tree, "raw", 1))  # a few MiB of files: fits
    info = subprocess.run(["qemu-img", "info", "--output=json", str(layer)],
                          capture_output=True, text=True, check=True).stdout
    assert f'"backing-filename": "{dest / (tree.name + ".ext4")}"' in info
    # an image whose ext4 is 2.5 GiB (made before, as a big image's would be)
    big = tree.with_name("cd" * 32)
    shutil.copytree(tree, big, symlinks=True)
    dest.joinpath(f"{big.name}.ext4").write_bytes(b"")
    os.truncate(dest / f"{big.name}.ext4", 5 << 29)
    with pytest.raises(InvalidRequest, match="at least 3 GiB; the machine's is 2 GiB"):
        asyncio.run(engine.create_disk(tmp_path / "l2.qcow2", big, "raw", 2))
    assert not (tmp_path / "l2.qcow2").exists()
    assert not QemuEngine("q", AccelChoice("tcg", "test")).image_roots  # no runtime given
