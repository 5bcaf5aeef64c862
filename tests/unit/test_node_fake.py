"""The core (control plane + node runtime + lifecycle) against the fake engine.

No QEMU: `boxd.engine.fake` keeps each machine's "memory" as a dict of files, so fork,
checkpoint and snapshot semantics are observable, failures are injected by name and
gates park an operation at one step to interleave another request exactly there. The
same behaviours on real machines are in tests/integration.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
from tests._support.fake_world import ACCOUNT, World, leftovers, make_world, run, running, sh

from boxd import errors, models
from boxd.engine.fake import FakeMachine
from boxd.models import MachineState
from boxd.node.lifecycle import TRANSITIONS, Lease, Lifecycle, require

S = MachineState
# ----------------------------------------------------------------- the table


def test_every_transition_in_the_table_is_taken_and_every_other_refused(world: World) -> None:
    async def main() -> None:
        m = await world.machines.create(ACCOUNT, models.MachineCreate(name="t"))
        life = Lifecycle(world.repos.machines)
        for src, dst in itertools.product(S, S):
            # put the record in ``src`` by the writer itself (any -> src is not always legal)
            world.repos.machines.compare_and_set(m.id, list(S), src)
            if dst in TRANSITIONS[src]:
                assert life.move(m.id, dst, expect=(src,)), (src, dst)
                assert world.state(m.id) == dst
            else:
                with pytest.raises(errors.StateError) as info:
                    life.move(m.id, dst, expect=(src,))
                assert info.value.details["state"] == src.value
                assert dst.value not in info.value.details["required"] or src == dst
                assert world.state(m.id) == src  # unchanged

    run(main())


def test_compare_and_set_loses_when_someone_else_moved_first(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        life = Lifecycle(world.repos.machines)
        assert life.move(m.id, S.SWAPPING, expect=(S.RUNNING,))
        # a second operation that read "running" earlier cannot also win
        assert not life.move(m.id, S.RESTORING, expect=(S.RUNNING,))
        assert world.state(m.id) == S.SWAPPING

    run(main())


def test_a_transition_that_raises_goes_back_to_where_it_came_from(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        life = Lifecycle(world.repos.machines)
        rec = world.repos.machines.get(m.id)
        assert rec is not None
        undone: list[S] = []

        async def undo() -> None:
            undone.append(world.state(m.id))  # runs before the move back

        with pytest.raises(RuntimeError, match="capture broke"):
            async with life.transition(rec, S.SWAPPING, S.RUNNING, undo=undo) as inside:
                assert inside.state == S.SWAPPING == world.state(m.id)
                raise RuntimeError("capture broke")
        assert undone == [S.SWAPPING]
        assert world.state(m.id) == S.RUNNING and life.is_running(m.id)
        # no error: it stays where the block left it
        async with life.transition(rec, S.SWAPPING, S.RUNNING):
            pass
        assert world.state(m.id) == S.SWAPPING

    run(main())


def test_a_transition_whose_undo_fails_marks_the_machine_failed(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        life = Lifecycle(world.repos.machines)
        rec = world.repos.machines.get(m.id)
        assert rec is not None

        async def undo() -> None:
            raise OSError("resume failed")

        with pytest.raises(OSError, match="resume failed"):
            async with life.transition(rec, S.HIBERNATING, S.RUNNING, undo=undo):
                raise RuntimeError("capture broke")
        after = world.repos.machines.get(m.id)
        assert after is not None and after.state == S.FAILED
        assert "capture broke" in (after.error or "") and "resume failed" in (after.error or "")
        with pytest.raises(errors.StateError):  # a failed machine cannot begin one
            async with life.transition(after, S.SWAPPING, S.RUNNING):
                pass

    run(main())


def test_require_names_the_state_and_what_is_required(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        world.repos.machines.compare_and_set(m.id, [S.RUNNING], S.FAILED, "boom")
        rec = world.repos.machines.get(m.id)
        assert rec is not None
        with pytest.raises(errors.StateError) as info:
            require(rec, S.RUNNING, S.STARTING)
        assert info.value.details == {"machine": "base", "state": "failed",
                                      "required": ["running", "starting"]}
        assert "restore a checkpoint" in info.value.hint

    run(main())


# -------------------------------------------------------------- create / exec


def test_create_is_starting_until_the_agent_answers_then_running(world: World) -> None:
    async def main() -> None:
        m = await world.machines.create(ACCOUNT, models.MachineCreate(name="web"))
        assert m.state == S.STARTING and m.node == "local" and m.engine == "fake"
        assert world.vm(m.id).guest.identities == 0
        ready = await world.machines.wait_until_ready(ACCOUNT, "web", timeout=5)
        assert ready.state == S.RUNNING
        assert world.vm(m.id).guest.hostname == "web"
        assert await sh(world, "web", "echo hi") == "hi\n"

    run(main())


def test_a_failed_boot_leaves_no_record_no_layer_and_frees_the_quota(world: World) -> None:
    async def main() -> None:
        world.engine.fail("boot", errors.HostSetupError("no QEMU here"))
        with pytest.raises(errors.HostSetupError):
            await world.machines.create(ACCOUNT, models.MachineCreate(name="x"))
        assert await world.machines.list(ACCOUNT) == []
        assert world.repos.layers.ids() == set()
        assert leftovers(world)["disks"] == []
        await world.machines.create(ACCOUNT, models.MachineCreate(name="x"))  # name free

    run(main())


@pytest.mark.parametrize(("raised", "answer", "says"), [
    (OSError(28, "No space left on device", "/var/lib/boxd/layers/l_1.qcow2"),
     errors.ResourceExhausted, "disk is full"),
    (PermissionError(13, "Permission denied", "/dev/kvm"), errors.MachineFailed,
     "PermissionError"),
    (RuntimeError("an engine's bug"), errors.MachineFailed, "RuntimeError"),
])
def test_a_launch_that_raises_a_non_boxd_error_answers_a_typed_one(
    world: World, raised: Exception, answer: type[errors.BoxdError], says: str
) -> None:
    # A bare OSError or an engine's bug was a 500 with no hint; now it is typed, the
    # host's path stays in the daemon's log, and nothing of the launch is left.
    async def main() -> None:
        world.engine.fail("boot", raised)
        with pytest.raises(answer) as info:
            await world.machines.create(ACCOUNT, models.MachineCreate(name="x"))
        assert says in info.value.message and "/var/lib" not in info.value.message
        assert info.value.hint
        assert await world.machines.list(ACCOUNT) == []
        assert world.repos.layers.ids() == set() and leftovers(world)["disks"] == []
        src = await running(world)
        world.engine.fail("start_from", raised)
        (child,) = await world.machines.fork(ACCOUNT, src.id, ["child"])  # per child
        assert isinstance(child, answer) and says in child.message
        assert {m.name for m in await world.machines.list(ACCOUNT)} == {src.name}

    run(main())


def test_quota_counts_machines_and_names_the_limit(world: World) -> None:
    async def main() -> None:
        world.repos.db.execute("UPDATE accounts SET machine_quota=2 WHERE id=?", (ACCOUNT,))
        await running(world, "a")
        await world.machines.create(ACCOUNT, models.MachineCreate(name="b"))
        with pytest.raises(errors.QuotaExceeded) as info:
            await world.machines.create(ACCOUNT, models.MachineCreate(name="c"))
        assert info.value.details == {"limit": 2, "used": 2}
        out = await world.machines.fork(ACCOUNT, "a", [None])  # per item, no exception
        assert isinstance(out[0], errors.QuotaExceeded)

    run(main())


def test_a_dead_vm_is_failed_by_its_watcher_and_reads_do_not_write(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        world.vm(m.id).kill("the QEMU process was killed by SIGKILL")
        await asyncio.sleep(0)  # the watcher runs
        got = await world.machines.get(ACCOUNT, m.id)
        assert got.state == S.FAILED and "SIGKILL" in (got.error or "")
        with pytest.raises(errors.MachineFailed) as info:
            await sh(world, m.id, "echo")
        assert "SIGKILL" in str(info.value)
        await world.machines.delete(ACCOUNT, m.id)
        assert leftovers(world) == {"disks": [], "run": [], "templates": [], "checkpoints": []}

    run(main())


def test_get_and_list_never_change_a_record(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        m = await running(world)
        writes: list[str] = []
        monkeypatch.setattr(world.repos.machines, "compare_and_set",
                            lambda *a, **k: writes.append("state") or True)
        monkeypatch.setattr(world.repos.machines, "update",
                            lambda *a, **k: writes.append("update"))
        # The process is gone, but only its watcher may say so: a read (which does
        # not yield to the event loop, so the watcher cannot run meanwhile) reports.
        world.vm(m.id).kill()
        assert (await world.machines.get(ACCOUNT, m.id)).state == S.RUNNING
        assert [x.state for x in await world.machines.list(ACCOUNT)] == [S.RUNNING]
        assert writes == []
        await asyncio.sleep(0)
        assert writes == ["state"]  # the watcher's one compare-and-set

    run(main())


# ---------------------------------------------------------------------- fork


def test_fork_children_continue_from_the_source_and_the_template_is_reused(
    world: World,
) -> None:
    async def main() -> None:
        src = await running(world)
        await sh(world, src.id, "write /root/a 1")
        a, b = await world.machines.fork(ACCOUNT, src.id, ["a", "b"])
        assert isinstance(a, models.Machine) and isinstance(b, models.Machine)
        assert a.state == S.RUNNING and a.parent_id == src.id
        assert await sh(world, "a", "cat /root/a") == "1"
        assert world.vm(a.id).guest.hostname == "a"
        captures = world.engine.calls.count("capture")
        await world.machines.fork(ACCOUNT, src.id, ["c"])  # unchanged source: same template
        assert world.engine.calls.count("capture") == captures
        await sh(world, src.id, "write /root/a 2")  # changed: a new template
        (d,) = await world.machines.fork(ACCOUNT, src.id, ["d"])
        assert isinstance(d, models.Machine) and d.state == S.RUNNING
        assert world.engine.calls.count("capture") == captures + 1
        assert await sh(world, "d", "cat /root/a") == "2"
        assert await sh(world, "a", "cat /root/a") == "1"  # children are independent

    run(main())


def test_one_child_forks_in_flight_together_ask_for_as_many_standby_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The spec's rollout loop forks one child per thread, 8 at once: the pool then keeps
    8 standby children of the template, as one fork of count 8 would."""
    w = make_world(tmp_path, monkeypatch, spares=8)
    real = w.engine.start_from
    release = asyncio.Event()
    release.set()
    waiting: list[object] = []

    async def start_from(*args: Any, **kw: Any) -> Any:
        if not kw.get("paused"):  # an on-demand child: hold it until all 8 are in flight
            waiting.append(args[0])
            await release.wait()
        return await real(*args, **kw)

    monkeypatch.setattr(w.engine, "start_from", start_from)
    real_resume = FakeMachine.resume

    async def resume(self: FakeMachine) -> None:  # the claim of a spare: held likewise
        waiting.append(self)
        await release.wait()
        await real_resume(self)

    monkeypatch.setattr(FakeMachine, "resume", resume)

    async def main() -> None:
        src = await running(w)
        await w.machines.fork(ACCOUNT, src.id, [None])  # the template, and one spare
        while w.node.spares._tasks:
            await asyncio.gather(*list(w.node.spares._tasks))
        (tpl_id,) = {r.template_id for r in w.repos.machines.list(ACCOUNT) if r.template_id}
        assert w.node.spares.count(tpl_id) == 1
        release.clear()
        waiting.clear()
        forks = asyncio.gather(*(w.machines.fork(ACCOUNT, src.id, [None]) for _ in range(8)))
        while len(waiting) < 8:  # 7 started on demand, one claimed the spare: all held
            await asyncio.sleep(0.001)
        release.set()
        assert all(isinstance(m, models.Machine) for (m,) in await forks)
        while w.node.spares._tasks:
            await asyncio.gather(*list(w.node.spares._tasks))
        assert w.node.spares.count(tpl_id) == 8
        await w.node.spares.close()

    try:
        run(main())
    finally:
        w.repos.db.close()


