"""boxd on a Ray cluster: three Ray nodes on this machine, one boxd control plane.

Ray, its nodes, the control plane and every VM run in a network namespace of the
test's own that has only ``lo`` and a veth pair with both ends inside (Ray advertises
its TEST-NET-2 address, passt has a route to start on, and nothing leaves the
namespace); the test talks to the control plane over its unix socket, which a network
namespace does not fence. Each node caps at two machines, so a batch of five forks
must spread over all three nodes.

The scale-out tests run on both engines (`ON_BOTH`): QEMU, and gVisor, which ``auto``
picks where KVM is missing (issue 39: its fork batches stayed on the source's node,
past its cap). Each engine gets a cluster of its own, one after the other.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from boxd import errors
from tests._support.bench import load

pytest.importorskip("ray", reason="the cluster tests need Ray (pip install 'boxd[ray]')")
if os.geteuid() != 0 or shutil.which("ip") is None:
    pytest.skip("the cluster tests make a network namespace: they need root and `ip`",
                allow_module_level=True)

_cluster = load("_cluster")
LocalCluster, local_cluster, qemu_pids = _cluster.LocalCluster, _cluster.local_cluster, \
    _cluster.qemu_pids
pytestmark = pytest.mark.vm

CAP = 2  # BOXD_NODE_MAX_MACHINES for this cluster
ECHO = (  # a process that sends back every frame it gets (4-byte length, then the body)
    "import sys\n"
    "r, w = sys.stdin.buffer, sys.stdout.buffer\n"
    "while True:\n"
    "    h = r.read(4)\n"
    "    if len(h) < 4: break\n"
    "    body = r.read(int.from_bytes(h, 'big'))\n"
    "    w.write(h + body); w.flush()\n"
)


def _on(*engines: str) -> pytest.MarkDecorator:
    """Run a test on a cluster of each of ``engines`` (the module's clusters)."""
    return pytest.mark.parametrize("cluster", engines, indirect=True, scope="module")


ON_BOTH = _on("qemu", "gvisor")
ON_QEMU = _on("qemu")


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    engine: str = request.param
    with local_cluster(nodes=3, cap=CAP, BOXD_ENGINE=engine) as c:
        yield c


@pytest.fixture(scope="module")
def base(cluster: LocalCluster) -> Any:
    """A booted machine running a process that holds a random value in its memory and
    keeps writing it to /dev/shm/value (by rename: a snapshot or fork taken at any
    instant sees the whole value, never a file just truncated)."""
    b = cluster.client
    m = b.machines.new("base", suspend_after=0, hibernate_after=0)
    m = b.machines.wait_until_ready(m.id, timeout=300)
    assert m.engine == cluster.env["BOXD_ENGINE"]
    b.machines.exec(m.id, "nohup sh -c 'v=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d \" \");"
                          " while :; do echo $v > /dev/shm/v.tmp; mv /dev/shm/v.tmp /dev/shm/value;"
                          " sleep 0.2; done' "
                          ">/dev/null 2>&1 &")
    for _ in range(50):
        if b.machines.exec(m.id, "cat /dev/shm/value").stdout.strip():
            break
        time.sleep(0.2)
    return m


def _value_from_memory(b: Any, machine_id: str) -> str:
    """The value the base's process holds in memory (the file is removed first, so only
    the running process can write it back)."""
    r = b.machines.exec(machine_id, "rm -f /dev/shm/value; sleep 1; cat /dev/shm/value",
                        timeout=120)
    assert r.exit_code == 0, r.stderr
    return str(r.stdout.strip())


@ON_QEMU
def test_control_plane_sees_three_nodes_with_their_own_data(cluster: LocalCluster) -> None:
    nodes = cluster.client.nodes.list()
    assert sorted(n.id for n in nodes) == sorted(cluster.node_ids)
    # the namespace's one address (bench/_cluster.py): Ray's node address, and the URLs'
    assert all(n.address == cluster.address.rsplit(":", 1)[0] for n in nodes)
    assert all(n.health == "alive" and n.max_machines == CAP for n in nodes)
    for nid in cluster.node_ids:  # each node runtime has a directory (and database) of its own
        assert (cluster.node_home(nid) / "state.db").exists()


@ON_BOTH
def test_batch_fork_spreads_over_nodes_with_the_same_memory(
    cluster: LocalCluster, base: Any
) -> None:
    b = cluster.client
    want = _value_from_memory(b, base.id)
    token = os.urandom(8).hex()  # a file written in the source just before the fork
    assert b.machines.exec(base.id, f"echo {token} > /var/tmp/before-fork").exit_code == 0
    children = b.machines.fork(base.id, count=2 * CAP + 1)  # more than one node holds
    assert all(not isinstance(c, Exception) for c in children), children
    nodes = {c.node for c in children}
    assert nodes == set(cluster.node_ids), "five children on three nodes of two slots each"
    on = {n: sum(c.node == n for c in children) for n in cluster.node_ids}
    assert on[base.node] == CAP - 1 and all(k <= CAP for k in on.values()), on
    for c in children:
        assert c.node is not None and c.state == "running" and c.engine == base.engine
        assert b.machines.exec(c.id, "cat /var/tmp/before-fork").stdout.strip() == token
        assert _value_from_memory(b, c.id) == want, f"child on node {c.node[:8]}"
    # Files go both ways on a child of another node (streamed through its node actor).
    far = next(c for c in children if c.node != base.node)
    blob = os.urandom(3 << 20)
    assert b.machines.files.upload(far.id, "/tmp/blob", blob).size == len(blob)
    assert b.machines.files.download(far.id, "/tmp/blob") == blob
    # The receiving nodes keep the template: a second fork there is copy-on-write again.
    for c in children:
        b.machines.delete(c.id)
    again = b.machines.fork(base.id, count=2 * CAP + 1)
    assert {c.node for c in again if not isinstance(c, Exception)} == set(cluster.node_ids)
    logs = "".join((cluster.node_home(n) / "daemon.log").read_text() for n in cluster.node_ids)
    assert logs.count("event=received") == 2, "each other node received the template once"
    for c in again:
        b.machines.delete(c.id)


@ON_BOTH
def test_a_batch_bigger_than_every_cap_gets_per_item_resource_exhausted(
    cluster: LocalCluster, base: Any
) -> None:
    b = cluster.client
    free = 3 * CAP - 1  # the base takes a slot of its node
    out = b.machines.fork(base.id, count=free + 2)
    try:
        kids = [c for c in out if not isinstance(c, Exception)]
        assert len(kids) == free, out
        on = {n: sum(c.node == n for c in kids) for n in cluster.node_ids}
        assert on == {n: CAP - (n == base.node) for n in cluster.node_ids}
        full = [e for e in out if isinstance(e, Exception)]
        assert len(full) == 2 and all(isinstance(e, errors.ResourceExhausted) for e in full)
        assert "no node has room for this fork child" in full[0].message
        assert f"2 of {CAP}" in full[0].message and "BOXD_NODE_MAX_MACHINES" in full[0].hint
        for c in kids:  # the other items went on: their children run
            assert b.machines.exec(c.id, "echo ok").stdout == "ok\n"
    finally:
        for c in out:
            if not isinstance(c, Exception):
                b.machines.delete(c.id)


@ON_BOTH
def test_a_fork_named_to_a_node_lands_there_with_the_same_memory(
    cluster: LocalCluster, base: Any
) -> None:
    b = cluster.client
    want = _value_from_memory(b, base.id)
    far = next(n for n in cluster.node_ids if n != base.node)
    kid = b.machines.fork(base.id, "pinned", node=far)
    try:
        assert kid.node == far and kid.state == "running"
        assert _value_from_memory(b, kid.id) == want
        # a batch with a node: every child there, however much room the source's node has
        (one,) = b.machines.fork(base.id, count=1, node=far)
        assert not isinstance(one, Exception) and one.node == far
        b.machines.delete(one.id)
        with pytest.raises(errors.NotFound, match="no node 'nowhere'"):
            b.machines.fork(base.id, node="nowhere")
    finally:
        b.machines.delete(kid.id)


@ON_QEMU
def test_snapshot_taken_on_one_node_starts_on_another(
    cluster: LocalCluster, base: Any, tmp_path: Path
) -> None:
    from boxd import errors

    b = cluster.client
    b.machines.exec(base.id, "echo on-disk > /root/disk.txt; sync")
    snap = b.snapshots.save(base.id, "warm")
    other, third = [n for n in cluster.node_ids if n != base.node][:2]
    m = b.machines.new("from-warm", from_snapshot="warm", node=other)
    assert m.node == other and m.snapshot == snap.digest.removeprefix("sha256:")
    assert b.machines.exec(m.id, "cat /dev/shm/value").stdout.strip()
    assert _value_from_memory(b, m.id) == _value_from_memory(b, base.id)
    # its fork on a node that never held the snapshot sits on the snapshot's disk too
    # (before: its bottom layer was re-pointed at that node's bare guest root)
    kid = b.machines.fork(m.id, "from-warm-kid", node=third)
    assert kid.node == third
    read = "echo 3 > /proc/sys/vm/drop_caches; cat /root/disk.txt"  # from disk, not RAM
    assert b.machines.exec(kid.id, read).stdout == "on-disk\n"
    kept = cluster.node_home(third) / "received-roots"
    assert len(list(kept.glob("disk.*.qcow2"))) == 1  # the snapshot's disk came along
    b.machines.delete(kid.id)
    b.machines.delete(m.id)
    # ... and goes with the last layer on it: the template the node kept of its source
    # goes when the source is deleted (before: kept until the node restarted)
    assert not list(kept.glob("disk.*.qcow2"))
    # export pulls the blobs from a node; import is not offered on a cluster yet
    out = tmp_path / "warm.boxd"
    b.snapshots.export("warm", out)
    assert out.stat().st_size > 0
    with pytest.raises(errors.InvalidRequest):
        b.snapshots.import_(out, name="warm-again")
    b.snapshots.delete("warm")  # ... and the nodes drop its blobs
    for nid in cluster.node_ids:
        assert not list((cluster.node_home(nid) / "snapshots" / "manifests").glob("*.json"))


@ON_QEMU
def test_a_restarted_control_plane_finds_its_nodes_and_machines(
    cluster: LocalCluster, base: Any
) -> None:
    (kid,) = cluster.client.machines.fork(base.id, count=1)
    before = {m.id: m.node for m in cluster.client.machines.list()}
    cluster.restart_control_plane()
    b = cluster.client
    assert {m.id: m.node for m in b.machines.list()} == before
    assert sorted(n.id for n in b.nodes.list() if n.health == "alive") == sorted(cluster.node_ids)
    assert b.machines.exec(kid.id, "echo ok").stdout == "ok\n"  # its VM kept running
    # a process's framed channel works through the control plane and the node actor
    b.machines.files.upload(kid.id, "/home/boxd/echo.py", ECHO)
    proc = b.machines.spawn(kid.id, ["python3", "-u", "/home/boxd/echo.py"])
    for payload in (b"", b"x" * 100, os.urandom(200_000)):
        proc.send(payload)
        assert proc.recv(timeout=120) == payload
    assert [p.id for p in b.machines.processes(kid.id)] == [proc.id]
    proc.kill()
    assert _value_from_memory(b, kid.id) == _value_from_memory(b, base.id)
    b.machines.delete(kid.id)


@_on("gvisor")
def test_a_durable_exec_is_read_through_the_control_plane(
    cluster: LocalCluster, base: Any
) -> None:
    """The exec's record lives on its machine's node (in memory and in that node's data
    directory); exec_result reaches it through the control plane and the node actor,
    also while the exec runs."""
    import threading

    b = cluster.client
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(b.machines.exec(
        base.id, "sleep 1; echo durable", exec_id="cluster-1")), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            st = b.machines.exec_result(base.id, "cluster-1")
            break
        except errors.ExecNotFound:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert st.running
    st = b.machines.exec_result(base.id, "cluster-1", wait=60)
    assert (st.running, st.stdout, st.exit_code) == (False, "durable\n", 0), st
    t.join(60)
    assert done and done[0].exec_id == "cluster-1"
    kept = cluster.node_home(b.machines.get(base.id).node) / "execs" / base.id / "cluster-1.json"
    assert kept.stat().st_mode & 0o777 == 0o600, kept  # what a restarted node actor loads
    with pytest.raises(errors.ExecNotFound):
        b.machines.exec_result(base.id, "no-such-exec")


@_on("gvisor")
def test_the_fleet_controls_hold_on_a_cluster(cluster: LocalCluster, base: Any) -> None:
    """Labels, idempotency keys, lifetimes and the admission queue are the control
    plane's: on a cluster they act on machines of every node, a fork that finds every
    node full waits for room (no 429), and a restarted control plane keeps deadlines."""
    import threading

    b = cluster.client
    run = {"run": "fleet-1"}
    first = b.machines.fork(base.id, count=3, labels=run, idempotency_key="fleet-a")
    assert all(not isinstance(c, Exception) for c in first), first
    again = b.machines.fork(base.id, count=3, labels=run, idempotency_key="fleet-a")
    assert [c.id for c in again] == [c.id for c in first]  # type: ignore[union-attr]
    kids = [c for c in first if not isinstance(c, Exception)]
    assert len({c.node for c in kids} | {base.node}) >= 2  # they span nodes
    assert {m.id for m in b.machines.list(labels=run)} == {c.id for c in kids}
    assert all(m.labels == run for m in b.machines.list(labels=run))
    fillers = []  # every node's CAP slots taken: a fork without wait is refused at once
    with pytest.raises(errors.ResourceExhausted):
        for _ in range(3 * CAP):
            fillers.append(b.machines.fork(base.id, labels=run))
    assert len(b.machines.list()) == 3 * CAP
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(
        b.machines.fork(base.id, "queued", labels=run, wait=120)), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 30
    while b.info().queue.waiting < 1:  # it waits in the control plane's queue
        assert time.monotonic() < deadline and not got, got
        time.sleep(0.1)
    b.machines.delete(fillers.pop().id)  # room: the queued fork takes it
    waiter.join(120)
    assert got and got[0].name == "queued" and got[0].labels == run, got
    assert b.machines.exec(got[0].id, "echo ok").stdout == "ok\n"
    # a lifetime set before a control-plane restart ends the machine after it
    short = b.machines.set_timeout(kids[0].id, 20)
    assert short.end_at is not None
    cluster.restart_control_plane()
    b = cluster.client
    assert b.machines.get(kids[0].id).end_at == short.end_at
    deadline = time.monotonic() + 90
    while kids[0].id in {m.id for m in b.machines.list(labels=run)}:
        assert time.monotonic() < deadline, "the deadline was not kept across the restart"
        time.sleep(0.5)
    # a crashed run's cleanup: one call, every node's machines of the run, not the base
    out = b.machines.delete_many(run)
    assert not out.errors, out.errors
    assert {d.id for d in out.deleted} == {c.id for c in kids[1:] + fillers} | {got[0].id}
    assert b.machines.list(labels=run) == []
    assert b.machines.exec(base.id, "echo ok").stdout == "ok\n"


@ON_BOTH
def test_an_image_machine_starts_on_any_node(cluster: LocalCluster, tmp_path: Path) -> None:
    """The image store is the control plane's: a node that runs an image's machine gets
    the image's blobs pushed once (verified there) and unpacks them; a fork goes to its
    source's node while that has room (copy-on-write there); a snapshot of one starts
    on any node, which gets the image and the snapshot's blobs first and runs it on its
    own tree of the image (gVisor; QEMU's snapshot disk holds the whole image)."""
    from tests._support.oci import make_image, write_layout

    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("no busybox on this host (Debian's busybox-static); "
                    "tests/integration/test_image_machines.py covers images on one host")
    bb = Path(busybox).read_bytes()
    img = make_image([{"bin/busybox": bb, "bin/sh": bb, "srv/hello.txt": b"from the image\n"}],
                     config={"Env": ["PATH=/bin", "WHO=cluster"], "WorkingDir": "/srv"})
    b = cluster.client
    b.images.import_(f"oci:{write_layout(tmp_path / 'layout', {'v1': img})}:v1", "it/bb:v1")
    busy = {m.node for m in b.machines.list()}
    free = [n for n in cluster.node_ids if n not in busy]  # the base may hold one
    assert len(free) >= 2, busy
    made = []
    try:
        for nid in free[:2]:
            m = b.machines.new(image="it/bb:v1", node=nid)
            made.append(m.id)
            assert m.node == nid and m.image is not None and m.image.digest == img.digest
            r = b.machines.exec(m.id, "cat hello.txt; echo $WHO; pwd")
            assert r.stdout == "from the image\ncluster\n/srv\n", r
            store = cluster.node_home(nid) / "oci" / "blobs" / "sha256"
            assert {p.name for p in store.iterdir()} >= {
                d[7:] for d in img.blobs()}, "the node holds the image's blobs"
        (kid,) = b.machines.fork(made[0], count=1)
        assert not isinstance(kid, Exception), kid
        made.append(kid.id)
        assert kid.node == free[0]  # the source's node first, as any machine's
        assert b.machines.exec(kid.id, "cat hello.txt").stdout == "from the image\n"
        # its snapshot starts on the node that saved it, and on one that did not
        b.machines.exec(made[1], "echo changed > /srv/state.txt")
        b.snapshots.save(made[1], "bb-snap")
        b.machines.delete(made.pop(0))  # room on free[0] (it holds the fork) for one more
        for nid in (free[0], free[1]):
            again = b.machines.new(from_snapshot="bb-snap", node=nid)
            made.append(again.id)
            assert again.node == nid and again.image is not None
            assert again.image.digest == img.digest
            r = b.machines.exec(again.id, "cat hello.txt state.txt; echo $WHO; pwd")
            assert r.stdout == "from the image\nchanged\ncluster\n/srv\n", (nid, r)
        b.snapshots.delete("bb-snap")  # while machines run from it: their nodes keep it
    finally:
        for mid in made:
            b.machines.delete(mid)
        b.images.remove("it/bb:v1")
    # ... until the last of them goes (before: kept for good, and the image it ran)
    for nid in cluster.node_ids:
        assert not list((cluster.node_home(nid) / "snapshots" / "manifests").glob("*.json"))


@ON_BOTH
def test_an_image_machines_forks_spread_over_nodes_on_their_own_trees(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Issue 41 item 4: an image machine forks as any machine does. Children past its
    node's room go to other nodes, which get the image pushed first and restore the
    template on their own tree of it (gVisor), or on the source node's disks of it that
    came along (QEMU: each node packs its own, byte for byte different); each child sees
    the image's files (not boxd's Debian root) and what the source wrote before the
    fork, and a child on another node forks there in turn."""
    from tests._support.oci import make_image, write_layout

    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("no busybox on this host (Debian's busybox-static)")
    bb = Path(busybox).read_bytes()
    img = make_image([{"bin/busybox": bb, "bin/sh": bb,
                       "srv/hello.txt": b"from the spread image\n"}],
                     config={"Env": ["PATH=/bin", "WHO=spread"], "WorkingDir": "/srv"})
    b = cluster.client
    b.images.import_(f"oci:{write_layout(tmp_path / 'layout', {'v1': img})}:v1",
                     "it/spread:v1")
    busy = [m.node for m in b.machines.list()]
    home = next(n for n in cluster.node_ids if n not in busy)  # the base may hold one
    src = b.machines.new(image="it/spread:v1", node=home)
    made = [src.id]
    check = "cat hello.txt; echo $WHO; pwd; cat state.txt; ls /usr/bin 2>/dev/null | wc -l"
    want = "from the spread image\nspread\n/srv\nbefore the fork\n0\n"
    try:
        b.machines.exec(src.id, "echo 'before the fork' > /srv/state.txt")
        room = CAP - 1  # the source takes one of its node's slots
        kids = b.machines.fork(src.id, count=room + 2)  # more than its node holds
        made += [c.id for c in kids if not isinstance(c, Exception)]
        assert all(not isinstance(c, Exception) for c in kids), kids
        assert sum(c.node == home for c in kids) == room, kids  # type: ignore[union-attr]
        far = [c for c in kids if c.node != home]  # type: ignore[union-attr]
        assert len(far) == 2, kids
        for c in kids:
            assert c.image is not None and c.image.digest == img.digest  # type: ignore[union-attr]
            r = b.machines.exec(c.id, check)  # type: ignore[union-attr]
            assert r.stdout == want, (c.node, r)  # type: ignore[union-attr]
        for c in far:  # the node got the image, then the template, on its own tree
            assert c.node is not None
            store = cluster.node_home(c.node) / "oci" / "blobs" / "sha256"
            assert {p.name for p in store.iterdir()} >= {d[7:] for d in img.blobs()}
            assert (cluster.node_home(c.node) / "oci-roots" / img.digest[7:]).is_dir()
            log = (cluster.node_home(c.node) / "daemon.log").read_text()
            assert f"source={src.id} event=fork_from" in log
            if cluster.env["BOXD_ENGINE"] == "qemu":  # the source node's disks, kept here
                disks = cluster.node_home(c.node) / "oci-disks"
                assert any(len(p.name.split(".")) == 3 for p in disks.iterdir()), \
                    sorted(p.name for p in disks.iterdir())
                assert "event=root_received" in log
        # a child on another node forks in turn (room made for it)
        for c in kids:
            if c is not far[0]:
                b.machines.delete(c.id)  # type: ignore[union-attr]
                made.remove(c.id)  # type: ignore[union-attr]
        (grand,) = b.machines.fork(far[0].id, count=1)
        assert not isinstance(grand, Exception), grand
        made.append(grand.id)
        assert grand.image is not None and grand.image.digest == img.digest
        assert b.machines.exec(grand.id, check).stdout == want
    finally:
        for mid in made:
            b.machines.delete(mid)
        b.images.remove("it/spread:v1")
    # nothing runs it and its name is gone: every node's copies go with it (blobs,
    # trees, disks: the ones received from another node too)
    for nid in cluster.node_ids:
        home = cluster.node_home(nid)
        left = [p.name for p in (home / "oci" / "blobs" / "sha256").glob("*")
                if f"sha256:{p.name}" in img.blobs()]
        left += [str(p) for p in (home / "oci-roots").glob("chains/*")]
        left += [p.name for p in (home / "oci-disks").glob("*") if not p.name.endswith(".lock")]
        assert left == [], (nid, left)


@_on("gvisor")
def test_a_route_to_the_trainer_holds_on_a_cluster_node(cluster: LocalCluster) -> None:
    """``expose_host`` on a cluster: the node's loopback port (the trainer's model server,
    here a banner server in the cluster's namespace) answers the machine at
    ``host.boxd.internal``, a port it did not expose does not, and a fork keeps the
    route."""
    import subprocess
    import sys

    from boxd.net_policy import HOST_NAME

    server = ("import socket, sys\n"
              "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(16)\n"
              "print('ready', flush=True)\n"
              "while True:\n"
              "    c, _ = s.accept(); c.sendall(b'trainer\\n'); c.close()\n")
    ports = [47101, 47102]
    procs = [subprocess.Popen(["ip", "netns", "exec", cluster.netns, sys.executable, "-c",
                               server, str(p)], stdout=subprocess.PIPE, text=True)
             for p in ports]
    probe = ("import socket, sys\n"
             "for p in sys.argv[1:]:\n"
             "    try:\n"
             "        c = socket.create_connection(('" + HOST_NAME + "', int(p)), timeout=5)\n"
             "        print(p, c.recv(64).decode().strip())\n"
             "    except OSError as e:\n"
             "        print(p, 'refused', type(e).__name__)\n")
    b = cluster.client
    made = []
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        m = b.machines.new(expose_host=[ports[0]])
        made.append(m.id)
        m = b.machines.wait_until_ready(m.id, timeout=300)
        assert m.expose_host == [ports[0]] and m.node in cluster.node_ids
        b.machines.files.upload(m.id, "/tmp/probe.py", probe)
        out = b.machines.exec(m.id, ["python3", "/tmp/probe.py", *map(str, ports)]).stdout
        assert out.splitlines()[0] == f"{ports[0]} trainer", out
        assert out.splitlines()[1].startswith(f"{ports[1]} refused"), out
        (kid,) = b.machines.fork(m.id, count=1)
        assert not isinstance(kid, Exception), kid
        made.append(kid.id)
        out = b.machines.exec(kid.id, ["python3", "/tmp/probe.py", str(ports[0])]).stdout
        assert out.strip() == f"{ports[0]} trainer", out
    finally:
        for mid in made:
            b.machines.delete(mid)
        for proc in procs:
            proc.kill()
            proc.wait()


E2B_SCRIPT = """
import sys
from e2b import Sandbox

sbx = Sandbox.create(timeout=600)
try:
    assert sbx.commands.run("echo hi").stdout == "hi\\n"
    sbx.files.write("/home/user/state", "42")
    # E2B's user, and the upload is theirs (the owner crosses the Ray actor calls)
    assert sbx.commands.run("whoami; stat -c %U /home/user/state").stdout == "user\\nuser\\n"
    kids = sbx.fork(count=2)
    try:
        for kid in kids:
            assert kid.files.read("/home/user/state") == "42"
            assert kid.commands.run("cat /home/user/state").stdout == "42"
        print("ids", sbx.sandbox_id, *(k.sandbox_id for k in kids))
    finally:
        for kid in kids:
            kid.kill()
finally:
    sbx.kill()
print("ok")
"""


@_on("gvisor")
def test_the_unmodified_e2b_sdk_runs_against_a_cluster(cluster: LocalCluster) -> None:
    """E2B's front door is the control plane's: `boxd e2b env` in the cluster's namespace
    points the unmodified e2b SDK at it; a sandbox and its live forks run on the nodes."""
    import sys

    pytest.importorskip("e2b", reason="the dev extra installs the e2b SDK")
    env = {**os.environ, "BOXD_HOME": str(cluster.home)}
    out = cluster.in_netns(sys.executable, "-m", "boxd", "e2b", "env", env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines())
    assert set(exports) == {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"}, exports
    r = cluster.in_netns(sys.executable, "-c", E2B_SCRIPT, env={**env, **exports}, timeout=600)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "ok", (r.stdout, r.stderr[-3000:])
    ids = next(line for line in r.stdout.splitlines() if line.startswith("ids")).split()[1:]
    assert len(ids) == 3 and not any(m.name in ids for m in cluster.client.machines.list())


E2B_INTERACTIVE_SCRIPT = """
import re, time
from e2b import CommandExitException, PtySize, Sandbox

def pty_text(handle, until, timeout=60):
    seen = b""
    deadline = time.monotonic() + timeout
    for _, _, pty in handle:
        if pty is not None:
            seen += bytes(pty)
        if re.search(until.encode(), seen) or time.monotonic() > deadline:
            break
    return seen.decode(errors="replace")

sbx = Sandbox.create(timeout=600)
try:
    print("sandbox", sbx.sandbox_id, flush=True)
    h = sbx.commands.run("cat; echo done", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\\n")
    sbx.commands.send_stdin(h.pid, b"\\x00bytes\\xff\\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    # (the SDK decodes output as UTF-8: the \\xff arrives as U+FFFD)
    assert r.exit_code == 0 and r.stdout == "hello\\n\\x00bytes\\ufffd\\ndone\\n", r.stdout
    h = sbx.commands.run("head -c 9", background=True, stdin=True)
    sbx.commands.stream_input(h.pid, ["abc", b"def", "ghi"])
    assert h.wait().stdout == "abcdefghi"

    p = sbx.pty.create(PtySize(rows=24, cols=80), envs={"PS1": "$ "})
    sbx.pty.send_stdin(p.pid, b"stty size; tty\\n")
    out = pty_text(p, "/dev/pts/")
    assert "24 80" in out and "/dev/pts/" in out, out
    sbx.pty.resize(p.pid, PtySize(rows=40, cols=100))  # a resize crosses to the node too
    sbx.pty.send_stdin(p.pid, b"stty size; echo pid=$$.\\n")
    out = pty_text(p, "pid=[0-9]+[.]")
    assert "40 100" in out, out
    shell = re.search("pid=([0-9]+)[.]", out).group(1)
    assert sbx.pty.kill(p.pid) is True
    try:
        p.wait()
        raise AssertionError("a killed pty exited cleanly")
    except CommandExitException:
        pass
    # the kill reached the node: the pty's shell is gone from the guest
    deadline = time.monotonic() + 30
    while sbx.commands.run(f"test -d /proc/{shell} && echo alive || echo gone").stdout != "gone\\n":
        assert time.monotonic() < deadline, "the pty's shell outlived its kill"
        time.sleep(0.5)
finally:
    sbx.kill()
print("ok")
"""


@ON_BOTH
def test_the_e2b_sdks_interactive_commands_and_ptys_run_on_a_cluster_node(
    cluster: LocalCluster,
) -> None:
    """Issue 40: a command's stdin (send_stdin, stream_input, close_stdin) and a PTY
    (create, input, resize, kill) through the unmodified e2b SDK reach a machine on a
    cluster node: the input crosses to the node actor one call per item, the output
    streams back, and a kill ends the command in the guest."""
    import sys

    pytest.importorskip("e2b", reason="the dev extra installs the e2b SDK")
    env = {**os.environ, "BOXD_HOME": str(cluster.home)}
    out = cluster.in_netns(sys.executable, "-m", "boxd", "e2b", "env", env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines())
    r = cluster.in_netns(sys.executable, "-c", E2B_INTERACTIVE_SCRIPT, env={**env, **exports},
                         timeout=600)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "ok", (r.stdout, r.stderr[-3000:])
    # every session ended on its node (the commands that exited, and the killed pty)
    assert all(n["interactive"] == 0 for n in _open_sessions(cluster).values())


_SESSIONS = r"""
import json, sys, ray
ray.init(address=sys.argv[1], namespace="boxd", logging_level="ERROR", log_to_driver=False)
out = {}
for n in sys.argv[2:]:
    try:
        actor = ray.get_actor("boxd-node-" + n)
    except ValueError:
        continue  # a node an earlier test removed: it holds nothing
    out[n] = ray.get(actor.open_sessions.remote())
print(json.dumps(out))
"""


def _open_sessions(cluster: LocalCluster) -> dict[str, dict[str, int]]:
    """Each live node actor's `open_sessions`, asked by a Ray driver in the namespace."""
    import json
    import sys

    r = cluster.in_netns(sys.executable, "-c", _SESSIONS, cluster.address, *cluster.node_ids,
                         timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, dict[str, int]] = json.loads(r.stdout.splitlines()[-1])
    return out


_DYING_CONTROL_PLANE = r"""
import os, sys, ray
from boxd import models, process_models as pm
ray.init(address=sys.argv[1], namespace="boxd", logging_level="ERROR", log_to_driver=False)
node = ray.get_actor("boxd-node-" + sys.argv[2])
gen = node.interactive.options(num_returns="streaming").remote(
    sys.argv[3], models.ExecRequest(command="read line; echo got $line; exec sleep 601"), None)
sid = ray.get(next(gen))
assert ray.get(node.interactive_input.remote(sid, pm.ExecInput(data=b"in\n")))
print(ray.get(next(gen)).data.decode(), end="", flush=True)
os._exit(0)  # a control plane that dies: nothing closes its stream or renews its lease
"""


@_on("gvisor")
def test_an_interactive_session_whose_control_plane_died_ends_with_its_lease(
    cluster: LocalCluster,
) -> None:
    """A Ray driver (a control plane) opens an interactive session on a node actor, feeds
    it, and dies: Ray leaves the session's stream running, so the node ends it when its
    lease lapses and the command is killed in the guest."""
    import sys

    from boxd.node.cluster import INTERACTIVE_LEASE

    b = cluster.client
    m = b.machines.wait_until_ready(b.machines.new("lease").id, timeout=300)
    try:
        assert m.node is not None
        r = cluster.in_netns(sys.executable, "-c", _DYING_CONTROL_PLANE, cluster.address,
                             m.node, m.id, timeout=120)
        assert r.returncode == 0 and r.stdout == "got in\n", (r.stdout, r.stderr[-3000:])
        alive = "pgrep -f 'slee[p] 601' >/dev/null && echo alive || echo gone"
        assert b.machines.exec(m.id, alive).stdout == "alive\n"
        assert _open_sessions(cluster)[m.node]["interactive"] == 1
        deadline = time.monotonic() + INTERACTIVE_LEASE + 30
        while _open_sessions(cluster)[m.node]["interactive"]:
            assert time.monotonic() < deadline, "the session outlived its lease"
            time.sleep(2)
        while b.machines.exec(m.id, alive).stdout != "gone\n":
            assert time.monotonic() < deadline, "the command outlived its session"
            time.sleep(1)
        log = (cluster.node_home(m.node) / "daemon.log").read_text()
        assert f"machine={m.id} event=interactive_expired" in log
    finally:
        b.machines.delete(m.id)


E2B_PTY_ON_A_DYING_NODE = """
import sys, time
from e2b import PtySize, Sandbox

sbx = Sandbox.create(timeout=600)
p = sbx.pty.create(PtySize(rows=24, cols=80))
sbx.pty.send_stdin(p.pid, b"echo rea''dy\\n")
seen = b""
for _, _, out in p:
    seen += bytes(out or b"")
    if b"ready" in seen:
        break
print("sandbox", sbx.sandbox_id, flush=True)
sys.stdin.readline()  # the test removes the sandbox's node meanwhile
t = time.monotonic()
try:
    p.wait()
    print("ended", flush=True)
except Exception as exc:
    print("error", round(time.monotonic() - t), type(exc).__name__, exc, flush=True)
"""


@_on("gvisor")
def test_a_node_lost_under_an_e2b_pty_ends_its_stream(cluster: LocalCluster) -> None:
    """The last test of the gVisor cluster (it removes a node): a PTY's stream through
    the unmodified e2b SDK ends with the sandbox gone when its node is lost, at once
    (not when a timeout or lease ends it)."""
    import subprocess
    import sys

    pytest.importorskip("e2b", reason="the dev extra installs the e2b SDK")
    env = {**os.environ, "BOXD_HOME": str(cluster.home)}
    out = cluster.in_netns(sys.executable, "-m", "boxd", "e2b", "env", env=env, timeout=60)
    exports = dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines())
    script = subprocess.Popen(
        ["ip", "netns", "exec", cluster.netns, sys.executable, "-c", E2B_PTY_ON_A_DYING_NODE],
        env={**env, **exports}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert script.stdout is not None and script.stdin is not None
        line = script.stdout.readline()
        assert line.startswith("sandbox "), (line, script.stderr and script.stderr.read())
        sid = line.split()[1]
        m = next(m for m in cluster.client.machines.list() if sid in (m.name, m.id))
        assert m.node in cluster.node_ids
        removed = cluster.command(f"remove {cluster.node_ids.index(m.node)}")
        assert removed["removed"] == m.node
        script.stdin.write("go\n")
        script.stdin.flush()
        ended = script.stdout.readline().split(maxsplit=3)
        assert ended[:1] == ["error"] and int(ended[1]) < 20, ended
        assert f"The sandbox {sid} was not found" in ended[3], ended
    finally:
        script.kill()
        script.wait()
    cluster.client.machines.delete(m.id)  # a lost machine's record goes with delete


@ON_QEMU
def test_losing_a_node_marks_exactly_its_machines(cluster: LocalCluster, base: Any) -> None:
    """The last test of the QEMU cluster (it removes a node)."""
    from boxd import errors

    b = cluster.client
    children = [c for c in b.machines.fork(base.id, count=2 * CAP + 1)
                if not isinstance(c, Exception)]
    victim = next(n for n in cluster.node_ids if n != base.node)  # the head is not a node
    on_victim = {c.id for c in children if c.node == victim}
    assert on_victim and qemu_pids(cluster.node_shm(victim))
    removed = cluster.command(f"remove {cluster.node_ids.index(victim)}")
    assert removed["removed"] == victim
    deadline = time.monotonic() + 60
    while not on_victim <= {m.id for m in b.machines.list() if m.state == "lost"}:
        assert time.monotonic() < deadline, [(m.name, m.state) for m in b.machines.list()]
        time.sleep(0.5)
    # exactly its machines: every lost one was on the victim, every other still runs
    assert all((m.state == "lost") == (m.node == victim) for m in b.machines.list())
    for _ in range(50):  # the node's reaper kills its VMs once the node runtime is gone
        if not qemu_pids(cluster.node_shm(victim)):
            break
        time.sleep(0.2)
    assert not qemu_pids(cluster.node_shm(victim)), "QEMU outlived its node runtime"
    dead = next(n for n in b.nodes.list() if n.id == victim)
    assert dead.health == "dead"
    lost = next(iter(on_victim))
    with pytest.raises(errors.NodeLost) as info:
        b.machines.exec(lost, "true")
    assert victim in info.value.message and "delete" in info.value.hint
    for c in children:  # the other nodes' machines keep answering
        if c.id not in on_victim:
            assert b.machines.exec(c.id, "echo ok").stdout == "ok\n"
    for mid in on_victim:  # delete removes a lost machine's record
        b.machines.delete(mid)
    assert not {m.id for m in b.machines.list()} & on_victim
    for c in children:
        if c.id not in on_victim:
            b.machines.delete(c.id)
    after = b.machines.fork(base.id, count=2)  # forks go to the nodes that remain
    assert all(not isinstance(c, Exception) and c.node != victim for c in after), after
    for c in after:
        b.machines.delete(c.id)
