"""The accelerator choice: the probe's decision logic (no VM) and the real daemon's answer.

On these hosts ``/dev/kvm`` is PVM-only and cannot boot a stock guest kernel, so the
probe (which boots the guest kernel under KVM with a deadline) must choose TCG and
say why; ``BOXD_ACCEL`` forces a choice without probing.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from boxd.config import Settings
from boxd.engine.qemu import _probe
from boxd.engine.qemu._probe import AccelChoice, probe_accelerator

# ------------------------------------------------------------------ decision logic


@pytest.fixture
def kernel(tmp_path: Path) -> Path:
    k = tmp_path / "vmlinux"
    k.write_bytes(b"\0" * 64)
    return k


@pytest.fixture
def kvm_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend /dev/kvm exists and is openable (whatever this host has)."""
    real_exists, real_access = os.path.exists, os.access
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/kvm" or real_exists(p))
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: p == "/dev/kvm" or real_access(p, mode, **kw)
    )
    monkeypatch.delenv("BOXD_ACCEL", raising=False)


def _fake_boot(monkeypatch: pytest.MonkeyPatch, result: tuple[bool, str, float]) -> list[int]:
    calls: list[int] = []

    def boot(qemu: str, kernel: Path) -> tuple[bool, str, float]:
        calls.append(1)
        return result

    monkeypatch.setattr(_probe, "_boot_under_kvm", boot)
    return calls


@pytest.mark.parametrize("value", ["tcg", "kvm", " TCG "])
def test_forced_accelerator_skips_the_probe(
    monkeypatch: pytest.MonkeyPatch, kernel: Path, tmp_path: Path, value: str
) -> None:
    calls = _fake_boot(monkeypatch, (True, "booted", 1.0))
    monkeypatch.setenv("BOXD_ACCEL", value)
    forced = Settings.from_env().accel  # the daemon reads it once, in config
    choice = probe_accelerator("qemu-system-x86_64", kernel, tmp_path / "host.json", forced)
    want = value.strip().lower()
    assert choice == AccelChoice(want, f"forced by BOXD_ACCEL={want}", forced=True)
    assert calls == []
    assert not (tmp_path / "host.json").exists()  # a forced choice is not cached


def test_unknown_forced_value_is_ignored(
    monkeypatch: pytest.MonkeyPatch, kernel: Path, tmp_path: Path, kvm_usable: None
) -> None:
    _fake_boot(monkeypatch, (False, "KVM internal error", 2.0))
    monkeypatch.setenv("BOXD_ACCEL", "hvf")
    forced = Settings.from_env().accel
    choice = probe_accelerator("qemu-system-x86_64", kernel, tmp_path / "host.json", forced)
    assert choice.accelerator == "tcg" and not choice.forced


def test_no_dev_kvm_means_tcg(
    monkeypatch: pytest.MonkeyPatch, kernel: Path, tmp_path: Path
) -> None:
    calls = _fake_boot(monkeypatch, (True, "booted", 1.0))
    monkeypatch.delenv("BOXD_ACCEL", raising=False)
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p != "/dev/kvm" and real_exists(p))
    choice = probe_accelerator("qemu-system-x86_64", kernel, tmp_path / "host.json")
    assert choice.accelerator == "tcg"
    assert "/dev/kvm does not exist" in choice.reason
    assert calls == []


def test_probe_success_chooses_kvm_and_is_cached(
    monkeypatch: pytest.MonkeyPatch, kernel: Path, tmp_path: Path, kvm_usable: None
) -> None:
    calls = _fake_boot(monkeypatch, (True, "KVM booted the guest kernel in 1.2s", 1.234))
    cache = tmp_path / "host.json"
    first = probe_accelerator("qemu-system-x86_64", kernel, cache)
    assert first.accelerator == "kvm" and not first.forced
    assert first.probe_seconds == 1.23
    assert json.loads(cache.read_text())["choice"]["accelerator"] == "kvm"
    second = probe_accelerator("qemu-system-x86_64", kernel, cache)
    assert second == first
    assert len(calls) == 1  # the second answer came from the cache


def test_probe_failure_chooses_tcg_with_reason(
    monkeypatch: pytest.MonkeyPatch, kernel: Path, tmp_path: Path, kvm_usable: None
) -> None:
    why = "KVM cannot run the guest kernel (KVM internal error: emulation failure)"
    _fake_boot(monkeypatch, (False, why, 3.0))
    choice = probe_accelerator("qemu-system-x86_64", kernel, tmp_path / "host.json")
    assert choice.accelerator == "tcg"
    assert choice.reason.startswith(why)
    assert "TCG" in choice.reason


def test_cache_is_invalidated_when_the_kernel_changes(
    monkeypatch: pytest.MonkeyPatch, kernel: Path, tmp_path: Path, kvm_usable: None
) -> None:
    calls = _fake_boot(monkeypatch, (False, "no", 1.0))
    cache = tmp_path / "host.json"
    probe_accelerator("qemu-system-x86_64", kernel, cache)
    kernel.write_bytes(b"\0" * 128)  # a different guest kernel
    probe_accelerator("qemu-system-x86_64", kernel, cache)
    assert len(calls) == 2


