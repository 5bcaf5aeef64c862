"""boxd on a Ray cluster: three Ray nodes on this machine, one boxd control plane.

Ray, its nodes, the control plane and every VM run in a network namespace of the
test's own that has only ``lo`` (Ray then advertises 127.0.0.1 and nothing leaves the
machine); the test talks to the control plane over its unix socket, which a network
namespace does not fence. Each node caps at two machines, so a batch of five forks
must spread over all three nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IMAGE_CACHE, kill_machines_of

pytest.importorskip("ray", reason="the cluster tests need Ray (pip install 'boxd[ray]')")
if os.geteuid() != 0 or shutil.which("ip") is None:
    pytest.skip("the cluster tests make a network namespace: they need root and `ip`",
                allow_module_level=True)

HERE = Path(__file__).resolve().parent
CAP = 2  # BOXD_NODE_MAX_MACHINES for this cluster


@dataclass
class ClusterUnderTest:
    netns: str
    home: Path
    ray: subprocess.Popen[str]
    daemon: subprocess.Popen[bytes]
    node_ids: list[str]
    client: Any

    def command(self, line: str) -> dict[str, Any]:
        assert self.ray.stdin is not None and self.ray.stdout is not None
        self.ray.stdin.write(line + "\n")
        self.ray.stdin.flush()
        out: dict[str, Any] = json.loads(self.ray.stdout.readline())
        return out

    def node_home(self, node_id: str) -> Path:
        return self.home / "nodes" / node_id

    def node_shm(self, node_id: str) -> Path:
        from boxd.config import Paths

        return Paths(self.node_home(node_id)).shm


def _qemu_of(marker: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (proc / "cmdline").read_bytes()
                if b"qemu-system" in cmd[:64] and str(marker).encode() + b"/" in cmd:
                    pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterUnderTest]:
    netns = f"boxd-t{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up"], check=True)
    home = Path(tempfile.mkdtemp(prefix="boxd-cluster-", dir="/tmp"))
    os.chmod(home, 0o755)  # QEMU's own user reopens disk layers below it
    inns = ["ip", "netns", "exec", netns]
    ray = subprocess.Popen(
        [*inns, sys.executable, str(HERE / "_ray_cluster.py"), "3"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=open(home / "ray.err", "wb"), text=True,  # noqa: SIM115
        start_new_session=True,
    )
    daemon: subprocess.Popen[bytes] | None = None
    try:
        assert ray.stdout is not None
        up = json.loads(ray.stdout.readline() or "{}")
        assert "address" in up, (home / "ray.err").read_text()[-3000:]
        env = {**os.environ, "BOXD_HOME": str(home), "BOXD_IMAGE_CACHE": str(IMAGE_CACHE),
               "BOXD_NODE_MAX_MACHINES": str(CAP), "BOXD_FORK_SPARES": "0",
               "BOXD_SUSPEND_AFTER": "0", "BOXD_HIBERNATE_AFTER": "0"}
        daemon = subprocess.Popen(
            [*inns, sys.executable, "-m", "boxd", "serve", "--ray", up["address"]], env=env,
            stdout=open(home / "serve.out", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        from boxd import Boxd
        from boxd.sdk._local import is_healthy

        deadline = time.monotonic() + 180
        while not (is_healthy(home / "boxd.sock") and (home / "local.key").exists()):
            assert daemon.poll() is None and time.monotonic() < deadline, (
                (home / "serve.out").read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        old = os.environ.get("BOXD_HOME")
        os.environ["BOXD_HOME"] = str(home)
        try:
            client = Boxd(timeout=300)
        finally:
            if old is None:
                os.environ.pop("BOXD_HOME")
            else:
                os.environ["BOXD_HOME"] = old
        while len([n for n in client.nodes.list() if n.health == "alive"]) < 3:
            assert time.monotonic() < deadline, "the three nodes did not join"
            time.sleep(0.5)
        yield ClusterUnderTest(netns, home, ray, daemon, up["nodes"], client)
        client.close()
    finally:
        with contextlib.suppress(Exception):
            assert ray.stdin is not None
            ray.stdin.write("quit\n")
            ray.stdin.close()
            ray.wait(60)
        if ray.poll() is None:
            os.killpg(ray.pid, 9)
        if daemon is not None:
            daemon.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(30)
        for nid in os.listdir(home / "nodes") if (home / "nodes").exists() else []:
            kill_machines_of(home / "nodes" / nid)
        subprocess.run(["ip", "netns", "delete", netns], check=False)
        from boxd.config import Paths

        for nid in os.listdir(home / "nodes") if (home / "nodes").exists() else []:
            shutil.rmtree(Paths(home / "nodes" / nid).shm, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def base(cluster: ClusterUnderTest) -> Any:
    """A booted machine running a process that holds a random value in its memory and
    keeps writing it to /dev/shm/value."""
    b = cluster.client
    m = b.machines.new("base", suspend_after=0, hibernate_after=0)
    m = b.machines.wait_until_ready(m.id, timeout=300)
    b.machines.exec(m.id, "nohup sh -c 'v=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d \" \");"
                          " while :; do echo $v > /dev/shm/value; sleep 0.2; done' "
                          ">/dev/null 2>&1 &")
    for _ in range(50):
        if b.machines.exec(m.id, "cat /dev/shm/value").stdout.strip():
            break
        time.sleep(0.2)
    return m


def _value_from_memory(b: Any, machine_id: str) -> str:
    """The value the base's process holds in memory (the file is removed first, so only
    the running process can write it back)."""
    r = b.machines.exec(machine_id, "rm -f /dev/shm/value; sleep 1; cat /dev/shm/value")
    assert r.exit_code == 0, r.stderr
    return str(r.stdout.strip())


def test_control_plane_sees_three_nodes_with_their_own_data(cluster: ClusterUnderTest) -> None:
    nodes = cluster.client.nodes.list()
    assert sorted(n.id for n in nodes) == sorted(cluster.node_ids)
    assert all(n.health == "alive" and n.max_machines == CAP for n in nodes)
    for nid in cluster.node_ids:  # each node runtime has a directory (and database) of its own
        assert (cluster.node_home(nid) / "state.db").exists()


def test_batch_fork_spreads_over_nodes_with_the_same_memory(
    cluster: ClusterUnderTest, base: Any
) -> None:
    b = cluster.client
    want = _value_from_memory(b, base.id)
    children = b.machines.fork(base.id, count=2 * CAP + 1)  # more than one node holds
    assert all(not isinstance(c, Exception) for c in children), children
    nodes = {c.node for c in children}
    assert nodes == set(cluster.node_ids), "five children on three nodes of two slots each"
    for c in children:
        assert c.node is not None and c.state == "running"
        assert _value_from_memory(b, c.id) == want, f"child on node {c.node[:8]}"
    # The receiving nodes keep the template: a second fork there is copy-on-write again.
    for c in children:
        b.machines.delete(c.id)
    again = b.machines.fork(base.id, count=2 * CAP + 1)
    assert {c.node for c in again if not isinstance(c, Exception)} == set(cluster.node_ids)
    logs = "".join((cluster.node_home(n) / "daemon.log").read_text() for n in cluster.node_ids)
    assert logs.count("event=received") == 2, "each other node received the template once"
    for c in again:
        b.machines.delete(c.id)


def test_snapshot_taken_on_one_node_starts_on_another(
    cluster: ClusterUnderTest, base: Any
) -> None:
    b = cluster.client
    snap = b.snapshots.save(base.id, "warm")
    other = next(n for n in cluster.node_ids if n != base.node)
    m = b.machines.new("from-warm", from_snapshot="warm", node=other)
    assert m.node == other and m.snapshot == snap.digest.removeprefix("sha256:")
    assert b.machines.exec(m.id, "cat /dev/shm/value").stdout.strip()
    assert _value_from_memory(b, m.id) == _value_from_memory(b, base.id)
    b.machines.delete(m.id)


def test_losing_a_node_marks_exactly_its_machines(cluster: ClusterUnderTest, base: Any) -> None:
    from boxd import errors

    b = cluster.client
    children = [c for c in b.machines.fork(base.id, count=2 * CAP + 1)
                if not isinstance(c, Exception)]
    victim = next(n for n in cluster.node_ids if n != base.node)  # the head is not a node
    on_victim = {c.id for c in children if c.node == victim}
    assert on_victim and _qemu_of(cluster.node_shm(victim))
    removed = cluster.command(f"remove {cluster.node_ids.index(victim)}")
    assert removed["removed"] == victim
    deadline = time.monotonic() + 60
    while {m.id for m in b.machines.list() if m.state == "lost"} != on_victim:
        assert time.monotonic() < deadline, [(m.name, m.state) for m in b.machines.list()]
        time.sleep(0.5)
    for _ in range(50):  # the node's reaper kills its VMs once the node runtime is gone
        if not _qemu_of(cluster.node_shm(victim)):
            break
        time.sleep(0.2)
    assert not _qemu_of(cluster.node_shm(victim)), "QEMU outlived its node runtime"
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
