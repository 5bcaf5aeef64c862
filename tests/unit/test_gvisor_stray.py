"""`GvisorEngine.kill_stray` and `kill` on real processes (no runsc needed: a stand-in
process whose command line is a sandbox's, ``runsc-sandbox ... <vm id>``), with the
cgroup tree of tests/unit/test_cgroups.py where a test needs one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests._support.cgroups import _v1

from boxd.engine.base import MachineConfig
from boxd.engine.cgroups import Cgroups, Limits, VmCgroup
from boxd.engine.gvisor import _engine as gvisor_engine
from boxd.engine.gvisor._engine import GvisorEngine, GvisorMachine, Runsc
from boxd.engine.gvisor._spec import RunFiles


def _stand_in(vm_id: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["/usr/local/bin/runsc-sandbox", "-c", "import time; time.sleep(60)",
                             "--root=/x", vm_id], executable=sys.executable)


def _with_freezer(tmp: Path) -> Cgroups:
    """The v1 tree of tests/unit/test_cgroups.py plus a freezer hierarchy."""
    mounts, self_cg = _v1(tmp)
    freezer = tmp / "cgroup" / "freezer"
    freezer.mkdir()
    mounts.write_text(mounts.read_text() + f"cgroup {freezer} cgroup rw,freezer 0 0\n")
    return Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)


def _engine(tmp: Path, cgroups: Cgroups | None = None) -> GvisorEngine:
    return GvisorEngine("runsc", "0", tmp / "state", tmp / "agent", "ok", tmp / "rootfs.img",
                        cgroups=cgroups)


def test_a_sandbox_without_a_pid_file_is_found_by_its_command_line(tmp_path: Path) -> None:
    """runsc writes the pid file once the sandbox is up: a sandbox restored just before
    the daemon died may have none when the next daemon recovers. Without cgroups (whose
    sweep would kill it too) it is found by its command line, and only it is killed."""
    engine = _engine(tmp_path)
    target, other = _stand_in("m_strayvm"), _stand_in("m_othervm")
    try:
        time.sleep(0.2)  # both have exec'd
        assert engine.kill_stray("m_strayvm", tmp_path / "run")  # no pid file there
        assert target.wait(5) != 0
        assert other.poll() is None
        assert not engine.kill_stray("m_nosuchvm", tmp_path / "run")
        # A stale pid file (of a process now gone) does not spare the sandbox either.
        run = tmp_path / "run2"
        run.mkdir()
        (run / "sandbox.pid").write_text(f"{target.pid}\n")
        assert engine.kill_stray("m_othervm", run)
        assert other.wait(5) != 0
    finally:
        for p in (target, other):
            p.kill()
            p.wait()


def test_a_recorded_pid_that_is_gone_does_not_spare_the_sandboxs_new_process(
    tmp_path: Path,
) -> None:
    """A restore or a wake ends a sandbox and starts another for the same VM; a daemon
    killed before it recorded the new pid leaves a record naming the old one. The
    recovery's kill with that pid finds and kills the new sandbox all the same."""
    engine = _engine(tmp_path)
    old = _stand_in("m_swapped")
    old.kill()
    old.wait()
    new = _stand_in("m_swapped")
    try:
        time.sleep(0.2)
        assert engine.kill_stray("m_swapped", tmp_path / "run", old.pid)
        assert new.wait(5) != 0
    finally:
        new.kill()
        new.wait()


def test_a_kill_thaws_a_frozen_sandbox_first(tmp_path: Path) -> None:
    """A frozen task does not die until it is thawed: `kill` writes THAWED to the
    sandbox's freezer before its SIGKILL (a paused machine's cgroup is frozen)."""
    cg = _with_freezer(tmp_path)
    vm = cg.create("m_frozen", Limits(1 << 30))
    assert vm is not None and vm.set_frozen(True)
    engine = _engine(tmp_path, cg)
    proc = _stand_in("m_frozen")
    try:
        time.sleep(0.2)
        engine.kill("m_frozen", proc.pid, delete_state=False)
        assert (vm.dirs["freezer"] / "freezer.state").read_text() == "THAWED"
        assert proc.wait(5) != 0
    finally:
        proc.kill()
        proc.wait()


def test_a_cancelled_runsc_command_is_ended_not_left_running(tmp_path: Path) -> None:
    """A daemon closing while a standby copy is restored cancels `Runsc.run`: the runsc
    process is killed and reaped there, so it cannot start a sandbox after the caller's
    clean-up has looked for one."""
    fake = tmp_path / "runsc"
    pidfile = tmp_path / "pid"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 60\n")
    fake.chmod(0o755)

    async def main() -> None:
        task = asyncio.ensure_future(
            Runsc(str(fake), tmp_path, tmp_path).run("restore", "m_1", what="restore"))
        while not pidfile.exists() or not pidfile.read_text().strip():
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        pid = int(pidfile.read_text())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # gone, and reaped
        raise AssertionError(f"runsc (pid {pid}) still runs after the cancel")

    asyncio.run(main())


