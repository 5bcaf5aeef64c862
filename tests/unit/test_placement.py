"""The control plane's placement on a cluster: which node new machines and fork children
go to, and a launch that failed on a node retried on another (logic only: the nodes
here are fakes that answer `info()` from numbers and fail launches on request; the
real cluster is in tests/integration/test_cluster.py)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import pytest

from boxd import models
from boxd.control.nodes import Cluster, ClusterNode, LocalNode
from boxd.control.placement import LAUNCH_ATTEMPTS, MostFreeMemory, Placement, Room
from boxd.control.plane import Machines
from boxd.errors import (
    BoxdError,
    InvalidRequest,
    MachineFailed,
    NodeLost,
    NotFound,
    ResourceExhausted,
)
from boxd.models import MachineState
from boxd.node.base import Boot, FromSnapshot, Node
from boxd.node.lifecycle import Lifecycle
from boxd.state import Database, MachineRecord, Repos, RunImage
from boxd.storage import SnapshotStore
from boxd.storage.oci import ImageStore

SRC = Path(__file__).resolve().parents[2] / "src" / "boxd"


class NumbersNode:
    """A cluster node that is its capacity figures; its launches succeed (the record
    goes to ``running``) or raise ``fail`` (the record removed, as `Node.create` says)."""

    def __init__(self, node_id: str, cap: int, free_mib: int,
                 fail: BoxdError | None = None,
                 portable: frozenset[str] = frozenset({"qemu", "gvisor"}),
                 portable_images: frozenset[str] = frozenset({"gvisor"})) -> None:
        self.id = node_id
        self.portable = portable  # engines whose templates may leave this node
        self.portable_images = portable_images  # ... an image machine's too
        self.image_fail: BoxdError | None = None  # a push of an image here fails so
        self.events: list[str] = []  # images pushed and forks received, in order
        self.cap = cap
        self.free_mib = free_mib
        self.fail = fail
        self.alive = True
        self.address = "127.0.0.1"
        self.peer: object = self
        self.repos: Repos | None = None
        self.launched: list[str] = []  # machine ids this node was asked to launch

    async def info(self) -> models.NodeInfo:
        return models.NodeInfo(id=self.id, address=self.address, health="alive", machines=0,
                               max_machines=self.cap, memory_total_mib=8192,
                               memory_free_mib=self.free_mib, error=None)

    async def image_key(self) -> str:
        return "img"

    async def engine_name(self) -> str:
        return "qemu"

    async def create(self, machine_id: str, source: Boot | FromSnapshot,
                     holder: ClusterNode | None = None) -> None:
        assert self.repos is not None
        self.launched.append(machine_id)
        if self.fail is not None:
            self.repos.machines.delete(machine_id)
            raise self.fail
        Lifecycle(self.repos.machines).move(machine_id, MachineState.RUNNING)

    async def portable_templates(self, engine: str, image: bool = False) -> bool:
        return engine in self.portable and (not image or engine in self.portable_images)

    async def receive_image(self, store: ImageStore, digests: list[str]) -> None:
        assert all(store.has(d) for d in digests), "the control plane's store holds them"
        if self.image_fail is not None:
            raise self.image_fail
        self.events.append(f"image {digests[0]}")

    async def fork(self, source_id: str, child_ids: list[str]) -> list[Exception | None]:
        assert self.repos is not None
        self.launched += child_ids
        for cid in child_ids:
            Lifecycle(self.repos.machines).move(cid, MachineState.RUNNING)
        return [None] * len(child_ids)

    async def fork_from(self, source: ClusterNode, source_id: str,
                        child_ids: list[str]) -> list[Exception | None]:
        self.events.append(f"fork_from {source.id}")
        return await self.fork(source_id, child_ids)

    async def drop_received(self, source_id: str) -> None:
        self.events.append(f"drop_received {source_id}")

    async def delete(self, machine_id: str) -> None:
        assert self.repos is not None
        self.repos.machines.delete(machine_id)


class FakeCluster:
    def __init__(self, nodes: list[NumbersNode]) -> None:
        self._nodes = {n.id: n for n in nodes}

    @property
    def nodes(self) -> Mapping[str, ClusterNode]:
        return cast(Mapping[str, ClusterNode], self._nodes)

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def _conforms(cluster: FakeCluster) -> Cluster:
    return cluster  # mypy proves the fake is a Cluster


def _plane(tmp_path: Path, nodes: list[NumbersNode], *, cluster: bool = True,
           images: ImageStore | None = None) -> Machines:
    repos = Repos(Database(tmp_path / "state.db"))
    repos.keys.add_account("acct", 100)
    for n in nodes:
        n.repos = repos
    store = SnapshotStore(tmp_path / "snapshots")
    if not cluster:
        return Machines(repos, {n.id: cast(LocalNode, n) for n in nodes}, store)
    return Machines(repos, {}, store, cluster=FakeCluster(nodes), images=images)


def _acct(plane: Machines) -> str:
    acct = plane.repos.keys.account_id("acct")
    assert acct is not None
    return acct


def _put(plane: Machines, node: str, n: int) -> list[MachineRecord]:
    return [plane.repos.machines.claim(
        _acct(plane), f"{node}-{i}-{len(plane.repos.machines.on_node(node))}",
        machine_id=f"m_{node}{i}{len(plane.repos.machines.on_node(node))}", vcpus=1,
        memory_mib=256, disk_gib=1, isolated=False, image="img", node_id=node, engine="qemu",
        default_quota=100) for i in range(n)]


def _ids(nodes: list[Any]) -> list[str]:
    return [n.id if not isinstance(n, Exception) else type(n).__name__ for n in nodes]


def _new(plane: Machines, name: str = "m", node: str | None = None) -> models.Machine:
    return asyncio.run(plane.create(_acct(plane), models.MachineCreate(name=name, node=node)))


# ------------------------------------------------------------------ choosing


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
    targets = asyncio.run(plane.forks.targets(src, cast(Node, a), 7))
    assert _ids(targets) == ["a", "a", "b", "b", "c", "c", "ResourceExhausted"]
    assert _ids(asyncio.run(plane.forks.targets(src, cast(Node, a), 2))) == ["a", "a"]
    # a node that received this source's template before comes before free memory
    plane.forks.received[src.id] = {"c"}
    assert _ids(asyncio.run(plane.forks.targets(src, cast(Node, a), 5))) == [
        "a", "a", "c", "c", "b"]
    # the source deleted: the node that kept its template lets it go (it was told
    # nothing before, and kept the RAM file and layers until it restarted)
    asyncio.run(plane.delete(_acct(plane), src.id))
    assert c.events == [f"drop_received {src.id}"] and b.events == []
    assert src.id not in plane.forks.received


def test_a_fork_with_a_node_puts_every_child_on_that_node(tmp_path: Path) -> None:
    a, b = NumbersNode("a", 3, 100), NumbersNode("b", 2, 900)
    plane = _plane(tmp_path, [a, b, NumbersNode("c", 2, 5000)])
    (src,) = _put(plane, "a", 1)
    assert _ids(asyncio.run(plane.forks.targets(src, cast(Node, a), 2, "b"))) == ["b", "b"]
    # the source's own node: copy-on-write there, nowhere else
    assert _ids(asyncio.run(plane.forks.targets(src, cast(Node, a), 3, "a"))) == [
        "a", "a", "ResourceExhausted"]
    full = asyncio.run(plane.forks.targets(src, cast(Node, a), 3, "b"))[2]
    assert isinstance(full, ResourceExhausted) and "node b has no room" in str(full)
    with pytest.raises(NotFound) as bad:
        asyncio.run(plane.forks.targets(src, cast(Node, a), 1, "nope"))
    assert bad.value.details["field"] == "node"


def _source(plane: Machines, node: str, engine: str) -> MachineRecord:
    return plane.repos.machines.claim(
        _acct(plane), f"src-{engine}", machine_id=f"m_{engine}", vcpus=1, memory_mib=256,
        disk_gib=1, isolated=False, image="img", node_id=node, engine=engine,
        default_quota=100)


def test_a_gvisor_fork_batch_spreads_past_its_nodes_cap(tmp_path: Path) -> None:
    # issue 39 item 2: every child went to the source's node, past its cap
    a, b, c = NumbersNode("a", 2, 100), NumbersNode("b", 2, 900), NumbersNode("c", 2, 500)
    plane = _plane(tmp_path, [a, b, c])
    src = _source(plane, "a", "gvisor")  # 1 free slot left on a
    assert _ids(asyncio.run(plane.forks.targets(src, cast(Node, a), 5))) == [
        "a", "b", "b", "c", "c"]
    # a node named for the batch: its template moves there as a QEMU one does
    assert _ids(asyncio.run(plane.forks.targets(src, cast(Node, a), 2, "b"))) == ["b", "b"]


def test_a_batch_bigger_than_every_cap_gets_per_item_resource_exhausted(
    tmp_path: Path
) -> None:
    a, b = NumbersNode("a", 2, 100), NumbersNode("b", 2, 900)
    plane = _plane(tmp_path, [a, b])
    src = _source(plane, "a", "gvisor")
    out = asyncio.run(plane.fork(_acct(plane), src.id, [None] * 5))
    kids = [m for m in out if isinstance(m, models.Machine)]
    assert sorted(m.node or "" for m in kids) == ["a", "b", "b"]
    full = [e for e in out if isinstance(e, Exception)]
    assert len(full) == 2 and all(isinstance(e, ResourceExhausted) for e in full)
    assert "every node is at its machine cap (a 2 of 2, b 2 of 2" in str(full[0])
    assert "BOXD_NODE_MAX_MACHINES" in full[0].hint and "add a node" in full[0].hint
    # nothing was claimed for them: each node holds exactly its cap
    assert plane.repos.machines.count_by_node() == {"a": 2, "b": 2}


def test_concurrent_fork_batches_keep_every_cap(tmp_path: Path) -> None:
    a, b = NumbersNode("a", 3, 100), NumbersNode("b", 2, 900)
    plane = _plane(tmp_path, [a, b])
    src = _source(plane, "a", "gvisor")  # 4 slots left in all

    async def both() -> list[models.Machine | Exception]:
        one, two = await asyncio.gather(plane.fork(_acct(plane), src.id, [None] * 3),
                                        plane.fork(_acct(plane), src.id, [None] * 3))
        return [*one, *two]

    out = asyncio.run(both())
    assert sum(isinstance(m, models.Machine) for m in out) == 4
    assert sum(isinstance(e, ResourceExhausted) for e in out) == 2
    assert plane.repos.machines.count_by_node() == {"a": 3, "b": 2}


def test_forks_whose_template_cannot_move_keep_their_nodes_cap(tmp_path: Path) -> None:
    # an engine that cannot move a template: its children stay, up to the node's cap
    a = NumbersNode("a", 3, 100, portable=frozenset())
    plane = _plane(tmp_path, [a, NumbersNode("b", 2, 900)])
    src = _source(plane, "a", "fake")
    targets = asyncio.run(plane.forks.targets(src, cast(Node, a), 4))
    assert _ids(targets) == ["a", "a", "ResourceExhausted", "ResourceExhausted"]
    err = targets[2]
    assert isinstance(err, ResourceExhausted) and err.details["node"] == "a"
    assert err.details["cap"] == 3
    assert "node a has no room for this fork child: it is at its machine cap (3 of 3" \
        in err.message and "fake machine's forks stay on its node" in err.message
    assert "delete machines on node a" in err.hint
    with pytest.raises(InvalidRequest) as bad:
        asyncio.run(plane.forks.targets(src, cast(Node, a), 1, "b"))
    assert "fake machine's forks stay on its node (a)" in str(bad.value)
    assert bad.value.details["field"] == "node" and "--node" in bad.value.hint
    own = asyncio.run(plane.forks.targets(src, cast(Node, a), 3, "a"))
    assert _ids(own) == ["a", "a", "ResourceExhausted"]
    assert "another node" not in own[2].hint  # type: ignore[union-attr]
    # one host: its own id is the only node a fork may name
    one = NumbersNode("h", 4, 100)
    (tmp_path / "one").mkdir()
    host = _plane(tmp_path / "one", [one], cluster=False)
    (m,) = _put(host, "h", 1)
    assert _ids(asyncio.run(host.forks.targets(m, cast(Node, one), 1, "h"))) == ["h"]
    with pytest.raises(NotFound):
        asyncio.run(host.forks.targets(m, cast(Node, one), 1, "b"))


def _image_source(plane: Machines, tmp_path: Path, node: str, engine: str) -> MachineRecord:
    """A machine of a container image imported into the control plane's store."""
    from tests._support.oci import make_image, write_layout

    from boxd.images.oci import import_image

    assert plane.images is not None
    img = make_image([{"srv/hello.txt": b"from the image\n"}])
    import_image(plane.images, f"oci:{write_layout(tmp_path / 'layout', {'v1': img})}:v1",
                 f"{_acct(plane)}/it/x:v1")
    return plane.repos.machines.claim(
        _acct(plane), f"img-{engine}", machine_id=f"m_img_{engine}", vcpus=1,
        memory_mib=256, disk_gib=1, isolated=False, image="img", node_id=node,
        engine=engine, default_quota=100, run_image=RunImage("it/x:v1", img.digest))