def test_a_failed_fork_child_is_its_own_error_and_leaves_nothing(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        await world.machines.fork(ACCOUNT, src.id, ["warm"])  # template made
        before = leftovers(world)
        world.engine.fail("start_from")
        ok, bad = await world.machines.fork(ACCOUNT, src.id, ["ok", "bad"])
        results = {isinstance(ok, models.Machine), isinstance(bad, models.Machine)}
        assert results == {True, False}  # exactly one of the two failed
        err = ok if isinstance(ok, Exception) else bad
        assert isinstance(err, errors.InternalError) and "fork child" in str(err)
        names = {m.name for m in await world.machines.list(ACCOUNT)}
        assert len(names & {"ok", "bad"}) == 1
        after = leftovers(world)
        assert len(after["disks"]) == len(before["disks"]) + 1  # only the good child's layer
        assert len(after["run"]) == len(before["run"]) + 1

    run(main())


def test_fork_of_a_failed_source_fails_the_batch_and_frees_the_claims(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        world.vm(src.id).kill()
        await asyncio.sleep(0)
        with pytest.raises(errors.MachineFailed):
            await world.machines.fork(ACCOUNT, src.id, ["x", "y"])
        assert [m.name for m in await world.machines.list(ACCOUNT)] == ["base"]

    run(main())


def test_status_polled_while_a_fork_child_gets_its_own_ram(world: World) -> None:
    """The race of issue 11: forking a fork child swaps its VM process while another
    task polls it. The poller sees ``swapping``, never ``failed``; an exec sent during the
    swap waits for it; the child ends running with its memory."""

    async def main() -> None:
        src = await running(world)
        await sh(world, src.id, "write /root/f src")
        (child,) = await world.machines.fork(ACCOUNT, src.id, ["child"])
        assert isinstance(child, models.Machine)
        old_vm = world.vm(child.id)
        reached, release = world.engine.gate("start_from")  # the swap's new process
        fork = asyncio.create_task(world.machines.fork(ACCOUNT, "child", ["grandchild"]))
        await reached.wait()
        seen = {(await world.machines.get(ACCOUNT, "child")).state for _ in range(20)}
        assert seen == {S.SWAPPING}
        assert old_vm.destroyed  # the old process is gone, and that is not a failure
        exec_task = asyncio.create_task(sh(world, "child", "cat /root/f"))
        await asyncio.sleep(0.01)
        assert not exec_task.done()  # waits for the swap
        release.set()
        (grandchild,) = await fork
        assert isinstance(grandchild, models.Machine)
        assert await exec_task == "src"
        got = await world.machines.get(ACCOUNT, "child")
        assert got.state == S.RUNNING and got.error is None
        assert await sh(world, "grandchild", "cat /root/f") == "src"
        rec = world.repos.machines.get(child.id)
        assert rec is not None and rec.ram_shared and rec.template_id is None

    run(main())


def test_a_failed_swap_leaves_the_machine_failed_with_the_reason(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        (child,) = await world.machines.fork(ACCOUNT, src.id, ["child"])
        assert isinstance(child, models.Machine)
        world.engine.fail("start_from", errors.ResourceExhausted("no room on /dev/shm"))
        with pytest.raises(errors.ResourceExhausted):
            await world.machines.fork(ACCOUNT, "child", ["g"])
        got = await world.machines.get(ACCOUNT, "child")
        assert got.state == S.FAILED and "no room on /dev/shm" in (got.error or "")
        assert "g" not in {m.name for m in await world.machines.list(ACCOUNT)}

    run(main())


def test_a_failed_template_capture_resumes_the_source(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        world.engine.fail("capture")
        with pytest.raises(errors.InternalError):
            await world.machines.fork(ACCOUNT, src.id, ["x"])
        assert world.state(src.id) == S.RUNNING and not world.vm(src.id).paused
        assert [m.name for m in await world.machines.list(ACCOUNT)] == ["base"]
        assert leftovers(world)["templates"] == []

    run(main())


def test_templates_and_layers_are_collected_when_nothing_uses_them(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        kids = await world.machines.fork(ACCOUNT, src.id, ["a", "b"])
        assert len(leftovers(world)["templates"]) == 1
        for k in kids:
            assert isinstance(k, models.Machine)
            await world.machines.delete(ACCOUNT, k.id)
        assert len(leftovers(world)["templates"]) == 1  # the source may fork again
        await sh(world, src.id, "write /x 1")  # changed source: its template is stale
        world.node.gc()
        assert leftovers(world)["templates"] == []
        await world.machines.delete(ACCOUNT, src.id)
        assert leftovers(world) == {"disks": [], "run": [], "templates": [], "checkpoints": []}
        assert world.repos.layers.ids() == set()

    run(main())


# --------------------------------------------------------------- checkpoints


def test_checkpoint_restore_rewinds_and_revives_a_failed_machine(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        await sh(world, m.id, "write /root/x before")
        await world.machines.checkpoint_save(ACCOUNT, m.id, "start")
        await sh(world, m.id, "write /root/x after")
        restored = await world.machines.checkpoint_restore(ACCOUNT, m.id, "start")
        assert restored.state == S.RUNNING and restored.id == m.id and restored.port == m.port
        assert await sh(world, m.id, "cat /root/x") == "before"
        world.vm(m.id).kill()
        await asyncio.sleep(0)
        assert world.state(m.id) == S.FAILED
        again = await world.machines.checkpoint_restore(ACCOUNT, m.id, "start")
        assert again.state == S.RUNNING and again.error is None

    run(main())


def test_a_failed_restore_is_failed_with_the_reason(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        await world.machines.checkpoint_save(ACCOUNT, m.id, "c")
        world.engine.fail("start_from")
        with pytest.raises(errors.InternalError):
            await world.machines.checkpoint_restore(ACCOUNT, m.id, "c")
        got = await world.machines.get(ACCOUNT, m.id)
        assert got.state == S.FAILED and "injected failure" in (got.error or "")

    run(main())


def test_a_failed_checkpoint_save_keeps_the_machine_running_and_records_nothing(
    world: World,
) -> None:
    async def main() -> None:
        m = await running(world)
        world.engine.fail("capture")
        with pytest.raises(errors.InternalError):
            await world.machines.checkpoint_save(ACCOUNT, m.id, "c")
        assert world.state(m.id) == S.RUNNING and not world.vm(m.id).paused
        assert await world.machines.checkpoint_list(ACCOUNT, m.id) == []
        assert leftovers(world)["checkpoints"] == []
        with pytest.raises(errors.CheckpointNotFound):
            await world.machines.checkpoint_restore(ACCOUNT, m.id, "c")

    run(main())


# ------------------------------------------------------------------- snapshots


def test_snapshot_save_and_start_from_it(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        await sh(world, src.id, "write /root/env v3")
        snap = await world.snapshots.save(ACCOUNT, src.id, "env-v3")
        assert snap.version == 1 and snap.engine == "fake"
        with pytest.raises(errors.AlreadyExists):
            await world.snapshots.save(ACCOUNT, src.id, "env-v3")
        m = await world.machines.create(
            ACCOUNT, models.MachineCreate(name="copy", from_snapshot="env-v3")
        )
        assert m.state == S.RUNNING and m.snapshot == snap.digest.removeprefix("sha256:")
        assert await sh(world, "copy", "cat /root/env") == "v3"

    run(main())


def test_a_start_from_a_snapshot_whose_blobs_are_gone_leaves_no_machine(world: World) -> None:
    """A snapshot whose blobs are missing (deleted from the store behind boxd's back)
    answers a typed error; no `failed` machine is left to count against the quota
    (issue 29, 7)."""
    async def main() -> None:
        src = await running(world)
        snap = await world.snapshots.save(ACCOUNT, src.id, "env")
        manifest = world.machines.store.get(snap.digest.removeprefix("sha256:"))
        for kind in manifest.blobs:
            path = manifest.blob_path(kind)
            path.chmod(0o644)
            path.unlink()
        world.repos.db.execute("UPDATE accounts SET machine_quota=2 WHERE id=?", (ACCOUNT,))
        with pytest.raises(errors.IntegrityError, match="blob is missing"):
            await world.machines.create(
                ACCOUNT, models.MachineCreate(name="copy", from_snapshot="env"))
        assert [m.name for m in await world.machines.list(ACCOUNT)] == ["base"]
        await world.machines.create(ACCOUNT, models.MachineCreate(name="copy"))  # a slot

    run(main())


# -------------------------------------------------------------------- delete


def test_requests_on_a_deleted_machine_are_not_found(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        await world.machines.delete(ACCOUNT, m.id)
        for call in (
            world.machines.get(ACCOUNT, m.id),
            world.machines.exec(ACCOUNT, m.id, models.ExecRequest(command="echo")),
            world.machines.fork(ACCOUNT, m.id, [None]),
            world.machines.checkpoint_save(ACCOUNT, m.id, "c"),
            world.machines.delete(ACCOUNT, m.id),
        ):
            with pytest.raises(errors.MachineNotFound):
                await call

    run(main())


# ------------------------------------------------------------------ recovery


def test_recovery_reattaches_fails_the_gone_and_sweeps_strays(world: World) -> None:
    async def main() -> None:
        alive = await running(world, "alive")
        gone = await running(world, "gone")
        half = await world.machines.create(ACCOUNT, models.MachineCreate(name="half"))
        half_vm = world.vm(half.id)  # its VM started; its pid was not recorded yet
        world.repos.machines.update(half.id, pid=None)  # as if killed mid-launch
        world.vm(gone.id).kill()
        stray = world.paths.run_dir("m_stray")
        stray.mkdir(parents=True)
        await world.node.close()
        node = world.restart()
        await world.machines.recover()
        assert world.state(alive.id) == S.RUNNING
        assert await sh(world, "alive", "echo back") == "back\n"
        assert world.state(gone.id) == S.FAILED
        assert world.state(half.id) == S.FAILED
        assert not half_vm.alive()  # no orphan VM of a record killed mid-launch
        assert not stray.exists()
        assert node.live.keys() == {alive.id}

    run(main())


def test_recovery_kills_a_vm_that_is_alive_but_does_not_answer(
    world: World, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A VM whose re-attach fails (its QMP did not answer in time on a loaded host) was
    # marked failed and left running: a QEMU process no record owned (test_faults'
    # fork-batch kill on the whole suite's daemon).
    from boxd.engine import fake

    async def main() -> None:
        stuck = await running(world, "stuck")
        vm = world.vm(stuck.id)
        await world.node.close()
        world.restart()

        async def no_answer(self: fake.FakeMachine) -> str | None:
            raise errors.MachineFailed("its QMP did not answer", machine=self.config.id)

        monkeypatch.setattr(fake.FakeMachine, "recover", no_answer)
        await world.machines.recover()
        assert world.state(stuck.id) == S.FAILED
        assert not vm.alive()

    run(main())


# --------------------------------------------------------------------- lease


def test_replace_closes_the_gate_and_waits_for_users_in_flight() -> None:
    async def main() -> None:
        lease = Lease()
        order: list[str] = []

        async def user(tag: str, hold: float) -> None:
            async with lease.use():
                order.append(f"{tag}+")
                await asyncio.sleep(hold)
                order.append(f"{tag}-")

        first = asyncio.create_task(user("a", 0.05))
        await asyncio.sleep(0.01)

        async def replace() -> None:
            async with lease.op(), lease.replace(drain=1.0):
                order.append("swap")

        swap = asyncio.create_task(replace())
        await asyncio.sleep(0.01)
        late = asyncio.create_task(user("b", 0))
        await asyncio.gather(first, swap, late)
        assert order == ["a+", "a-", "swap", "b+", "b-"]

    asyncio.run(main())


# ----------------------------------------------------- suspend, hibernate, wake


def test_suspend_then_exec_wakes_with_memory_and_clock_step(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        await sh(world, m.id, "write /dev/shm/counter 7")
        got = await world.machines.suspend(ACCOUNT, m.id)
        assert got.state == S.SUSPENDED and world.vm(m.id).paused
        again = await world.machines.suspend(ACCOUNT, m.id)  # idempotent
        assert again.state == S.SUSPENDED and world.vm(m.id).paused
        steps = world.vm(m.id).guest.clock_steps
        assert await sh(world, m.id, "cat /dev/shm/counter") == "7"  # woke transparently
        assert world.state(m.id) == S.RUNNING and not world.vm(m.id).paused
        assert world.vm(m.id).guest.clock_steps == steps + 1

    run(main())


def test_concurrent_requests_share_one_wake(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        await world.machines.suspend(ACCOUNT, m.id)
        resumes = world.engine.calls.count("resume")
        outs = await asyncio.gather(*(sh(world, m.id, f"echo {i}") for i in range(5)))
        assert outs == [f"{i}\n" for i in range(5)]
        assert world.engine.calls.count("resume") == resumes + 1

    run(main())


def test_hibernate_ends_the_vm_and_wake_restores_it(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        await sh(world, m.id, "write /dev/shm/counter 3")
        vm = world.vm(m.id)
        got = await world.machines.hibernate(ACCOUNT, m.id)
        assert got.state == S.HIBERNATED and vm.destroyed
        rec = world.repos.machines.get(m.id)
        assert rec is not None and rec.pid is None and rec.vm_id not in world.engine.running
        assert (world.paths.hibernated / m.id / "complete").exists()
        with pytest.raises(errors.StateError) as info:
            await world.machines.suspend(ACCOUNT, m.id)  # suspending a hibernated machine
        assert info.value.details["state"] == "hibernated"
        woke = await world.machines.resume(ACCOUNT, m.id)
        assert woke.state == S.RUNNING and woke.port == m.port and woke.id == m.id
        assert await sh(world, m.id, "cat /dev/shm/counter") == "3"
        assert not (world.paths.hibernated / m.id).exists()

    run(main())


def test_a_hibernated_source_forks_from_its_template_and_a_request_wakes_it(
    world: World,
) -> None:
    async def main() -> None:
        src = await running(world)
        await sh(world, src.id, "write /root/f x")
        await world.machines.fork(ACCOUNT, src.id, ["a"])
        await world.machines.hibernate(ACCOUNT, src.id)
        (b,) = await world.machines.fork(ACCOUNT, src.id, ["b"])  # same template, no wake
        assert isinstance(b, models.Machine) and world.state(src.id) == S.HIBERNATED
        assert await sh(world, "b", "cat /root/f") == "x"
        assert await sh(world, src.id, "cat /root/f") == "x"  # exec wakes it
        assert world.state(src.id) == S.RUNNING

    run(main())


def test_hibernated_machines_free_their_quota_and_waking_needs_one(world: World) -> None:
    async def main() -> None:
        world.repos.db.execute("UPDATE accounts SET machine_quota=1 WHERE id=?", (ACCOUNT,))
        a = await running(world, "a")
        await world.machines.hibernate(ACCOUNT, a.id)
        b = await running(world, "b")  # a does not count while hibernated
        with pytest.raises(errors.QuotaExceeded) as info:
            await sh(world, a.id, "echo")
        assert info.value.details == {"limit": 1, "used": 1}
        assert "--max-machines" in info.value.hint
        assert world.state(a.id) == S.HIBERNATED  # still hibernated, nothing lost
        await world.machines.delete(ACCOUNT, b.id)
        assert await sh(world, a.id, "echo up") == "up\n"

    run(main())


def test_a_wake_whose_image_is_gone_fails_the_machine_with_the_reason(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        await world.machines.hibernate(ACCOUNT, m.id)
        (world.paths.hibernated / m.id / "state").unlink()
        with pytest.raises(errors.MachineFailed) as info:
            await sh(world, m.id, "echo")
        assert "hibernation image" in str(info.value)
        got = await world.machines.get(ACCOUNT, m.id)
        assert got.state == S.FAILED and "hibernation image" in (got.error or "")

    run(main())


def test_a_wake_that_does_not_load_fails_the_machine(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        await world.machines.hibernate(ACCOUNT, m.id)
        world.engine.fail("start_from", errors.IntegrityError("the image does not load"))
        with pytest.raises(errors.MachineFailed):
            await world.machines.resume(ACCOUNT, m.id)
        assert world.state(m.id) == S.FAILED

    run(main())


def test_a_failed_hibernate_capture_leaves_it_running(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        world.engine.fail("capture")
        with pytest.raises(errors.InternalError):
            await world.machines.hibernate(ACCOUNT, m.id)
        assert world.state(m.id) == S.RUNNING and not world.vm(m.id).paused
        assert not (world.paths.hibernated / m.id).exists()
        assert await sh(world, m.id, "echo ok") == "ok\n"

    run(main())


def test_delete_suspended_and_hibernated_machines(world: World) -> None:
    async def main() -> None:
        a = await running(world, "a")
        b = await running(world, "b")
        await world.machines.suspend(ACCOUNT, a.id)
        await world.machines.hibernate(ACCOUNT, b.id)
        await world.machines.delete(ACCOUNT, a.id)
        await world.machines.delete(ACCOUNT, b.id)
        assert await world.machines.list(ACCOUNT) == []
        assert list(world.paths.hibernated.iterdir()) == []
        assert leftovers(world) == {"disks": [], "run": [], "templates": [], "checkpoints": []}

    run(main())


def test_idle_timers_suspend_then_hibernate_and_status_reads_do_not_count(
    world: World,
) -> None:
    async def main() -> None:
        m = await world.machines.create(
            ACCOUNT, models.MachineCreate(name="w", suspend_after=10, hibernate_after=100)
        )
        await world.machines.wait_until_ready(ACCOUNT, m.id, timeout=5)
        never = await world.machines.create(
            ACCOUNT, models.MachineCreate(name="n", suspend_after=0, hibernate_after=0)
        )
        await world.machines.wait_until_ready(ACCOUNT, never.id, timeout=5)
        t0 = time.time()

        async def tick(at: float) -> None:
            await world.node.idle_tick(t0 + at)
            while world.node.idle.ops:
                await asyncio.sleep(0)

        await tick(5)
        assert world.state(m.id) == S.RUNNING
        for _ in range(3):
            await world.machines.get(ACCOUNT, m.id)  # polls are not activity
            await world.machines.list(ACCOUNT)
        await tick(11)
        assert world.state(m.id) == S.SUSPENDED
        await tick(101)
        assert world.state(m.id) == S.HIBERNATED
        assert world.state(never.id) == S.RUNNING  # 0 means never
        got = await world.machines.get(ACCOUNT, m.id)
        assert got.suspend_after == 10 and got.idle_seconds is not None

    run(main())


def test_an_exec_in_flight_keeps_a_machine_from_idling(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        reached, release = world.engine.gate("exec")
        task = asyncio.create_task(sh(world, m.id, "echo long"))
        await reached.wait()
        await world.node.idle_tick(time.time() + 10_000)
        await asyncio.sleep(0)
        assert world.state(m.id) == S.RUNNING and not world.node.idle.ops
        release.set()
        assert await task == "long\n"

    run(main())


def test_recovery_keeps_suspended_and_finishes_an_interrupted_hibernation(
    world: World,
) -> None:
    async def main() -> None:
        sus = await running(world, "sus")
        hib = await running(world, "hib")
        await world.machines.suspend(ACCOUNT, sus.id)
        await world.machines.hibernate(ACCOUNT, hib.id)
        # a daemon killed while hibernating, after the image was sealed
        world.repos.machines.compare_and_set(hib.id, [S.HIBERNATED], S.HIBERNATING)
        await world.node.close()
        world.restart()
        await world.machines.recover()
        assert world.state(sus.id) == S.SUSPENDED and world.vm(sus.id).paused
        assert world.state(hib.id) == S.HIBERNATED
        assert await sh(world, "hib", "echo back") == "back\n"
        assert await sh(world, "sus", "echo back") == "back\n"
        await world.node.close()

    run(main())


def test_a_failed_snapshot_save_keeps_the_machine_running_and_registers_nothing(
    world: World,
) -> None:
    async def main() -> None:
        m = await running(world)
        world.engine.fail("flatten_disk", errors.ResourceExhausted("disk full"))
        with pytest.raises(errors.ResourceExhausted):
            await world.snapshots.save(ACCOUNT, m.id, "s")
        assert world.state(m.id) == S.RUNNING and not world.vm(m.id).paused
        assert await world.snapshots.list(ACCOUNT) == []
        assert list(world.snapshots.store.staging_dir.iterdir()) == []
        assert await sh(world, m.id, "echo ok") == "ok\n"
        snap = await world.snapshots.save(ACCOUNT, m.id, "s")  # the name is still free
        assert snap.version == 1

    run(main())


def test_a_gc_during_a_launch_keeps_the_new_layer(world: World) -> None:
    """A sibling's delete or a background collapse collects garbage while a child's VM
    starts: the child's new layer, recorded but not yet referenced, must survive."""

    async def main() -> None:
        src = await running(world)
        await world.machines.fork(ACCOUNT, src.id, ["warm"])  # the template exists
        reached, release = world.engine.gate("start_from")
        fork = asyncio.create_task(world.machines.fork(ACCOUNT, src.id, ["child"]))
        await reached.wait()
        world.node.gc()  # e.g. `warm` deleted right now
        release.set()
        (child,) = await fork
        assert isinstance(child, models.Machine), child
        rec = world.repos.machines.get(child.id)
        assert rec is not None and rec.layer_id is not None
        assert world.repos.layers.get(rec.layer_id) is not None
        assert world.node.layer_path(rec.layer_id).exists()

    run(main())


def test_a_gc_during_a_freeze_keeps_the_new_active_layer(world: World) -> None:
    async def main() -> None:
        src = await running(world)
        reached, release = world.engine.gate("freeze_disk")
        save = asyncio.create_task(world.machines.checkpoint_save(ACCOUNT, src.id, "c"))
        await reached.wait()
        world.node.gc()
        release.set()
        await save
        rec = world.repos.machines.get(src.id)
        assert rec is not None and rec.layer_id is not None
        assert world.repos.layers.get(rec.layer_id) is not None
        assert await sh(world, src.id, "echo ok") == "ok\n"

    run(main())


# ----------------------------------------------------- process streams (boxd.rl)


def test_process_frames_read_no_record_while_running_and_still_wake_a_machine(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path of a step channel: a frame to a running machine reads nothing from
    the database; a suspended one is still woken by the next frame."""
    from boxd import process_models as pm

    reads: list[str] = []
    get = world.repos.machines.get

    def counting_get(machine_id: str):  # type: ignore[no-untyped-def]
        reads.append(machine_id)
        return get(machine_id)

    async def main() -> None:
        m = await running(world)
        p = await world.machines.spawn(ACCOUNT, m.id, pm.SpawnRequest(argv=["cat"]))
        async with world.machines.process_attach(ACCOUNT, m.id, p.id) as stream:
            await stream.send(b"warm")
            assert await stream.recv() == b"warm"
            monkeypatch.setattr(world.repos.machines, "get", counting_get)
            for i in range(20):
                await stream.send(b"%d" % i)
                assert await stream.recv() == b"%d" % i
            assert reads == []
            monkeypatch.setattr(world.repos.machines, "get", get)
            await world.machines.suspend(ACCOUNT, m.id)
            await stream.send(b"wake up")
            assert await stream.recv() == b"wake up"
            assert world.state(m.id) == S.RUNNING and not world.vm(m.id).paused


# ------------------------------------------------------------- the in-guest API


def test_each_vm_process_gets_its_own_guest_credential_and_delete_revokes_it(
    world: World,
) -> None:
    import hashlib

    async def no_streams(caller: object, stream: object) -> None:
        raise AssertionError("the fake guest never connects")

    world.node.serve_guests(no_streams)

    def key(machine_id: str) -> str:
        keys = world.vm(machine_id).guest.api_keys
        assert keys, "no credential was delivered"
        digest = world.node.guest_key_hash(machine_id)
        assert digest == hashlib.sha256(keys[-1].encode()).hexdigest()  # the current one
        return keys[-1]

    async def main() -> None:
        src = await running(world)  # a cold boot: delivered before it is ready
        first = key(src.id)
        (child,) = await world.machines.fork(ACCOUNT, src.id, ["child"])
        assert isinstance(child, models.Machine)
        assert key(child.id) != first  # a fork child never holds its parent's
        assert key(src.id) == first
        await world.machines.checkpoint_save(ACCOUNT, src.id, "ck")
        await world.machines.checkpoint_restore(ACCOUNT, src.id, "ck")
        restored = key(src.id)
        assert restored != first
        await world.machines.suspend(ACCOUNT, src.id)
        await world.machines.resume(ACCOUNT, src.id)
        assert key(src.id) == restored  # same VM process, same connection: kept
        await world.machines.hibernate(ACCOUNT, src.id)
        assert world.node.guest_key_hash(src.id) is None  # no VM, no credential
        await world.machines.resume(ACCOUNT, src.id)
        assert key(src.id) != restored  # a wake is a new VM process
        await world.machines.delete(ACCOUNT, child.id)
        assert world.node.guest_key_hash(child.id) is None
        iso = await world.machines.create(ACCOUNT, models.MachineCreate(name="iso",
                                                                        isolated=True))
        await world.machines.wait_until_ready(ACCOUNT, iso.id, timeout=5)
        assert world.vm(iso.id).guest.api_keys == []
        assert world.node.guest_key_hash(iso.id) is None
        await world.node.close()

    run(main())


def test_free_ports_are_never_handed_out_twice_in_a_row() -> None:
    # A URL port and a forward port picked a moment apart must differ (a VM's forward
    # bound to the URL's port left the URL answering 502).
    from boxd.node._ports import free_port

    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_free_ports_stay_outside_the_kernels_ephemeral_range() -> None:
    # Another process's bind(0), or an outgoing connection's source port, is drawn from
    # the ephemeral range: a port picked there could be taken before passt binds it
    # (passt then exits and the machine has no network).
    from boxd.node._ports import bands, ephemeral_range, free_port

    lo, hi = ephemeral_range()
    assert all(not lo <= free_port() <= hi for _ in range(500))
    assert bands((32768, 60999)) == [range(20000, 32768), range(61000, 65536)]
    assert bands((1024, 65535)) == []  # nothing outside: the kernel picks
    assert bands((40000, 65535)) == [range(20000, 40000)]


def test_ephemeral_range_falls_back_to_linuxs_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from boxd.node._ports import ephemeral_range

    (tmp_path / "r").write_text("10000\t20000\n")
    assert ephemeral_range(tmp_path / "r") == (10000, 20000)
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)
