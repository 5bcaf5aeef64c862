"""A boxd control plane on a Ray cluster of N boxd nodes on this machine (bench and tests).

Everything runs in a network namespace of its own that has only ``lo`` and a veth pair
with both ends inside, on a TEST-NET-2 address with the default route into it: Ray
advertises that address, passt has a route to start on, and no traffic leaves the
namespace. Clients reach the control
plane over its unix socket (a network namespace does not fence the file system).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
IMAGE_CACHE = Path(os.environ.get("BOXD_IMAGE_CACHE") or HERE.parent / ".cache" / "images")


@dataclass
class LocalCluster:
    netns: str
    home: Path
    address: str
    node_ids: list[str]
    ray: subprocess.Popen[str]
    daemon: subprocess.Popen[bytes]
    client: Any = field(repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)

    def command(self, line: str) -> dict[str, Any]:
        """Tell the Ray cluster script ``remove I`` or ``add``; its JSON answer."""
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

    def restart_control_plane(self) -> None:
        """Stop the control plane (node actors and machines keep running) and start
        another on the same data directory."""
        self.daemon.terminate()
        self.daemon.wait(60)
        self.client.close()
        self.daemon = _start_control_plane(self.netns, self.home, self.address, self.env)
        self.client = _client(self.home)

    def in_netns(self, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a command inside the cluster's namespace (e.g. a Ray driver)."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], text=True,
                              capture_output=True, **kw)


def qemu_pids(marker: Path) -> list[int]:
    """QEMU processes whose command line names a path under ``marker``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (proc / "cmdline").read_bytes()
                if b"qemu-system" in cmd[:64] and str(marker).encode() + b"/" in cmd:
                    pids.append(int(proc.name))
    return pids


@contextlib.contextmanager
def local_cluster(nodes: int = 3, cap: int = 2, **env: str) -> Iterator[LocalCluster]:
    """Start it; on exit stop Ray (node runtimes' reapers kill their VMs) and clean up."""
    from boxd.config import Paths

    netns = f"boxd-c{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up"], check=True)
    # passt needs a routable interface to start (machines have a network): a veth pair
    # with both ends in here and a default route into it, on a documentation range
    # (TEST-NET-2). What a guest sends there goes nowhere; nothing leaves the namespace.
    for cmd in (["link", "add", "bx0", "type", "veth", "peer", "name", "bx1"],
                ["addr", "add", "198.51.100.1/24", "dev", "bx0"],
                ["link", "set", "bx0", "up"], ["link", "set", "bx1", "up"],
                ["route", "add", "default", "via", "198.51.100.2", "dev", "bx0"]):
        subprocess.run(["ip", "netns", "exec", netns, "ip", *cmd], check=True)
    home = Path(tempfile.mkdtemp(prefix="boxd-cluster-", dir="/tmp"))
    os.chmod(home, 0o755)  # QEMU's own user reopens disk layers below it
    inns = ["ip", "netns", "exec", netns]
    with open(home / "ray.err", "wb") as err:
        ray = subprocess.Popen(
            [*inns, sys.executable, str(HERE / "_ray_cluster.py"), str(nodes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
            start_new_session=True,
        )
    daemon: subprocess.Popen[bytes] | None = None
    try:
        assert ray.stdout is not None
        up = json.loads(ray.stdout.readline() or "{}")
        assert "address" in up, (home / "ray.err").read_text()[-3000:]
        # QEMU unless the caller names an engine (BOXD_ENGINE=...): the tests run the
        # scale-out tests on gVisor too, the `auto` default where KVM is missing.
        denv = {"BOXD_ENGINE": "qemu", **os.environ, "BOXD_HOME": str(home),
                "BOXD_IMAGE_CACHE": str(IMAGE_CACHE),
                "BOXD_NODE_MAX_MACHINES": str(cap), "BOXD_FORK_SPARES": "0",
                "BOXD_SUSPEND_AFTER": "0", "BOXD_HIBERNATE_AFTER": "0", **env}
        daemon = _start_control_plane(netns, home, up["address"], denv)
        client = _client(home)
        deadline = time.monotonic() + 180
        while len([n for n in client.nodes.list() if n.health == "alive"]) < nodes:
            assert time.monotonic() < deadline, "the nodes did not join"
            time.sleep(0.5)
        cluster = LocalCluster(netns, home, up["address"], up["nodes"], ray, daemon, client,
                               denv)
        try:
            yield cluster
        finally:
            daemon = cluster.daemon  # (a restart replaced it)
            cluster.client.close()
    finally:
        with contextlib.suppress(Exception):
            assert ray.stdin is not None
            ray.stdin.write("quit\n")
            ray.stdin.close()
            ray.wait(60)
        if ray.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(ray.pid, 9)
        if daemon is not None:
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:  # a Ray driver slow to let go: no leftovers
                daemon.kill()
                daemon.wait(10)
        node_homes = list((home / "nodes").iterdir()) if (home / "nodes").exists() else []
        for nh in node_homes:  # a safety net: the reapers should have done it
            for pid in qemu_pids(Paths(nh).shm) + qemu_pids(nh):
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            shutil.rmtree(Paths(nh).shm, ignore_errors=True)
        subprocess.run(["ip", "netns", "delete", netns], check=False)
        shutil.rmtree(home, ignore_errors=True)


def _start_control_plane(
    netns: str, home: Path, address: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """`boxd serve --ray` in the namespace; returns once it answers on its socket."""
    from boxd.sdk._local import is_healthy

    with open(home / "serve.out", "ab") as out:
        daemon = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-m", "boxd", "serve", "--ray",
             address], env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while not (is_healthy(home / "boxd.sock") and (home / "local.key").exists()):
        assert daemon.poll() is None and time.monotonic() < deadline, (
            (home / "serve.out").read_text(errors="replace")[-3000:])
        time.sleep(0.2)
    return daemon


def _client(home: Path) -> Any:
    """A client of the control plane at ``home`` (its socket and local key)."""
    from boxd import Boxd

    old = os.environ.get("BOXD_HOME")
    os.environ["BOXD_HOME"] = str(home)
    try:
        return Boxd(timeout=600)
    finally:
        if old is None:
            os.environ.pop("BOXD_HOME")
        else:
            os.environ["BOXD_HOME"] = old