def test_an_image_machines_forks_spread_and_each_node_gets_the_image_first(
    tmp_path: Path
) -> None:
    # issue 41: an image machine's forks stayed on its node (its template named the
    # image's tree there); now they spread as any machine's, each other node pushed
    # the image before it receives the template
    a, b, c = NumbersNode("a", 2, 100), NumbersNode("b", 2, 900), NumbersNode("c", 2, 500)
    plane = _plane(tmp_path, [a, b, c], images=ImageStore(tmp_path / "images"))
    src = _image_source(plane, tmp_path, "a", "gvisor")  # 1 free slot left on a
    digest = src.run_image.digest  # type: ignore[union-attr]
    assert _ids(asyncio.run(plane.forks.targets(src, cast(Node, a), 5))) == [
        "a", "b", "b", "c", "c"]
    assert _ids(asyncio.run(plane.forks.targets(src, cast(Node, a), 2, "b"))) == ["b", "b"]
    out = asyncio.run(plane.fork(_acct(plane), src.id, [None] * 5))
    assert all(isinstance(m, models.Machine) for m in out), out
    assert sorted(m.node or "" for m in out) == ["a", "b", "b", "c", "c"]  # type: ignore[union-attr]
    assert all(m.image is not None and m.image.digest == digest  # type: ignore[union-attr]
               for m in out)
    assert a.events == []  # the source's node holds the image: nothing pushed there
    for n in (b, c):
        assert n.events == [f"image {digest}", "fork_from a"], n.events
    # a node that cannot get the image: its children's items are that error, no record
    # of them is left; the other nodes' children run
    for m in out:
        asyncio.run(plane.delete(_acct(plane), m.id))  # type: ignore[union-attr]
    b.events.clear()
    c.image_fail = NodeLost("node c is gone", node="c")
    out = asyncio.run(plane.fork(_acct(plane), src.id, [None] * 5))
    kids = [m for m in out if isinstance(m, models.Machine)]
    assert sorted(m.node or "" for m in kids) == ["a", "b", "b"]
    failed = [e for e in out if isinstance(e, Exception)]
    assert len(failed) == 2 and all(isinstance(e, NodeLost) for e in failed), failed
    assert plane.repos.machines.count_by_node() == {"a": 2, "b": 2}
    assert "fork_from c" not in c.events


