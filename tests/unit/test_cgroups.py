"""The cgroup logic of boxd.engine.cgroups on directory trees laid out like cgroupfs.

Plain directories stand in for the kernel's files here (what is written where, which
version is picked, what a sweep removes); tests/integration/test_cgroups.py checks
the same on the host's real cgroups with real machines. A real v2 host cannot be
tested on this v1 host kind.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests._support.cgroups import _v1

from boxd.config import Settings
from boxd.engine.cgroups import PIDS_MAX, QEMU_OVERHEAD_MIB, Cgroups, Limits, memory_limit
from boxd.engine.qemu._process import QemuProcess

MIB = 1 << 20


def _v2(tmp: Path, controllers: str = "cpuset cpu io memory pids") -> tuple[Path, Path]:
    root = tmp / "cgroup"
    (root / "svc").mkdir(parents=True)
    (root / "svc" / "cgroup.controllers").write_text(controllers + "\n")
    mounts = tmp / "mounts"
    mounts.write_text(f"cgroup2 {root} cgroup2 rw,nsdelegate 0 0\n")
    self_cg = tmp / "self_cgroup"
    self_cg.write_text("0::/svc\n")
    return mounts, self_cg


def test_memory_limit_is_guest_ram_plus_overhead() -> None:
    assert memory_limit(1024, ram_shared=True) == (1024 + QEMU_OVERHEAD_MIB) * MIB
    # A process that maps an image privately holds copy-on-write pages and, while it
    # takes over RAM of its own, a full-RAM capture on tmpfs.
    assert memory_limit(1024, ram_shared=False) == (2048 + QEMU_OVERHEAD_MIB) * MIB


def test_v1_nests_under_the_daemons_cgroup_and_writes_the_limits(tmp_path: Path) -> None:
    mounts, self_cg = _v1(tmp_path, own_memory="/outer/job")
    cg = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
    assert cg.available and cg.version == 1 and cg.reason == ""
    root = tmp_path / "cgroup"
    assert cg.parents == {"memory": root / "memory/outer/job/boxd-abc",
                          "cpu": root / "cpu,cpuacct/boxd-abc", "pids": root / "pids/boxd-abc"}
    vm = cg.create("m_1", Limits(memory_limit(512, ram_shared=True)))
    assert vm is not None
    assert (cg.parents["memory"] / "m_1/memory.limit_in_bytes").read_text() == \
        str((512 + QEMU_OVERHEAD_MIB) * MIB)
    assert (cg.parents["cpu"] / "m_1/cpu.shares").read_text() == "1024"
    assert (cg.parents["pids"] / "m_1/pids.max").read_text() == str(PIDS_MAX)
    cg.create("m_2", Limits(1 << 30))
    # The parent weighs one machine per machine in it.
    assert (cg.parents["cpu"] / "cpu.shares").read_text() == "2048"
    assert "cgroup v1" in cg.summary() and "384 MiB" in cg.summary()


def test_v2_enables_the_controllers_for_the_subtree(tmp_path: Path) -> None:
    mounts, self_cg = _v2(tmp_path)
    cg = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
    parent = tmp_path / "cgroup/svc/boxd-abc"
    assert cg.available and cg.version == 2
    assert cg.parents == {"memory": parent, "cpu": parent, "pids": parent}
    assert (tmp_path / "cgroup/svc/cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    vm = cg.create("m_1", Limits(5 * MIB, pids=7))
    assert vm is not None and vm.paths == [parent / "m_1"]
    assert (parent / "m_1/memory.max").read_text() == str(5 * MIB)
    assert (parent / "m_1/memory.swap.max").read_text() == "0"
    assert (parent / "m_1/cpu.weight").read_text() == "100"
    assert (parent / "m_1/pids.max").read_text() == "7"


def test_a_machine_cgroup_can_run_idle_and_back(tmp_path: Path) -> None:
    """`set_idle` writes ``cpu.idle`` (a standby copy's whole sandbox yields CPU); the
    real kernel's effect is checked on this host in tests/integration/test_gvisor.py."""
    mounts, self_cg = _v1(tmp_path)
    vm = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg).create("m_1", Limits(1 << 30))
    assert vm is not None
    assert vm.set_idle(True) and (vm.dirs["cpu"] / "cpu.idle").read_text() == "1"
    assert vm.set_idle(False) and (vm.dirs["cpu"] / "cpu.idle").read_text() == "0"
    # A kernel without cpu.idle refuses the write: False, so the caller falls back.
    (vm.dirs["cpu"] / "cpu.idle").unlink()
    (vm.dirs["cpu"] / "cpu.idle").mkdir()
    assert not vm.set_idle(True)
    # No CPU controller: nothing to write.
    mounts2, self_cg2 = _v2(tmp_path / "v2", controllers="memory pids")
    vm2 = Cgroups.open("boxd-abc", mounts=mounts2, self_cgroup=self_cg2).create(
        "m_2", Limits(1 << 30))
    assert vm2 is not None and "cpu" not in vm2.dirs and not vm2.set_idle(True)