def test_corrupt_cache_is_reprobed(
    monkeypatch: pytest.MonkeyPatch, kernel: Path, tmp_path: Path, kvm_usable: None
) -> None:
    calls = _fake_boot(monkeypatch, (False, "no", 1.0))
    cache = tmp_path / "host.json"
    cache.write_text("{not json")
    assert probe_accelerator("qemu-system-x86_64", kernel, cache).accelerator == "tcg"
    assert len(calls) == 1


class _FakeRun:
    """Stands in for subprocess.run in the probe: writes console output, returns rc."""

    def __init__(self, text: str, rc: int | None) -> None:
        self.text, self.rc = text, rc

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
        assert "-accel" in argv and argv[argv.index("-accel") + 1] == "kvm"
        kw["stdout"].write(self.text.encode())
        if self.rc is None:
            raise subprocess.TimeoutExpired(argv, kw["timeout"])
        return subprocess.CompletedProcess(argv, self.rc)


@pytest.mark.parametrize(
    ("text", "rc", "ok", "needle"),
    [
        ("[0.5] VFS: Unable to mount root fs on unknown-block(0,0)\n"
         "Kernel panic - not syncing: VFS\n", 0, True, "KVM booted"),
        ("KVM internal error. Suberror: 1\nemulation failure\n", 1, False, "KVM internal error"),
        ("Booting the kernel.\n", None, False, "did not finish early boot"),
        ("qemu: could not access KVM kernel module\n", 1, False, "exited with status 1"),
    ],
    ids=["boots", "internal-error", "deadline", "qemu-error"],
)
def test_boot_under_kvm_reads_the_console(
    monkeypatch: pytest.MonkeyPatch, kernel: Path, text: str, rc: int | None, ok: bool,
    needle: str,
) -> None:
    monkeypatch.setattr(_probe.subprocess, "run", _FakeRun(text, rc))
    got_ok, why, _ = _probe._boot_under_kvm("qemu-system-x86_64", kernel)
    assert got_ok is ok
    assert needle in why


def test_the_probe_qemu_dies_at_its_deadline_even_without_its_daemon(tmp_path: Path) -> None:
    # A daemon killed while it probes KVM used to leave the probe's QEMU running for ever
    # (a guest that never finishes booting under a broken KVM).
    import signal
    import sys
    import time

    fake = tmp_path / "fake-qemu"
    fake.write_text("#!/bin/sh\nsleep 60\n")
    fake.chmod(0o755)
    code = ("import os\nfrom pathlib import Path\nfrom boxd.engine.qemu import _probe\n"
            "_probe.PROBE_DEADLINE = 1.0\n"
            "_probe._boot_under_kvm(os.environ['FAKE_QEMU'], Path('/nonexistent'))\n")
    # the path in the environment, not on the command line: pgrep finds only the fake
    daemon = subprocess.Popen([sys.executable, "-c", code],
                              env={**os.environ, "FAKE_QEMU": str(fake)})
    deadline = time.monotonic() + 20
    while not _running(fake) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(fake)
    daemon.send_signal(signal.SIGKILL)  # the "daemon" dies mid-probe
    daemon.wait()
    while _running(fake) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(fake)


def _running(marker: Path) -> bool:
    out = subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True)
    return bool(out.stdout.strip())


# ------------------------------------------------------------------- real daemons


@pytest.mark.vm
def test_this_host_runs_tcg_and_says_why(client) -> None:  # type: ignore[no-untyped-def]
    info = client.info()
    if os.environ.get("BOXD_ACCEL"):
        pytest.skip("BOXD_ACCEL is set for this run")
    assert info.accelerator == "tcg"
    assert "KVM" in info.accelerator_reason or "/dev/kvm" in info.accelerator_reason
    assert "TCG" in info.accelerator_reason
    assert info.cpu_model.startswith("Haswell")  # a named model, never -cpu host


@pytest.mark.vm
def test_forcing_the_accelerator(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, daemon
) -> None:  # type: ignore[no-untyped-def]
    from boxd import Boxd
    from tests._support.daemon import kill_machines_of, start_daemon

    home = tmp_path_factory.mktemp("boxd-forced")
    monkeypatch.setenv("BOXD_ACCEL", "tcg")
    second = start_daemon(home)
    try:
        monkeypatch.setenv("BOXD_HOME", str(home))
        with Boxd() as b:
            info = b.info()
        assert info.accelerator == "tcg"
        assert "forced" in info.accelerator_reason
        assert "BOXD_ACCEL=tcg" in info.accelerator_reason
        assert info.data_dir == str(home.resolve()) or info.data_dir == str(home)
    finally:
        second.stop()
        kill_machines_of(home)