def test_an_image_machine_whose_engine_cannot_move_its_template_forks_on_its_node(
    tmp_path: Path
) -> None:
    # QEMU packs an image's tree into an ext4 disk on each node, not byte for byte the
    # same: a layer written over one node's would corrupt another's
    a, b = NumbersNode("a", 3, 100), NumbersNode("b", 2, 900)
    plane = _plane(tmp_path, [a, b], images=ImageStore(tmp_path / "images"))
    src = _image_source(plane, tmp_path, "a", "qemu")
    targets = asyncio.run(plane.forks.targets(src, cast(Node, a), 3))
    assert _ids(targets) == ["a", "a", "ResourceExhausted"]
    assert "the forks of a qemu machine of a container image stay on its node (the qemu " \
        "engine cannot move the template of a container image's machine" \
        in targets[2].message  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest) as bad:
        asyncio.run(plane.forks.targets(src, cast(Node, a), 1, "b"))
    assert "stay on its node (a)" in str(bad.value)
    assert "container image" in str(bad.value) and bad.value.details["field"] == "node"
    # a QEMU machine of the default image still spreads
    plain = _source(plane, "a", "qemu")
    assert _ids(asyncio.run(plane.forks.targets(plain, cast(Node, a), 3))) == [
        "a", "b", "b"]