def test_a_machine_cgroup_can_be_frozen_and_thawed(tmp_path: Path) -> None:
    """`set_frozen` writes v1's ``freezer.state`` (the freezer hierarchy is used where
    it is mounted, never required) or v2's ``cgroup.freeze``; False where neither can
    be written. The kernel's effect is checked in tests/integration/test_gvisor.py."""
    mounts, self_cg = _v1(tmp_path)
    freezer = tmp_path / "cgroup" / "freezer"
    freezer.mkdir()
    mounts.write_text(mounts.read_text() + f"cgroup {freezer} cgroup rw,freezer 0 0\n")
    self_cg.write_text(self_cg.read_text() + "6:freezer:/\n")
    cg = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
    assert cg.parents["freezer"] == freezer / "boxd-abc" and cg.reason == ""
    vm = cg.create("m_1", Limits(1 << 30))
    assert vm is not None and vm.dirs["freezer"] == freezer / "boxd-abc/m_1"
    # The sandbox joins its freezer cgroup with the others (one cgroup.procs each).
    assert freezer / "boxd-abc/m_1" in vm.paths
    assert vm.set_frozen(True) and (vm.dirs["freezer"] / "freezer.state").read_text() == "FROZEN"
    assert vm.set_frozen(False) and (vm.dirs["freezer"] / "freezer.state").read_text() == "THAWED"
    # Without a freezer hierarchy (the fake v1 tree of the other tests): nothing to do.
    mounts2, self_cg2 = _v1(tmp_path / "nofreezer")
    plain = Cgroups.open("boxd-abc", mounts=mounts2, self_cgroup=self_cg2)
    assert "freezer" not in plain.parents
    vm2 = plain.create("m_2", Limits(1 << 30))
    assert vm2 is not None and not vm2.set_frozen(True)
    # v2: every cgroup has cgroup.freeze.
    mounts3, self_cg3 = _v2(tmp_path / "v2")
    vm3 = Cgroups.open("boxd-abc", mounts=mounts3, self_cgroup=self_cg3).create(
        "m_3", Limits(1 << 30))
    assert vm3 is not None
    assert vm3.set_frozen(True) and (vm3.paths[0] / "cgroup.freeze").read_text() == "1"
    assert vm3.set_frozen(False) and (vm3.paths[0] / "cgroup.freeze").read_text() == "0"


def test_v2_without_a_controller_says_which(tmp_path: Path) -> None:
    mounts, self_cg = _v2(tmp_path, controllers="cpu memory")
    cg = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
    assert cg.available and "pids" in cg.reason and "without pids" in cg.summary()
    mounts, self_cg = _v2(tmp_path / "none", controllers="io")
    cg = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
    assert not cg.available and "offers none" in cg.reason


def test_unavailable_and_off_are_values_that_say_why(tmp_path: Path) -> None:
    off = Cgroups.open("boxd-abc", "off")
    assert not off.available and "BOXD_CGROUPS=off" in off.summary()
    assert off.create("m_1", Limits(MIB)) is None and off.sweep() == []
    empty = tmp_path / "mounts"
    empty.write_text("proc /proc proc rw 0 0\n")
    none = Cgroups.open("boxd-abc", mounts=empty, self_cgroup=empty)
    assert not none.available and "no cgroup filesystem" in none.reason
    mounts, self_cg = _v1(tmp_path / "ro")
    os.chmod(tmp_path / "ro/cgroup/pids", 0o500)
    try:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        partial = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
        assert partial.available and "pids" not in partial.parents
        assert "cannot use" in partial.reason
    finally:
        os.chmod(tmp_path / "ro/cgroup/pids", 0o700)


def test_boxd_cgroups_setting() -> None:
    assert Settings.from_env({}).cgroups == "auto"
    assert Settings.from_env({"BOXD_CGROUPS": "off"}).cgroups == "off"
    assert Settings.from_env({"BOXD_CGROUPS": "0"}).cgroups == "off"
    assert Settings.from_env({"BOXD_CGROUPS": "auto"}).cgroups == "auto"


def test_sweep_removes_only_empty_cgroups_not_kept(tmp_path: Path) -> None:
    mounts, self_cg = _v2(tmp_path)
    cg = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
    for vm in ("m_dead", "m_busy", "m_kept"):
        made = cg.create(vm, Limits(MIB))
        assert made is not None
        # Plain directories cannot be rmdir'ed with files in them: empty the stand-ins.
        for f in made.paths[0].iterdir():
            f.unlink()
    (cg.parents["cpu"] / "m_busy/cgroup.procs").write_text(f"{os.getpid()}\n")
    assert cg.sweep(keep={"m_kept"}) == ["m_dead"]
    assert sorted(p.name for p in cg.parents["cpu"].iterdir() if p.is_dir()) == \
        ["m_busy", "m_kept"]


