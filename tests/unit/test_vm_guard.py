"""The fast tier's guard (tests/_support/vm_guard.py): a test not marked vm that starts
a real QEMU or runsc is refused and fails; stand-ins and ``--version`` are allowed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests._support import vm_guard


def test_a_real_engine_launch_outside_a_vm_test_is_refused_and_recorded() -> None:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        pytest.skip("no qemu-system-x86_64 on this host")
    assert not vm_guard.STATE.allowed  # this test is not marked vm
    with pytest.raises(RuntimeError, match="not marked vm"):
        # would start a (machine-less) QEMU: the guard refuses before it runs
        subprocess.Popen([qemu, "-machine", "none", "-nographic", "-S"])
    assert vm_guard.STATE.refused, "the refusal is recorded: the test fails even if caught"
    vm_guard.STATE.refused.clear()  # this test wanted it: do not fail it
    assert subprocess.run([qemu, "--version"], capture_output=True, check=True).stdout


def test_a_daemon_start_outside_a_vm_test_is_refused(tmp_path: Path) -> None:
    from tests._support.daemon import start_daemon

    with pytest.raises(RuntimeError, match="not marked vm"):
        start_daemon(tmp_path / "home")
    vm_guard.STATE.refused.clear()


def test_a_stand_in_named_like_runsc_is_allowed(tmp_path: Path) -> None:
    fake = tmp_path / "runsc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    assert subprocess.run([str(fake), "run", "m_1"], check=True).returncode == 0
    out = subprocess.run([sys.executable, "-c", "print(1)"], executable=sys.executable,
                         capture_output=True, check=True)
    assert out.stdout.strip() == b"1"
    assert vm_guard.STATE.refused == []