def test_the_chooser_is_an_interface() -> None:
    room = {"a": Room(2, 100), "b": Room(0, 9000), "c": Room(1, 500)}
    assert MostFreeMemory().rank(room, ()) == ["b", "c", "a"]
    assert Placement().choose(room, 3) == ["c", "a", "a"]  # b has no slot
    assert Placement().choose(room, 1, exclude={"c"}) == ["a"]

    class Alphabetical:
        def rank(self, room: Mapping[str, Room], prefer: Any) -> list[str]:
            return sorted(room)

    assert Placement(Alphabetical()).choose(room, 3) == ["a", "a", "c"]
    with pytest.raises(ResourceExhausted):
        Placement().choose(room, 1, hint="c", exclude={"c"})


def test_one_host_has_no_caps(tmp_path: Path) -> None:
    plane = _plane(tmp_path, [NumbersNode("local", 1, 100)], cluster=False)
    _put(plane, "local", 3)
    assert _ids(asyncio.run(plane._place(count=2))) == ["local", "local"]


# ----------------------------------------------------------- launch retries


def test_a_launch_that_failed_on_a_node_is_retried_without_that_node(tmp_path: Path) -> None:
    bad = NumbersNode("bad", 5, 9000, fail=MachineFailed("the VM exited while booting"))
    good = NumbersNode("good", 5, 100)
    plane = _plane(tmp_path, [bad, good])
    m = _new(plane, "retried")
    assert m.node == "good" and m.name == "retried" and m.state == "running"
    assert len(bad.launched) == 1 and len(good.launched) == 1  # bad was not asked again
    # one record, the name claimed once more on the node that took it
    assert [r.name for r in plane.repos.machines.list(_acct(plane))] == ["retried"]
    # a lost node (the actor died mid-launch) is excluded the same way
    bad.fail = NodeLost("node bad is gone", node="bad")
    assert _new(plane, "again").node == "good"