def test_a_spawned_process_joins_its_cgroup_before_exec(tmp_path: Path) -> None:
    mounts, self_cg = _v2(tmp_path)
    cg = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
    vm = cg.create("m_1", Limits(MIB))
    assert vm is not None
    procs = vm.paths[0] / "cgroup.procs"
    procs.write_text("")
    run = tmp_path / "run"
    # The stand-in file records what the child wrote ("0": the writer itself) before
    # it exec'd; the kernel would have moved it.
    proc = QemuProcess.spawn("m_1", [sys.executable, "-c", "pass"], run / "qmp.sock",
                             tmp_path / "log" / "qemu.log", cgroup=vm, cgroups=cg)
    assert proc.popen is not None and proc.popen.wait(10) == 0
    assert procs.read_text() == "0"
    for f in vm.paths[0].iterdir():
        f.unlink()
    asyncio.run(proc.release_cgroup())
    assert not vm.paths[0].exists() and proc.cgroup is None


def test_an_oom_kill_is_named_in_the_exit_reason(tmp_path: Path) -> None:
    mounts, self_cg = _v1(tmp_path)
    cg = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
    vm = cg.create("m_1", Limits(640 * MIB))
    assert vm is not None
    (vm.dirs["memory"] / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    popen = subprocess.Popen(["sleep", "30"])
    proc = QemuProcess("m_1", popen.pid, tmp_path / "qmp", tmp_path / "a/b/c/qemu.log",
                       popen, cgroup=vm, cgroups=cg)
    popen.kill()
    popen.wait()
    assert "OOM" in proc.exit_reason() and "640 MiB" in proc.exit_reason()
    real_remove = vm.remove

    def kernel_rmdir() -> bool:  # cgroupfs drops a cgroup's files with it
        for d in vm.paths:
            for f in d.iterdir():
                f.unlink()
        return real_remove()

    vm.remove = kernel_rmdir  # type: ignore[method-assign]
    asyncio.run(proc.release_cgroup())
    assert not any(d.exists() for d in vm.paths)
    why = proc.exit_reason()  # the verdict outlives the cgroup
    assert "SIGKILL" in why and "OOM" in why and "640 MiB" in why, why


def test_a_gvisor_sandbox_gets_twice_its_memory_plus_the_sentrys_and_more_tasks() -> None:
    from boxd.engine.cgroups import GVISOR_OVERHEAD_MIB, GVISOR_PIDS_MAX, sandbox_memory_limit

    # The guest's memory, files and a capture written to tmpfs are all charged to it.
    assert sandbox_memory_limit(256) == (512 + GVISOR_OVERHEAD_MIB) * MIB
    assert GVISOR_PIDS_MAX > PIDS_MAX  # systrap: a host stub per guest process


def test_a_gvisor_sandboxs_oom_kill_is_named_and_outlives_its_cgroup(tmp_path: Path) -> None:
    from boxd.engine.base import MachineConfig
    from boxd.engine.gvisor import GvisorEngine, GvisorMachine
    from boxd.engine.gvisor._spec import RunFiles

    mounts, self_cg = _v1(tmp_path)
    cg = Cgroups.open("boxd-abc", mounts=mounts, self_cgroup=self_cg)
    vm = cg.create("m_1", Limits(640 * MIB))
    assert vm is not None
    (vm.dirs["memory"] / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    engine = GvisorEngine("runsc", "0", tmp_path / "state", tmp_path / "agent", "ok",
                          tmp_path / "rootfs.img", cgroups=cg)
    assert "twice memory_mib" in (engine.info().limits or "")
    dead = 2 ** 22 + 1  # above pid_max here: no such process
    config = MachineConfig(id="m_1", hostname="h", vcpus=1, memory_mib=256, isolated=True,
                           port=None, kernel=Path(), initrd=Path(), cmdline="")
    machine = GvisorMachine(engine, config, RunFiles(tmp_path / "run"), dead,
                            tmp_path / "disk", tmp_path / "log" / "qemu.log", cgroup=vm)
    why = machine.exit_reason()
    assert "OOM killer" in why and "640 MiB" in why, why
    real_remove = vm.remove

    def kernel_rmdir() -> bool:  # cgroupfs drops a cgroup's files with it
        for d in vm.paths:
            for f in d.iterdir():
                f.unlink()
        return real_remove()

    vm.remove = kernel_rmdir  # type: ignore[method-assign]
    asyncio.run(machine.release_cgroup())
    assert not any(d.exists() for d in vm.paths) and machine.cgroup is None
    why = machine.exit_reason()
    assert "OOM killer" in why and "640 MiB" in why, why
