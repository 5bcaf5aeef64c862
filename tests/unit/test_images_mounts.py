"""An image build never leaves mounts behind, and never deletes through one.

Real mounts (root only): a build killed mid-way used to leave the host's /dev/shm bound
inside its tree, and the next build's clean-up emptied the host's /dev/shm.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from boxd.images._util import mounts_below, private_mounts, remove_build_tree

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting needs root (CI runs as root; a non-root build "
    "runs mmdebstrap in its own user namespace, whose mounts die with it anyway)",
)


def test_a_killed_builders_mounts_die_with_it(tmp_path: Path) -> None:
    target = tmp_path / "rootfs" / "dev" / "shm"
    target.mkdir(parents=True)
    # a stand-in for mmdebstrap: mounts inside its tree, then is killed
    argv = private_mounts(["sh", "-c", f"mount -t tmpfs none {target} && kill -9 $$"])
    assert argv[0].endswith("unshare")
    subprocess.run(argv, check=False)
    assert mounts_below(tmp_path) == []


def test_removal_never_descends_into_a_mount(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "ram").write_text("a machine's memory")
    tree = tmp_path / "key.tmp-123"
    inside = tree / "rootfs" / "dev" / "shm"
    inside.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(precious), str(inside)], check=True)
    try:
        assert mounts_below(tree) == [str(inside)]
        remove_build_tree(tree)
    finally:
        subprocess.run(["umount", "-l", str(inside)], capture_output=True, check=False)
    assert not tree.exists()
    assert (precious / "ram").read_text() == "a machine's memory"


def test_mount_points_with_spaces_are_read_back(tmp_path: Path) -> None:
    d = tmp_path / "a dir"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "none", str(d)], check=True)
    try:
        assert mounts_below(tmp_path) == [str(d)]
    finally:
        subprocess.run(["umount", str(d)], check=True)