def test_a_launch_failing_on_every_node_tried_raises_the_nodes_error(tmp_path: Path) -> None:
    nodes = [NumbersNode(f"n{i}", 5, 1000 * (i + 1), fail=MachineFailed(f"boom on n{i}"))
             for i in range(LAUNCH_ATTEMPTS + 1)]
    plane = _plane(tmp_path, nodes)
    with pytest.raises(MachineFailed) as err:
        _new(plane)
    # most free memory first: the last nodes are tried first
    tried = [n.id for n in reversed(nodes) if n.launched]
    assert tried == [n.id for n in reversed(nodes)][:LAUNCH_ATTEMPTS], "the cap on nodes tried"
    assert all(len(n.launched) <= 1 for n in nodes), "no node twice"
    assert str(err.value) == f"boom on {tried[-1]}"  # the last attempt's error
    assert plane.repos.machines.list(_acct(plane)) == []  # no record left behind


def test_when_no_other_node_has_room_the_launch_error_stands(tmp_path: Path) -> None:
    bad = NumbersNode("bad", 5, 9000, fail=MachineFailed("the VM exited while booting"))
    full = NumbersNode("full", 1, 100)
    plane = _plane(tmp_path, [bad, full])
    _put(plane, "full", 1)
    with pytest.raises(MachineFailed):  # not ResourceExhausted: the launch's own error
        _new(plane)


def test_request_errors_and_hinted_launches_are_not_retried(tmp_path: Path) -> None:
    bad = NumbersNode("bad", 5, 9000, fail=InvalidRequest("bad input"))
    good = NumbersNode("good", 5, 100)
    plane = _plane(tmp_path, [bad, good])
    with pytest.raises(InvalidRequest):  # bad input fails on every node
        _new(plane)
    assert good.launched == []
    bad.fail = MachineFailed("the VM exited while booting")
    with pytest.raises(MachineFailed):  # the caller pinned the node
        _new(plane, node="bad")
    assert good.launched == []


