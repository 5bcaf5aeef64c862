"""Forks racing deletes and template collection, on the fake engine (issue: races under
load).

A fork's launch is parked mid-way (`FakeEngine.gate`) while its source is deleted or
changed and garbage is collected: the fork answers a typed error or succeeds, the
template's files exist until the last launch from it finished, and nothing of a
failed or deleted machine is left (records, layers, files). The state layer answers a
write that refers to a vanished row with a typed `Conflict`, never a bare sqlite3 error.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import pytest
from tests._support.fake_world import ACCOUNT, World, leftovers, make_world, running, sh

from boxd import errors, models

pytestmark = pytest.mark.timeout(60)



def typed(result: object) -> None:
    """A fork item is a machine or a typed error, never an untyped exception or a 5xx
    other than the documented 503."""
    if isinstance(result, models.Machine):
        return
    assert isinstance(result, errors.BoxdError), repr(result)
    assert result.status < 500 or result.status == 503, repr(result)


def empty_after_deleting_all(w: World) -> None:
    """With every machine deleted: no record, layer, template or file is left."""
    assert [r.name for r in w.repos.machines.list(ACCOUNT)] == []
    assert w.repos.layers.ids() == set()
    assert w.repos.layers.template_dirs() == set()
    assert leftovers(w) == {"disks": [], "run": [], "templates": [], "checkpoints": []}


async def delete_all(w: World) -> None:
    for m in await w.machines.list(ACCOUNT):
        await w.machines.delete(ACCOUNT, m.id)


def template_dirs(w: World) -> list[Path]:
    return sorted(w.paths.templates.glob("*"))


# ----------------------------------------------------------- the state boundary


def test_a_write_referring_to_a_vanished_row_is_a_typed_conflict(world: World) -> None:
    with pytest.raises(errors.Conflict) as info:
        world.repos.layers.new("l_gone", "")
    assert isinstance(info.value.__cause__, sqlite3.IntegrityError)
    with pytest.raises(errors.Conflict):
        world.repos.layers.add_template("m_x", "l_gone", Path("/m"), Path("/s"), 0)
    assert world.repos.layers.ids() == set()


# ------------------------------------------------------ fork vs delete of source


@pytest.mark.parametrize("step", ["create_disk", "start_from"])
def test_deleting_the_source_while_its_fork_launches(world: World, step: str) -> None:
    """The FK failure of the issue: the source's delete collected the template (and its
    frozen layer) while the child's launch was between its disk and its layer row."""

    async def main() -> None:
        src = await running(world)
        reached, release = world.engine.gate(step)
        fork = asyncio.create_task(world.machines.fork(ACCOUNT, src.id, ["child"]))
        await reached.wait()
        (tpl_dir,) = template_dirs(world)
        await world.machines.delete(ACCOUNT, src.id)
        # the fork in flight pins its template: its files and rows are still there
        assert (tpl_dir / "state").exists() and (tpl_dir / "mem").exists()
        assert world.repos.layers.template_dirs() == {tpl_dir.name}
        release.set()
        (child,) = await fork
        typed(child)
        assert isinstance(child, models.Machine), child  # nothing stood in its way
        assert await sh(world, child.id, "echo ok") == "ok\n"
        await delete_all(world)
        empty_after_deleting_all(world)

    asyncio.run(main())


def test_deleting_the_source_while_its_template_is_made_answers_not_found(
    world: World,
) -> None:
    async def main() -> None:
        src = await running(world)
        reached, release = world.engine.gate("capture")
        fork = asyncio.create_task(world.machines.fork(ACCOUNT, src.id, ["child"]))
        await reached.wait()
        delete = asyncio.create_task(world.machines.delete(ACCOUNT, src.id))
        await asyncio.sleep(0.01)
        release.set()
        await delete
        try:
            (child,) = await fork
        except errors.BoxdError as exc:
            child = exc
        typed(child)
        await delete_all(world)
        empty_after_deleting_all(world)

    asyncio.run(main())


# --------------------------------------------- fork vs collection of a template


def test_a_changed_source_and_a_gc_keep_the_template_of_a_fork_in_flight(
    world: World,
) -> None:
    """The 503 of the issue (``templates/t_…/state: No such file``): an exec on the
    source made its template stale and a sibling's delete collected it while a child
    was still being started from it."""

    async def main() -> None:
        src = await running(world)
        await world.machines.fork(ACCOUNT, src.id, ["sibling"])
        reached, release = world.engine.gate("start_from")
        fork = asyncio.create_task(world.machines.fork(ACCOUNT, src.id, ["child"]))
        await reached.wait()
        (tpl_dir,) = template_dirs(world)
        await sh(world, src.id, "write /root/x 1")  # the template is stale now
        await world.machines.delete(ACCOUNT, "sibling")  # ... and nothing maps it
        assert (tpl_dir / "state").exists()
        release.set()
        (child,) = await fork
        assert isinstance(child, models.Machine), child
        assert await sh(world, child.id, "echo ok") == "ok\n"
        await world.machines.delete(ACCOUNT, child.id)
        # its last user gone: the stale template is collected now
        assert not tpl_dir.exists()
        assert tpl_dir.name not in world.repos.layers.template_dirs()
        await delete_all(world)
        empty_after_deleting_all(world)

    asyncio.run(main())


