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
