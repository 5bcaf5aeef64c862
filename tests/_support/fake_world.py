"""The core (control plane, node runtime, lifecycle, snapshot store) on the fake
engine, in one `World`: the harness of the unit tests that drive machines without
QEMU (test_node_fake.py, test_warm.py, test_sdk_inprocess.py, test_url_access.py,
test_openenv_provider.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from boxd import models
from boxd.config import Paths, Settings
from boxd.control import Machines, Snapshots
from boxd.engine.fake import FakeEngine, FakeMachine
from boxd.images import GuestImage, Recipe
from boxd.models import MachineState
from boxd.node import Host, NodeRuntime
from boxd.state import Database, Repos
from boxd.storage import SnapshotStore
from boxd.storage.oci import ImageStore

S = MachineState
ACCOUNT = "a_test"


@dataclass
class World:
    paths: Paths
    repos: Repos
    engine: FakeEngine
    node: NodeRuntime
    machines: Machines
    snapshots: Snapshots

    def vm(self, machine_id: str) -> FakeMachine:
        rec = self.repos.machines.get(machine_id)
        assert rec is not None
        return self.engine.running[rec.vm_id]

    def state(self, machine_id: str) -> MachineState:
        rec = self.repos.machines.get(machine_id)
        assert rec is not None
        return rec.state

    def restart(self) -> NodeRuntime:
        """A new node runtime on the same records and engine (a daemon restart)."""
        host = Host(self.paths, Settings(fork_spares=0), engine=self.engine,
                    image=self.node.host.image)
        node = NodeRuntime(self.paths, self.repos, host, Settings(fork_spares=0),
                           self.machines.store)
        self.node = node
        self.machines.nodes = {node.id: node}
        return node


def make_world(tmp: Path, monkeypatch: pytest.MonkeyPatch, spares: int = 0,
               spares_total: int = 32) -> World:
    monkeypatch.setenv("BOXD_SHM", str(tmp / "shm"))
    paths = Paths(tmp / "home")
    paths.ensure()
    db = Database(paths.db)
    db.execute("INSERT INTO accounts (id, name, created_at) VALUES (?, 'test', 0)", (ACCOUNT,))
    repos = Repos(db)
    rootfs = tmp / "rootfs.img"
    rootfs.write_text("rootfs")
    image = GuestImage(key="img1", dir=tmp, kernel=tmp / "vmlinux", initrd=tmp / "initrd",
                       rootfs=rootfs, recipe=Recipe(suite="bookworm"), kernel_version="6",
                       cmdline_hint="")
    engine = FakeEngine()
    settings = Settings(fork_spares=spares, fork_spares_total=spares_total)
    store = SnapshotStore(paths.snapshots)
    node = NodeRuntime(paths, repos, Host(paths, settings, engine=engine, image=image), settings,
                       store)
    machines = Machines(repos, {node.id: node}, store,
                        images=ImageStore(paths.images_store))
    snapshots = Snapshots(machines, store)
    machines.snapshots = snapshots
    return World(paths, repos, engine, node, machines, snapshots)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = make_world(tmp_path, monkeypatch)
    yield w
    w.repos.db.close()


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def running(w: World, name: str = "base", account: str = ACCOUNT) -> models.Machine:
    m = await w.machines.create(account, models.MachineCreate(name=name))
    return await w.machines.wait_until_ready(account, m.id, timeout=5)


async def sh(w: World, ref: str, cmd: str) -> str:
    return (await w.machines.exec(ACCOUNT, ref, models.ExecRequest(command=cmd))).stdout


def leftovers(w: World) -> dict[str, list[str]]:
    """Files of machines, templates and checkpoints that exist on 'disk'."""
    return {
        "disks": sorted(p.name for p in w.paths.disks.glob("*")),
        "run": sorted(p.name for p in (w.paths.shm / "machines").glob("*")),
        "templates": sorted(p.name for p in w.paths.templates.glob("*")),
        "checkpoints": sorted(p.name for p in w.paths.checkpoints.glob("*")),
    }