def test_one_host_launches_once(tmp_path: Path) -> None:
    local = NumbersNode("local", 5, 100, fail=MachineFailed("the VM exited while booting"))
    plane = _plane(tmp_path, [local], cluster=False)
    with pytest.raises(MachineFailed):
        _new(plane)
    assert len(local.launched) == 1


# ---------------------------------------------------------------- node loss


def test_dead_nodes_take_nothing_and_their_machines_are_lost(tmp_path: Path) -> None:
    a, b = NumbersNode("a", 5, 100), NumbersNode("b", 5, 900)
    plane = _plane(tmp_path, [a, b])
    (on_b,) = _put(plane, "b", 1)
    b.alive = False
    assert _ids(asyncio.run(plane._place(count=2))) == ["a", "a"]
    lifecycle = Lifecycle(plane.repos.machines)
    assert lifecycle.mark_lost("b", "its node b is gone") == [on_b.id]
    assert lifecycle.mark_lost("b", "again") == []  # lost already
    rec = plane.repos.machines.get(on_b.id)
    assert rec is not None and rec.state == MachineState.LOST
    with pytest.raises(NodeLost) as lost:
        plane._node(rec)
    assert lost.value.details["node"] == "b" and "delete" in lost.value.hint
    # a lost record is not overwritten by a late mirror of the node's view
    assert not lifecycle.mirror(rec.__class__(**{**rec.__dict__, "state": MachineState.RUNNING}))
    fresh = plane.repos.machines.get(on_b.id)
    assert fresh is not None and fresh.state == MachineState.LOST


def test_the_mirror_copies_the_nodes_truth_but_keeps_deleting(tmp_path: Path) -> None:
    plane = _plane(tmp_path, [NumbersNode("a", 5, 100)])
    (rec,) = _put(plane, "a", 1)
    lifecycle = Lifecycle(plane.repos.machines)
    node_view = rec.__class__(**{**rec.__dict__, "state": MachineState.SUSPENDED, "port": 4242})
    assert lifecycle.mirror(node_view)
    copy = plane.repos.machines.get(rec.id)
    assert copy is not None and copy.state == MachineState.SUSPENDED and copy.port == 4242
    assert lifecycle.move(rec.id, MachineState.DELETING)
    assert not lifecycle.mirror(node_view)
    copy = plane.repos.machines.get(rec.id)
    assert copy is not None and copy.state == MachineState.DELETING


def test_a_node_adopts_the_control_planes_claim(tmp_path: Path) -> None:
    plane = _plane(tmp_path, [NumbersNode("a", 5, 100)])
    (rec,) = _put(plane, "a", 1)
    node_repos = Repos(Database(tmp_path / "node.db"))
    Lifecycle(node_repos.machines).adopt(rec, 7)
    got = node_repos.machines.get(rec.id)
    assert got is not None and got.state == MachineState.STARTING and got.name == rec.name
    assert node_repos.accounts.get(rec.account_id) is not None
    # a container image's machine: the node boots the image because its copy says so
    run = RunImage("it/x:v1", "sha256:" + "a" * 64, env=("A=1",), working_dir="/srv")
    img = plane.repos.machines.claim(
        _acct(plane), "img-1", machine_id="m_img1", vcpus=1, memory_mib=256, disk_gib=1,
        isolated=False, image="img", node_id="a", engine="gvisor", default_quota=100,
        run_image=run)
    Lifecycle(node_repos.machines).adopt(img, 7)
    got = node_repos.machines.get(img.id)
    assert got is not None and got.run_image == run


def test_the_control_plane_asks_no_node_what_kind_it_is() -> None:
    for path in (SRC / "control").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"isinstance\([^)]*(RayNode|NodeRuntime)", text), path
        assert not re.search(r"getattr\((node|n|target|holder)\b", text), path
    state = (SRC / "state" / "repos.py").read_text()
    assert "SET state='lost'" not in state  # LOST goes through Lifecycle.mark_lost
