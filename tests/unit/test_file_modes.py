"""Files the daemon, qemu-img and QEMU create are private (docs/security.md)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from boxd.config import Paths
from boxd.engine.qemu._process import QemuProcess
from boxd.storage import disks
from boxd.storage.memory import sparse_copy


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o7777


def test_ensure_makes_the_data_directory_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BOXD_SHM", str(tmp_path / "shm"))
    paths = Paths(tmp_path / "home")
    paths.machines.mkdir(parents=True, mode=0o755)
    os.chmod(paths.machines, 0o755)
    paths.disks.mkdir(mode=0o700)
    os.chmod(paths.disks, 0o2770)  # what Host.run_as makes it for QEMU's group
    paths.log.write_text("old\n")
    os.chmod(paths.log, 0o644)
    paths.ensure()
    assert _mode(paths.machines) == 0o750
    assert _mode(paths.disks) == 0o2770
    for d in (paths.snapshots, paths.uploads, paths.execs, paths.shm / "machines",
              paths.templates, paths.checkpoints):
        assert _mode(d) == 0o700, d
    for f in (paths.db, paths.log):
        assert _mode(f) == 0o600, f
    assert paths.log.read_text() == "old\n"
    # It was 0755: as root, QEMU's user may still pass through it (Host.run_as).
    assert _mode(paths.home) == (0o711 if os.geteuid() == 0 else 0o700)

def test_processes_and_copies_create_private_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    logs = tmp_path / "logs"
    # QemuProcess.spawn on a stand-in program: what matters is the mask it runs under.
    proc = QemuProcess.spawn(
        "m_test", ["/bin/sh", "-c", f"echo x > {run}/mem"], run / "qmp.sock", logs / "qemu.log"
    )
    assert proc.popen is not None and proc.popen.wait(10) == 0
    assert _mode(run) == 0o700 and _mode(logs) == 0o700
    assert _mode(run / "mem") == 0o600 and _mode(logs / "qemu.log") == 0o600
    assert sparse_copy(run / "mem", tmp_path / "copy") == 2
    assert _mode(tmp_path / "copy") == 0o600
    base = tmp_path / "base.raw"
    base.write_bytes(bytes(1 << 20))
    asyncio.run(disks.create_overlay(tmp_path / "layer.qcow2", base, "raw", 1))
    assert _mode(tmp_path / "layer.qcow2") == 0o600


def test_disk_layers_are_made_on_the_daemons_own_event_loop(tmp_path: Path) -> None:
    # The daemon runs on uvloop (api.server.event_loop_runner), whose subprocesses take
    # no umask: qemu-img must still make private layers there.
    from boxd.api.server import event_loop_runner

    base = tmp_path / "base.raw"
    base.write_bytes(bytes(1 << 20))
    with event_loop_runner({}) as runner:
        runner.run(disks.create_overlay(tmp_path / "layer.qcow2", base, "raw", 1))
        assert type(runner.get_loop()).__module__.startswith("uvloop")
    assert _mode(tmp_path / "layer.qcow2") == 0o600


def test_ensure_space_names_needed_and_free(tmp_path: Path) -> None:
    from boxd.errors import ResourceExhausted
    from boxd.storage.memory import ensure_space

    ensure_space(tmp_path, 1)
    with pytest.raises(ResourceExhausted) as info:
        ensure_space(tmp_path, 1 << 62)
    assert info.value.needed == 1 << 62  # type: ignore[attr-defined]
    assert 0 <= info.value.free < 1 << 62  # type: ignore[attr-defined]
    assert "BOXD_SHM" in info.value.hint


def test_sigbus_death_is_reported_as_such(tmp_path: Path) -> None:
    proc = QemuProcess.spawn(
        "m_bus", ["/bin/sh", "-c", "kill -BUS $$"], tmp_path / "run" / "qmp.sock",
        tmp_path / "log" / "qemu.log",
    )
    assert proc.popen is not None
    proc.popen.wait(10)
    assert "SIGBUS" in proc.exit_reason() and "BOXD_SHM" in proc.exit_reason()