def test_a_failed_fork_child_of_a_stale_template_lets_it_go(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        reached, release = world.engine.gate("start_from")
        world.engine.fail("start_from")
        fork = asyncio.create_task(world.machines.fork(ACCOUNT, src.id, ["child"]))
        await reached.wait()
        (tpl_dir,) = template_dirs(world)
        await sh(world, src.id, "write /root/x 1")
        world.node.gc()
        assert tpl_dir.exists()
        release.set()
        (child,) = await fork
        assert isinstance(child, errors.BoxdError)
        assert [m.name for m in await world.machines.list(ACCOUNT)] == ["base"]
        assert not tpl_dir.exists()  # the failed fork was its last user
        await delete_all(world)
        empty_after_deleting_all(world)

    asyncio.run(main())


def test_a_spare_refill_pins_its_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standby child being prepared maps the template too: the template is not
    collected under it, and the spare of a template gone stale is discarded."""
    w = make_world(tmp_path, monkeypatch, spares=1)
    w.node.spares.settle = 0.0

    async def main() -> None:
        src = await running(w)
        (child,) = await w.machines.fork(ACCOUNT, src.id, ["child"])
        assert isinstance(child, models.Machine)
        reached, release = w.engine.gate("start_from")  # the refill's spare
        while not reached.is_set():
            await asyncio.sleep(0.001)
        (tpl_dir,) = template_dirs(w)
        await sh(w, src.id, "write /root/x 1")  # stale
        await w.machines.delete(ACCOUNT, child.id)  # nothing maps it: gc
        assert (tpl_dir / "state").exists()
        release.set()
        while w.node.spares._tasks:
            await asyncio.gather(*list(w.node.spares._tasks))
        assert not tpl_dir.exists()  # the refill let go: collected
        assert w.node.spares.count(tpl_dir.name) == 0
        await delete_all(w)
        await w.node.spares.close()
        assert leftovers(w) == {"disks": [], "run": [], "templates": [], "checkpoints": []}

    try:
        asyncio.run(main())
    finally:
        w.repos.db.close()


def test_a_fork_of_a_deleted_source_waiting_for_a_spare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork waiting for a spare being prepared while the source is deleted: the spare
    is discarded and the fork starts its child from the (pinned) template."""
    w = make_world(tmp_path, monkeypatch, spares=1)
    w.node.spares.settle = 0.0

    async def main() -> None:
        src = await running(w)
        await w.machines.fork(ACCOUNT, src.id, ["first"])
        reached, release = w.engine.gate("start_from")  # the refill's spare
        while not reached.is_set():
            await asyncio.sleep(0.001)
        fork = asyncio.create_task(w.machines.fork(ACCOUNT, src.id, ["second"]))
        await asyncio.sleep(0.01)  # it waits for the spare being prepared
        await w.machines.delete(ACCOUNT, src.id)
        await w.machines.delete(ACCOUNT, "first")
        release.set()
        (second,) = await fork
        typed(second)
        assert isinstance(second, models.Machine), second
        assert await sh(w, second.id, "echo ok") == "ok\n"
        while w.node.spares._tasks:
            await asyncio.gather(*list(w.node.spares._tasks))
        await delete_all(w)
        await w.node.spares.close()
        empty_after_deleting_all(w)

    try:
        asyncio.run(main())
    finally:
        w.repos.db.close()


# --------------------------------------------- requests vs delete of their machine


def test_an_exec_on_a_machine_deleted_meanwhile_answers_not_found(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        reached, release = world.engine.gate("exec")
        run = asyncio.create_task(sh(world, src.id, "echo hi"))
        await reached.wait()
        await world.machines.delete(ACCOUNT, src.id)
        release.set()
        with pytest.raises(errors.MachineNotFound):
            await run
        empty_after_deleting_all(world)

    asyncio.run(main())


def test_deleting_a_fork_child_while_it_launches(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        await world.machines.fork(ACCOUNT, src.id, ["warm"])
        reached, release = world.engine.gate("start_from")
        fork = asyncio.create_task(world.machines.fork(ACCOUNT, src.id, ["child"]))
        await reached.wait()
        delete = asyncio.create_task(world.machines.delete(ACCOUNT, "child"))
        await asyncio.sleep(0.01)
        release.set()
        with contextlib.suppress(errors.MachineNotFound):  # it may have been gone first
            await delete
        (child,) = await fork
        typed(child)
        await delete_all(world)
        empty_after_deleting_all(world)

    asyncio.run(main())
