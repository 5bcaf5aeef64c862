"""Per-machine cgroups on real machines (issue 14, defect 9).

Every QEMU process runs in a cgroup of its own (memory: guest RAM + QEMU's overhead,
an equal CPU share, a pids limit), placed before QEMU runs; forks, restores, swaps
and wakes place the new process; the cgroup goes when the process does.

Why placement and limits are tested directly rather than by another machine's exec
latency: on this host (2 cores shared with other jobs, load 5-25 while measured) a
guest spinning on all 8 vCPUs did not starve a 1-vCPU machine without cgroups either
(TCG's vCPU threads got about twice the CPU of the other machine's one, not eight
times), and the latency of the other machine's exec varied 0.1-1.3 s with the host's
load either way (the figures are in docs/security.md).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from boxd.engine.cgroups import PIDS_MAX, QEMU_OVERHEAD_MIB
from tests._support.cgroups import _cgroups_of, _gone, _limit, _require_cgroups
from tests._support.procs import qemu_pid, vm_id_of

from ..conftest import Daemon

pytestmark = pytest.mark.vm

MIB = 1 << 20


def _machine_cgroup(daemon: Daemon, machine_id: str) -> tuple[int, dict[str, Path]]:
    vm_id = vm_id_of(daemon.home, machine_id)
    pid = qemu_pid(vm_id)
    dirs = _cgroups_of(pid)
    assert set(dirs) == {"memory", "cpu", "pids"}, dirs
    for c, d in dirs.items():
        assert d.name == vm_id and d.parent.name.startswith("boxd-"), (c, d)
        assert pid in {int(p) for p in (d / "cgroup.procs").read_text().split()}
    return pid, dirs


def test_each_qemu_is_in_its_own_limited_cgroup_and_it_goes_on_delete(  # type: ignore[no-untyped-def]
    client, daemon, machine_factory
) -> None:
    _require_cgroups(client)
    assert "cgroup v1" in (client.info().limits or "")
    child = machine_factory()
    pid, dirs = _machine_cgroup(daemon, child.id)
    # A fork child maps its template privately: room for its copy-on-write pages and
    # the full-RAM capture it writes when it takes over RAM of its own.
    assert _limit(dirs) == (2 * child.memory_mib + QEMU_OVERHEAD_MIB) * MIB
    assert (dirs["cpu"] / "cpu.shares").read_text().strip() == "1024"
    assert (dirs["pids"] / "pids.max").read_text().strip() == str(PIDS_MAX)
    # The parent weighs one machine per machine in it (the group is not one process).
    parent_shares = int((dirs["cpu"].parent / "cpu.shares").read_text())
    machines = sum(1 for p in dirs["cpu"].parent.iterdir() if p.is_dir())
    assert parent_shares == 1024 * machines

    # Its first fork gives it RAM of its own: a new process, placed again, with the
    # limit of a machine that owns its RAM file.
    grandchild = client.machines.fork(child.id)
    client.machines.delete(grandchild.id)
    pid2, dirs2 = _machine_cgroup(daemon, child.id)
    assert pid2 != pid and dirs2 == dirs
    assert _limit(dirs2) == (child.memory_mib + QEMU_OVERHEAD_MIB) * MIB

    # A restore replaces the process again.
    client.machines.checkpoints.save(child.id, "own-ram")
    client.machines.checkpoints.restore(child.id, "own-ram")
    pid3, dirs3 = _machine_cgroup(daemon, child.id)
    assert pid3 != pid2 and dirs3 == dirs

    client.machines.delete(child.id)
    assert _gone(dirs), [d for d in dirs.values() if d.exists()]


def test_hibernate_removes_the_cgroup_and_wake_places_the_new_process(  # type: ignore[no-untyped-def]
    client, daemon, machine
) -> None:
    _require_cgroups(client)
    _, dirs = _machine_cgroup(daemon, machine.id)
    client.machines.hibernate(machine.id)
    assert _gone(dirs)
    assert client.machines.exec(machine.id, "echo awake").stdout == "awake\n"
    _machine_cgroup(daemon, machine.id)


def test_a_killed_qemu_leaves_no_cgroup(client, daemon, machine) -> None:  # type: ignore[no-untyped-def]
    _require_cgroups(client)
    pid, dirs = _machine_cgroup(daemon, machine.id)
    os.kill(pid, signal.SIGKILL)
    assert _gone(dirs)
    deadline = time.monotonic() + 30
    while client.machines.get(machine.id).state.value != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_guest_touching_all_its_ram_is_not_killed(client, daemon, base) -> None:  # type: ignore[no-untyped-def]
    _require_cgroups(client)
    m = client.machines.new("ram-filler", memory_mib=256)
    try:
        client.machines.wait_until_ready(m.id, timeout=300)
        _, dirs = _machine_cgroup(daemon, m.id)
        # Fill a guest tmpfs to ~90% of the guest's memory: every page of guest RAM that
        # the kernel can give is touched (tmpfs pages on the host, charged to the VM).
        r = client.machines.exec(
            m.id,
            "mkdir -p /mnt/t && mount -t tmpfs -o size=100% tmpfs /mnt/t && "
            "n=$(awk '/MemTotal/{print int($2/1024*0.9)}' /proc/meminfo) && "
            "dd if=/dev/urandom of=/mnt/t/fill bs=1M count=$n 2>/dev/null; "
            "du -m /mnt/t/fill | cut -f1",
            timeout=600,
        )
        assert r.exit_code == 0, r.stderr
        assert int(r.stdout.split()[-1]) >= 150, r.stdout  # of ~190 MiB the guest sees
        stat = dict(line.split() for line in (dirs["memory"] / "memory.stat").read_text()
                    .splitlines())
        assert int(stat["shmem"]) >= 150 * MIB  # guest RAM is charged to the machine
        oom = (dirs["memory"] / "memory.oom_control").read_text()
        assert "oom_kill 0" in oom, oom
        assert client.machines.exec(m.id, "echo alive").stdout == "alive\n"
    finally:
        client.machines.delete(m.id)


def test_restart_sweeps_cgroups_of_vms_that_died_meanwhile(  # type: ignore[no-untyped-def]
    client, daemon, machine
) -> None:
    _require_cgroups(client)
    pid, dirs = _machine_cgroup(daemon, machine.id)
    daemon.stop(signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)  # its VM dies while no daemon watches
    time.sleep(0.5)
    assert all(d.exists() for d in dirs.values())  # nobody removed it
    daemon.restart()
    client.info()  # the engine opens (and sweeps) on first use
    assert _gone(dirs)
    assert client.machines.get(machine.id).state.value == "failed"
