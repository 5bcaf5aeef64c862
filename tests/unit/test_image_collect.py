"""Unpacked images are collected (issue 41): removing an image frees its trees, disks
and blobs unless another image shares them or a machine or snapshot still runs it;
what a machine deleted later leaves is freed by the next collection.

Real image store, real unpacks (`unpack_image`) and SQLite; machines on the fake engine
(tests/_support/fake_world.py). QEMU's disks are stand-in files here, named as
`image_disk` names them: the collection goes by their names only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tests._support.fake_world import ACCOUNT, World, make_world, run
from tests._support.oci import make_image, write_layout

from boxd import models
from boxd.api.server import _image_service
from boxd.api.services.images import ImageService
from boxd.images import collect_unpacked
from boxd.images.oci import chain_ids, import_image, inspect_image, unpack_image
from boxd.storage.oci import ImageStore

BASE = {"usr/big": b"b" * 50_000, "usr/conf": b"base"}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = make_world(tmp_path, monkeypatch)
    store = ImageStore(w.paths.images_store)
    for name in ("one", "two"):
        layout = write_layout(tmp_path / f"layout-{name}", {"v1": make_image(
            [BASE, {f"app/{name}": name.encode()}], config={"Cmd": ["cat"]})})
        import_image(store, f"oci:{layout}:v1", f"{ACCOUNT}/{name}:v1")
    yield w
    w.repos.db.close()


def _service(w: World) -> ImageService:
    """The image service as the daemon makes it (over its control plane's records)."""
    return _image_service(w.paths, w.machines)


def _unpack(w: World, name: str) -> tuple[list[str], Path]:
    """The image's chain ids and tree; a stand-in QEMU disk per chain."""
    store = ImageStore(w.paths.images_store)
    info = inspect_image(store, f"{ACCOUNT}/{name}:v1")
    tree = unpack_image(store, info, w.paths.image_roots)
    chains = chain_ids([d.digest for d in info.layers])
    w.paths.image_disks.mkdir(exist_ok=True)
    for c in chains:
        (w.paths.image_disks / f"{c}.ext4").write_bytes(b"disk")
    return chains, tree


async def _ready(w: World, req: models.MachineCreate) -> models.Machine:
    m = await w.machines.create(ACCOUNT, req)
    out = await w.machines.wait_until_ready(ACCOUNT, m.id, timeout=5)
    assert isinstance(out, models.Machine)
    return out


def _chains(w: World) -> set[str]:
    """The chain trees; a ``.below`` link (what QEMU's disks build on) goes with its own."""
    chains = w.paths.image_roots / "chains"
    trees = {p.name for p in chains.iterdir() if p.is_dir() and not p.is_symlink()}
    links = {p.name.removesuffix(".below") for p in chains.glob("*.below")}
    assert links <= trees, (trees, links)
    return trees


def _disks(w: World) -> set[str]:
    return {p.name.split(".")[0] for p in w.paths.image_disks.iterdir()}


def test_removing_an_image_frees_what_only_it_used(world: World) -> None:
    (base, _), tree_one = _unpack(world, "one")
    (base2, top_two), tree_two = _unpack(world, "two")
    assert base == base2
    digest_one = inspect_image(ImageStore(world.paths.images_store),
                               f"{ACCOUNT}/one:v1").digest
    run(_service(world).remove(ACCOUNT, "one:v1"))
    # its own layer's tree, disk, name link and blob went; the shared base stayed
    assert _chains(world) == {base, top_two} and _disks(world) == {base, top_two}
    assert not (world.paths.image_roots / digest_one[7:]).exists()
    assert not tree_one.exists() and (tree_two / "usr/big").read_bytes() == BASE["usr/big"]
    assert not ImageStore(world.paths.images_store).has(digest_one)
    run(_service(world).remove(ACCOUNT, "two:v1"))
    assert _chains(world) == set() and _disks(world) == set()


def test_an_image_a_machine_runs_stays_until_the_machine_goes(world: World) -> None:
    async def go() -> None:
        m = await _ready(world, models.MachineCreate(name="m", image="one:v1",
                                                     service=False))
        chains, tree = _unpack(world, "one")
        svc = _service(world)
        await svc.remove(ACCOUNT, "one:v1")
        # the name went, but the machine still runs on its tree (and could fork it)
        assert set(chains) <= _chains(world) and set(chains) <= _disks(world)
        assert (tree / "app/one").read_bytes() == b"one"
        assert world.state(m.id) == models.MachineState.RUNNING
        await world.machines.delete(ACCOUNT, m.id)
        assert await svc.collect() > 0  # as the daemon's next start does
        assert chains[-1] not in _chains(world) and chains[-1] not in _disks(world)
        assert chains[0] in _chains(world)  # image "two" still has the base

    run(go())


def test_a_snapshot_of_an_image_machine_keeps_its_image(world: World) -> None:
    async def go() -> None:
        m = await _ready(world, models.MachineCreate(name="m", image="one:v1",
                                                     service=False))
        chains, _ = _unpack(world, "one")
        assert world.snapshots is not None
        await world.snapshots.save(ACCOUNT, m.id, "s")
        await world.machines.delete(ACCOUNT, m.id)
        store = ImageStore(world.paths.images_store)
        digest = inspect_image(store, f"{ACCOUNT}/one:v1").digest
        svc = _service(world)
        await svc.remove(ACCOUNT, "one:v1")
        await svc.collect()
        # its trees, disks and blobs stay (a node without the tree unpacks it again)
        assert set(chains) <= _chains(world) and set(chains) <= _disks(world)
        assert store.has(digest)
        # the snapshot starts a machine of the image whose name is gone
        again = await _ready(world, models.MachineCreate(name="again", from_snapshot="s",
                                                         service=False))
        assert world.state(again.id) == models.MachineState.RUNNING
        assert again.image is not None and again.image.digest == digest

    run(go())


def test_an_unknown_use_collects_nothing(world: World) -> None:
    """A collection that cannot learn what runs the images removes no tree or disk."""
    chains, _ = _unpack(world, "one")
    store = ImageStore(world.paths.images_store)
    store.untag(f"{ACCOUNT}/one:v1")

    def unknown() -> set[str]:
        raise OSError("the records cannot be read")

    with pytest.raises(OSError):
        collect_unpacked(store, world.paths.image_roots, world.paths.image_disks, unknown)
    assert set(chains) <= _chains(world) and set(chains) <= _disks(world)


def test_dead_processes_leftovers_go_and_live_ones_stay(world: World) -> None:
    _unpack(world, "one")
    chains = world.paths.image_roots / "chains"
    old, new = chains / ".abc-old", chains / ".abc-new"
    old.mkdir()
    new.mkdir()
    old_disk = world.paths.image_disks / ".x.tmp-1"
    old_disk.write_bytes(b"")
    past = time.time() - 2 * 3600
    for p in (old, old_disk):
        os.utime(p, (past, past))
    removed = collect_unpacked(ImageStore(world.paths.images_store), world.paths.image_roots,
                               world.paths.image_disks, set)
    assert set(removed) == {old, old_disk}
    assert new.is_dir()


def test_a_collection_waits_for_an_unpack(world: World,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection never sweeps a tree an unpack is making (and no image or machine
    names yet): it waits for the unpack, then keeps what the image needs."""
    import boxd.images.oci as oci

    entered, go_on = threading.Event(), threading.Event()
    real = oci._run_unpack

    def held(*args: Any, **kw: Any) -> None:
        entered.set()
        go_on.wait(10)
        real(*args, **kw)

    monkeypatch.setattr(oci, "_run_unpack", held)
    store = ImageStore(world.paths.images_store)
    info = inspect_image(store, f"{ACCOUNT}/one:v1")
    with ThreadPoolExecutor(2) as pool:
        unpack = pool.submit(unpack_image, store, info, world.paths.image_roots)
        assert entered.wait(10)
        collect = pool.submit(collect_unpacked, store, world.paths.image_roots,
                              world.paths.image_disks, set)
        time.sleep(0.3)
        assert not collect.done()  # held off while the tree is half made
        go_on.set()
        tree = unpack.result(10)
        collect.result(10)
    assert (tree / "app/one").read_bytes() == b"one"
