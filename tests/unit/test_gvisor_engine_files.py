"""The gvisor engine's own files, without runsc: disk layers, the OCI spec, and how a
snapshot's two blobs are reassembled into a directory ``runsc restore`` reads."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from boxd.engine.base import MemoryImage
from boxd.engine.gvisor import layer_base, write_layer
from boxd.engine.gvisor._engine import (
    CHECKPOINT,
    MEM,
    PAGES,
    PAGES_META,
    STATE_TAR,
    _image_dir,
    _pack_state,
    unpack_received,
)
from boxd.engine.gvisor._spec import Roots, RunFiles, build
from boxd.engine.registry import ENGINES
from boxd.errors import HostSetupError, MachineFailed


def test_layer_chain_resolves_to_the_raw_rootfs(tmp_path: Path) -> None:
    raw = tmp_path / "rootfs.img"
    write_layer(tmp_path / "a.qcow2", raw, "raw")
    write_layer(tmp_path / "b.qcow2", tmp_path / "a.qcow2", "layer")
    write_layer(tmp_path / "c.qcow2", tmp_path / "b.qcow2", "layer")
    assert layer_base(tmp_path / "c.qcow2") == raw


def test_a_chain_a_collapse_wrote_before_the_fix_still_resolves(tmp_path: Path) -> None:
    # gVisor's collapse wrote the active layer as {"backing": <base>, "format": "layer"}:
    # layer_base then read the guest root's image (or an image's tree) as a layer, and
    # a snapshot or cross-node fork of a long-lived machine failed. Such layers stay on
    # disk: the base they name is still found.
    raw = tmp_path / "rootfs.img"
    raw.write_bytes(b"\x00" * 4096)
    tree = tmp_path / "chains" / "abc"
    tree.mkdir(parents=True)
    for base in (raw, tree):
        write_layer(tmp_path / "active.qcow2", base, "layer")
        write_layer(tmp_path / "top.qcow2", tmp_path / "active.qcow2", "layer")
        assert layer_base(tmp_path / "top.qcow2") == base
    # a layer that is gone is still said so
    write_layer(tmp_path / "top.qcow2", tmp_path / "gone.qcow2", "layer")
    with pytest.raises(MachineFailed, match=r"gone\.qcow2 is not a disk layer"):
        layer_base(tmp_path / "top.qcow2")


def test_a_qcow2_file_is_not_a_gvisor_layer(tmp_path: Path) -> None:
    q = tmp_path / "q.qcow2"
    q.write_bytes(b"QFI\xfb" + b"\0" * 100)
    with pytest.raises(MachineFailed, match="not a disk layer of the gvisor engine"):
        layer_base(q)


def test_spec_runs_the_agent_on_stdio_over_a_read_only_tree(tmp_path: Path) -> None:
    spec = build("m1", Roots(tmp_path / "root", tmp_path / "agent"), 512)
    assert spec["process"]["args"][-3:] == ["/opt/boxd/agent.py", "--stdio", "--host-clock"]
    assert spec["root"] == {"path": str(tmp_path / "root"), "readonly": False}
    agent = next(m for m in spec["mounts"] if m["destination"] == "/opt/boxd")
    assert "ro" in agent["options"]
    assert {"type": "network"} in spec["linux"]["namespaces"]


def _capture(d: Path, roots: Roots) -> MemoryImage:
    d.mkdir()
    (d / CHECKPOINT).write_bytes(b"state")
    (d / PAGES_META).write_bytes(b"meta")
    (d / PAGES).write_bytes(b"pages")
    _pack_state(d, json.dumps(roots.to_json()).encode())
    (d / MEM).hardlink_to(d / PAGES)
    return MemoryImage(d / MEM, d / STATE_TAR, 512)


def _unused() -> Roots:
    raise AssertionError("a capture used in place runs on the trees it names")


def test_a_capture_is_used_in_place(tmp_path: Path) -> None:
    roots = Roots(tmp_path / "root", tmp_path / "agent")
    img = _capture(tmp_path / "tpl", roots)
    src, got = _image_dir(img, RunFiles(tmp_path / "run"), _unused)
    assert src == tmp_path / "tpl" and got == roots


def test_snapshot_blobs_are_reassembled_on_this_nodes_trees(tmp_path: Path) -> None:
    # issue 41: a snapshot named the trees of the node that saved it by path (an image
    # machine's tree under that node's data directory); it now runs on this node's:
    # its root and runtime trees under the machine's disk, its agent tree by name.
    (tmp_path / "agent-abc").mkdir()
    roots = Roots(tmp_path / "there" / "root", tmp_path / "there" / "agent-abc",
                  tmp_path / "there" / "runtime")
    img = _capture(tmp_path / "tpl", roots)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (img.mem_path).rename(blobs / "sha-pages")  # type: ignore[union-attr]
    (img.state_path).rename(blobs / "sha-state")
    ours = Roots(tmp_path / "root", tmp_path / "agent-new", tmp_path / "runtime")
    snap = MemoryImage(blobs / "sha-pages", blobs / "sha-state", 512)
    src, got = _image_dir(snap, RunFiles(tmp_path / "run"), lambda: ours)
    assert got == Roots(tmp_path / "root", tmp_path / "agent-abc", tmp_path / "runtime")
    # the guest root tree it ran its agent from, where this host still has it
    (tmp_path / "there" / "runtime").mkdir(parents=True)
    _, got = _image_dir(snap, RunFiles(tmp_path / "run"), lambda: ours)
    assert got.runtime == tmp_path / "there" / "runtime"
    assert {p.name for p in src.iterdir()} >= {CHECKPOINT, PAGES, PAGES_META}
    assert (src / PAGES).read_bytes() == b"pages"
    with tarfile.open(blobs / "sha-state") as tar:
        assert set(tar.getnames()) == {CHECKPOINT, PAGES_META, "roots.json"}
    (tmp_path / "agent-abc").rmdir()  # saved by another boxd version: said, not started
    with pytest.raises(HostSetupError, match="no agent tree agent-abc"):
        _image_dir(snap, RunFiles(tmp_path / "run"), lambda: ours)


def test_a_capture_from_another_node_is_laid_out_in_place_on_this_nodes_trees(
    tmp_path: Path
) -> None:
    # A fork template streamed from another node: its mem and state files only, the
    # state naming that node's trees. Restores here use it in place, on this node's.
    theirs = Roots(tmp_path / "there" / "root", tmp_path / "there" / "agent-abc123")
    img = _capture(tmp_path / "sent", theirs)
    got_dir = tmp_path / "templates" / "t1"
    got_dir.mkdir(parents=True)
    for f in (img.mem_path, img.state_path):
        assert f is not None
        (got_dir / f.name).write_bytes(f.read_bytes())
    received = MemoryImage(got_dir / MEM, got_dir / STATE_TAR, 512)
    here = tmp_path / "here"
    (here / "agent-abc123").mkdir(parents=True)
    unpack_received(received, Roots(here / "root", here / "agent-new"), here)
    src, roots = _image_dir(received, RunFiles(tmp_path / "run"), _unused)
    assert src == got_dir, "used in place, not unpacked again for every child"
    assert roots == Roots(here / "root", here / "agent-abc123")
    assert (got_dir / CHECKPOINT).read_bytes() == b"state"
    assert (got_dir / PAGES).samefile(got_dir / MEM)
    # an agent tree this node lacks (another boxd version) is said, not restored
    (here / "agent-abc123").rmdir()
    with pytest.raises(HostSetupError, match="no agent tree agent-abc123"):
        unpack_received(received, Roots(here / "root", here / "agent-new"), here)


def test_a_qemu_state_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.write_bytes(b"QEVM")
    with pytest.raises(MachineFailed, match="not a gvisor checkpoint"):
        _image_dir(MemoryImage(tmp_path / "mem", state, 512), RunFiles(tmp_path / "run"),
                   _unused)


def test_both_engines_are_known() -> None:
    assert ENGINES == ("qemu", "gvisor")


def test_the_in_machine_client_is_bound_where_the_images_pth_looks(tmp_path: Path) -> None:
    from boxd.images import agent_tree

    tree = agent_tree(tmp_path)
    assert (tree / "agent.py").is_file()
    assert (tree / "py" / "boxd" / "__init__.py").is_file()
    assert (tree / "py" / "boxd" / "sdk" / "_sync.py").is_file()
    assert not list((tree / "py" / "boxd").glob("node*")), "no daemon code in the client"
    spec = build("m1", Roots(tmp_path / "root", tree), 512)
    client = next(m for m in spec["mounts"] if m["destination"] == "/run/boxd/py")
    assert client["source"] == str(tree / "py") and "ro" in client["options"]
    # /run is a tmpfs: the bind comes after it.
    dests = [m["destination"] for m in spec["mounts"]]
    assert dests.index("/run") < dests.index("/run/boxd/py")


def test_an_agent_tree_without_the_client_gets_no_client_mount(tmp_path: Path) -> None:
    """A checkpoint made before the client was in the agent tree restores with the
    mounts it was checkpointed with."""
    (tmp_path / "agent").mkdir()
    spec = build("m1", Roots(tmp_path / "root", tmp_path / "agent"), 512)
    assert "/run/boxd/py" not in [m["destination"] for m in spec["mounts"]]


def test_a_layer_on_another_nodes_image_tree_runs_on_this_nodes_or_says_it_lacks_it(
    tmp_path: Path
) -> None:
    """A snapshot of an image machine names the saving node's tree of a layer chain
    (`<its data dir>/oci-roots/chains/<chain id>`). Started on another node it runs on
    that node's tree of the same chain (a chain is named by its layers' digests); a node
    without one says so (before: it ran boxd's Debian root in its place, silently)."""
    from boxd.engine.gvisor import GvisorEngine
    from boxd.images import _tree

    guest = tmp_path / "cache" / "rootfs.img"
    guest.parent.mkdir()
    guest.write_bytes(b"")
    tree = guest.with_name(_tree.TREE_DIR)
    tree.mkdir()
    for marker in (_tree._COMPLETE, _tree._MODES):
        (tree / marker).write_text("{}")
    engine = GvisorEngine("runsc", "test", state_root=tmp_path / "state",
                          agent_tree=tmp_path / "agent", reason="", fallback_rootfs=guest,
                          image_roots=tmp_path / "here" / "oci-roots")
    chain = "ab" * 32
    write_layer(tmp_path / "disk.qcow2", tmp_path / "there" / "oci-roots" / "chains" / chain,
                "raw")
    with pytest.raises(HostSetupError, match="no tree of the container image"):
        engine._roots(tmp_path / "disk.qcow2")
    ours = tmp_path / "here" / "oci-roots" / "chains" / chain
    ours.mkdir(parents=True)
    assert engine._roots(tmp_path / "disk.qcow2") == Roots(ours, tmp_path / "agent", tree)
