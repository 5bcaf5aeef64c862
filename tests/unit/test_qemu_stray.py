"""`QemuEngine.kill_stray` on real processes (no QEMU needed: a stand-in process whose
command line names the VM as QEMU's does, ``-name boxd-<id>,...``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from boxd.engine.qemu import AccelChoice
from boxd.engine.qemu._engine import QemuEngine


def _stand_in(vm_id: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "-name", f"boxd-{vm_id},debug-threads=on"])


def test_a_vm_without_a_pid_file_is_found_by_its_command_line(tmp_path: Path) -> None:
    """A QEMU started just before the daemon died may not have written its pid file
    when the next daemon sweeps; it is found and killed all the same, and only it."""
    engine = QemuEngine("qemu-system-x86_64", AccelChoice("tcg", "test"))
    target, other = _stand_in("m_strayvm"), _stand_in("m_othervm")
    try:
        time.sleep(0.2)  # both have exec'd
        assert engine.kill_stray("m_strayvm", tmp_path)  # no qemu.pid there
        assert target.wait(5) != 0
        assert other.poll() is None
        assert not engine.kill_stray("m_nosuchvm", tmp_path)
    finally:
        for p in (target, other):
            p.kill()
            p.wait()


def test_a_recorded_pid_that_is_gone_does_not_spare_the_vms_new_process(tmp_path: Path) -> None:
    """A RAM swap (or a restore, or a wake) ends a machine's QEMU and starts another for
    the same VM; a daemon killed before it recorded the new pid leaves a record naming
    the old one. The recovery's kill with that pid must still find and kill the new
    process (it was left running, owned by no one: test_faults' fork-batch kill)."""
    engine = QemuEngine("qemu-system-x86_64", AccelChoice("tcg", "test"))
    old = _stand_in("m_swapped")
    old.kill()
    old.wait()
    new = _stand_in("m_swapped")
    try:
        time.sleep(0.2)
        assert engine.kill_stray("m_swapped", tmp_path, old.pid)
        assert new.wait(5) != 0
    finally:
        new.kill()
        new.wait()
