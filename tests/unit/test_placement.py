"""The control plane's placement on a cluster: which node new machines and fork children
go to (logic only: the nodes here answer `info()` from numbers; the real cluster is in
tests/integration/test_cluster.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from boxd import models
from boxd.control.plane import Machines
from boxd.errors import NodeLost, NotFound, ResourceExhausted
from boxd.models import MachineState
from boxd.node.base import Node
from boxd.node.cluster import RayCluster
from boxd.state import Database, MachineRecord, Repos
from boxd.storage import SnapshotStore


class NumbersNode:
    """A node that is only its capacity figures."""

    def __init__(self, node_id: str, cap: int, free_mib: int) -> None:
        self.id = node_id
        self.cap = cap
        self.free_mib = free_mib
        self.alive = True

    async def info(self) -> models.NodeInfo:
        return models.NodeInfo(id=self.id, address="127.0.0.1", health="alive", machines=0,
                               max_machines=self.cap, memory_total_mib=8192,
                               memory_free_mib=self.free_mib, error=None)


def _plane(tmp_path: Path, nodes: list[NumbersNode], *, cluster: bool = True) -> Machines:
    repos = Repos(Database(tmp_path / "state.db"))
    repos.keys.add_account("acct", 100)
    return Machines(
        repos, {n.id: cast(Node, n) for n in nodes}, SnapshotStore(tmp_path / "snapshots"),
        cluster=cast(RayCluster, object()) if cluster else None,
    )


def _put(plane: Machines, node: str, n: int) -> list[MachineRecord]:
    acct = plane.repos.keys.account_id("acct")
    assert acct is not None
    return [plane.repos.machines.claim(
        acct, f"{node}-{i}-{len(plane.repos.machines.on_node(node))}",
        machine_id=f"m_{node}{i}{len(plane.repos.machines.on_node(node))}", vcpus=1,
        memory_mib=256, disk_gib=1, isolated=False, image="img", node_id=node, engine="qemu",
        default_quota=100) for i in range(n)]


def _ids(nodes: list[Any]) -> list[str]:
    return [n.id if not isinstance(n, Exception) else type(n).__name__ for n in nodes]


def test_a_new_machine_goes_to_the_node_with_most_free_memory_under_its_cap(
    tmp_path: Path
) -> None:
    a, b, c = NumbersNode("a", 2, 4000), NumbersNode("b", 2, 9000), NumbersNode("c", 2, 6000)
    plane = _plane(tmp_path, [a, b, c])
    assert _ids(asyncio.run(plane._place())) == ["b"]
    _put(plane, "b", 2)  # b is at its cap now
    assert _ids(asyncio.run(plane._place())) == ["c"]
    assert _ids(asyncio.run(plane._place(count=3))) == ["c", "c", "a"]
    # a node that holds what the machine needs comes first
    assert _ids(asyncio.run(plane._place(prefer={"a"}))) == ["a"]


def test_a_hint_names_a_node_that_has_room(tmp_path: Path) -> None:
    plane = _plane(tmp_path, [NumbersNode("a", 1, 100), NumbersNode("b", 1, 900)])
    assert _ids(asyncio.run(plane._place("a"))) == ["a"]
    with pytest.raises(NotFound) as bad:
        asyncio.run(plane._place("nope"))
    assert bad.value.details["field"] == "node"
    _put(plane, "a", 1)
    with pytest.raises(ResourceExhausted) as full:
        asyncio.run(plane._place("a"))
    assert "BOXD_NODE_MAX_MACHINES" in full.value.hint


def test_every_node_full_is_resource_exhausted(tmp_path: Path) -> None:
    plane = _plane(tmp_path, [NumbersNode("a", 1, 100), NumbersNode("b", 1, 900)])
    _put(plane, "a", 1)
    _put(plane, "b", 1)
    with pytest.raises(ResourceExhausted):
        asyncio.run(plane._place())


def test_fork_children_fill_the_source_node_first_then_spread(tmp_path: Path) -> None:
    a, b, c = NumbersNode("a", 3, 100), NumbersNode("b", 2, 900), NumbersNode("c", 2, 500)
    plane = _plane(tmp_path, [a, b, c])
    (src,) = _put(plane, "a", 1)  # 2 free slots on the source's node
    targets = asyncio.run(plane._fork_targets(src, cast(Node, a), 7))
    assert _ids(targets) == ["a", "a", "b", "b", "c", "c", "ResourceExhausted"]
    assert _ids(asyncio.run(plane._fork_targets(src, cast(Node, a), 2))) == ["a", "a"]
    # a node that received this source's template before comes before free memory
    plane._received[src.id] = {"c"}
    assert _ids(asyncio.run(plane._fork_targets(src, cast(Node, a), 5))) == [
        "a", "a", "c", "c", "b"]


def test_dead_nodes_take_nothing_and_their_machines_are_lost(tmp_path: Path) -> None:
    a, b = NumbersNode("a", 5, 100), NumbersNode("b", 5, 900)
    plane = _plane(tmp_path, [a, b])
    (on_b,) = _put(plane, "b", 1)
    b.alive = False
    assert _ids(asyncio.run(plane._place(count=2))) == ["a", "a"]
    assert plane.repos.machines.mark_lost("b", "its node b is gone") == [on_b.id]
    rec = plane.repos.machines.get(on_b.id)
    assert rec is not None and rec.state == MachineState.LOST
    with pytest.raises(NodeLost) as lost:
        plane._node(rec)
    assert lost.value.details["node"] == "b" and "delete" in lost.value.hint
    # a lost record is not overwritten by a late mirror of the node's view
    assert not plane.repos.machines.mirror(rec)


def test_one_host_has_no_caps(tmp_path: Path) -> None:
    plane = _plane(tmp_path, [NumbersNode("local", 1, 100)], cluster=False)
    _put(plane, "local", 3)
    assert _ids(asyncio.run(plane._place(count=2))) == ["local", "local"]
