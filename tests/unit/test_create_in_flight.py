"""A request for a machine whose create is still in flight waits for the create.

The machine's record exists (``starting``) as soon as its name is claimed, before its
VM process runs: an image's tree is unpacked first, which takes seconds for a large
image. ``wait_until_ready`` (or any request) in that window used to answer
``machine_failed: its VM process is not running``; two OpenEnv sessions of one image
starting at once (one makes the baseline, the other waits for it) met it. On the fake
engine with a real image store and SQLite; the unpacking is made slow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._support.fake_world import ACCOUNT, World, make_world, run
from tests._support.oci import make_image, write_layout

from boxd import models
from boxd.errors import MachineNotFound
from boxd.images.oci import import_image
from boxd.node._host import Host
from boxd.storage.oci import ImageStore


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = make_world(tmp_path, monkeypatch)
    layout = write_layout(tmp_path / "layout", {"v1": make_image([{"srv/x": b"x\n"}])})
    import_image(ImageStore(w.paths.images_store), f"oci:{layout}:v1",
                 f"{ACCOUNT}/envs/big:v1")
    slow_root = Host.image_root

    async def image_root(self: Host, *args: object) -> Path:
        await asyncio.sleep(0.5)  # a large image's unpacking
        return await slow_root(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Host, "image_root", image_root)
    yield w
    w.repos.db.close()


def _claimed(w: World, name: str) -> bool:
    return any(m.name == name for m in w.repos.machines.list(ACCOUNT))


async def _create_and_wait(w: World, name: str, image: str) -> tuple[object, object]:
    create = asyncio.create_task(w.machines.create(
        ACCOUNT, models.MachineCreate(name=name, image=image)))
    while not _claimed(w, name) and not create.done():
        await asyncio.sleep(0.01)
    waited = await asyncio.gather(w.machines.wait_until_ready(ACCOUNT, name, timeout=5),
                                  return_exceptions=True)
    return await asyncio.gather(create, return_exceptions=True), waited[0]


def test_a_wait_during_the_create_returns_when_it_runs(world: World) -> None:
    (created,), waited = run(_create_and_wait(world, "big", "envs/big:v1"))  # type: ignore[misc]
    assert isinstance(created, models.Machine)
    assert isinstance(waited, models.Machine), waited
    assert waited.id == created.id and waited.state == models.MachineState.RUNNING


def test_a_wait_during_a_create_that_fails_is_not_found(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    async def image_root(self: Host, *args: object) -> Path:
        await asyncio.sleep(0.5)
        raise OSError("the disk is full")

    monkeypatch.setattr(Host, "image_root", image_root)
    (created,), waited = run(_create_and_wait(world, "big", "envs/big:v1"))  # type: ignore[misc]
    assert isinstance(created, OSError)
    assert isinstance(waited, MachineNotFound), waited