def _machine(tmp: Path, engine: GvisorEngine, cgroup: VmCgroup | None,
             pid: int | None = None) -> GvisorMachine:
    config = MachineConfig(id="m_spare", hostname="h", vcpus=1, memory_mib=256,
                           isolated=True, port=None, kernel=tmp / "k", initrd=tmp / "i",
                           cmdline="")
    return GvisorMachine(engine, config, RunFiles(tmp / "run"), pid or os.getpid(),
                         tmp / "disk", tmp / "log", None, cgroup)


def test_a_standby_copy_is_held_by_its_freezer_and_claimed_without_runsc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A standby copy stops in its frozen cgroup HOLD_AFTER after `hold`, with no
    ``runsc pause``, and its claim (`resume`) is the thaw alone: no ``runsc resume`` on
    the fork's path. A claim before the freeze cancels it. Without a freezer it is
    runsc-paused and resumed as before; a held copy that is then paused for real (a
    suspend) is resumed by runsc."""
    monkeypatch.setattr(gvisor_engine, "HOLD_AFTER", 0.05)
    calls = tmp_path / "calls"
    fake = tmp_path / "runsc"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    cg = _with_freezer(tmp_path)
    vm = cg.create("m_spare", Limits(1 << 30))
    assert vm is not None
    state = vm.dirs["freezer"] / "freezer.state"

    def runsc_verbs() -> list[str]:
        lines = calls.read_text().splitlines() if calls.exists() else []
        return [line.split()[-2] for line in lines]  # ... <verb> <vm id>

    async def main() -> None:
        engine = GvisorEngine(str(fake), "0", tmp_path / "state", tmp_path / "agent", "ok",
                              tmp_path / "rootfs.img", cgroups=cg)
        m = _machine(tmp_path, engine, vm, sandbox.pid)  # alive: its freeze comes
        await m.hold()
        assert state.read_text() == "THAWED"  # the Sentry's post-restore work runs first
        await asyncio.sleep(0.15)
        assert state.read_text() == "FROZEN"
        await m.resume()
        assert state.read_text() == "THAWED"
        await m.hold()
        await m.resume()  # claimed before the freeze: it never comes
        await asyncio.sleep(0.15)
        assert state.read_text() == "THAWED"
        assert runsc_verbs() == []
        await m.hold()
        await m.pause()
        await m.resume()
        assert runsc_verbs() == ["pause", "resume"]
        bare = _machine(tmp_path, engine, None)
        await bare.hold()
        await bare.resume()
        assert runsc_verbs() == ["pause", "resume", "pause", "resume"]

    sandbox = _stand_in("m_spare")
    try:
        asyncio.run(main())
    finally:
        sandbox.kill()
        sandbox.wait()


def test_the_state_root_does_not_list_machines_to_other_users(tmp_path: Path) -> None:
    """runsc's state files carry the machine ids: ``<shm>/gvisor`` is not readable by
    other users (issue 29, 8), also when it existed before with a wider mode."""
    (tmp_path / "state").mkdir(mode=0o755)
    (tmp_path / "state").chmod(0o755)
    _engine(tmp_path)
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o711


def test_a_stat_read_while_the_process_is_reaped_counts_as_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert gvisor_engine.stat_state("4242 (runsc-sandbox) S 1 2 3") == "S"
    assert gvisor_engine.stat_state("4242 (a) b) Z 1") == "Z"  # the name may hold ")"
    # /proc/PID/stat of a process being reaped can read as empty: gone, not IndexError
    # (a machine's DELETE answered 500 when it did)
    assert gvisor_engine.stat_state("") is None
    proc = _stand_in("m_reaped")
    try:
        vm_id = "m_reaped"
        real = Path.read_text

        def empty_stat(self: Path, *a: object, **kw: object) -> str:
            return "" if self.name == "stat" else real(self, *a, **kw)  # type: ignore[arg-type]

        deadline = time.monotonic() + 10
        while not gvisor_engine.sandbox_matches(proc.pid, vm_id):  # until it has exec'd
            assert time.monotonic() < deadline, "the stand-in never looked like a sandbox"
            time.sleep(0.05)
        monkeypatch.setattr(Path, "read_text", empty_stat)
        assert not gvisor_engine.sandbox_matches(proc.pid, vm_id)
    finally:
        proc.kill()
        proc.wait()


def test_the_engine_wide_runsc_log_is_the_daemons_alone(tmp_path: Path) -> None:
    """runsc's log for commands that name no machine lives in the state folder, which
    other users may pass through (0711): the engine makes it 0600 before runsc writes
    to it, and makes a log left 0644 by an older daemon private again."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "runsc.log").write_text("old\n")
    (state / "runsc.log").chmod(0o644)
    _engine(tmp_path)
    assert (state / "runsc.log").stat().st_mode & 0o777 == 0o600
    assert (state / "runsc.log").read_text() == "old\n"  # appended to, not truncated
