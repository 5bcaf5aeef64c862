"""`auto` is the daemon's default engine, and how it decides (the probes replaced by
statuses: the decision is logic; the real probes run in tests/integration/test_gvisor.py's
auto tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from boxd.config import Paths, Settings
from boxd.engine import registry
from boxd.engine.registry import EngineStatus, resolve_auto
from boxd.errors import HostSetupError
from boxd.images import GuestImage


def test_the_default_engine_is_auto() -> None:
    assert Settings().engine == "auto"
    assert Settings.from_env({}).engine == "auto"
    assert Settings.from_env({"BOXD_ENGINE": " "}).engine == "auto"
    assert Settings.from_env({"BOXD_ENGINE": "QEMU"}).engine == "qemu"


def _decide(monkeypatch: pytest.MonkeyPatch, qemu: EngineStatus, gvisor: EngineStatus,
            tmp_path: Path) -> tuple[str, str]:
    monkeypatch.setattr(registry, "_qemu_status", lambda *a: qemu)
    monkeypatch.setattr(registry, "_gvisor_status", lambda *a: gvisor)
    image = GuestImage.__new__(GuestImage)  # the statuses above never look at it
    return resolve_auto(Settings(), Paths(tmp_path), image)


KVM = EngineStatus("qemu", "ok", "KVM boots the guest", "kvm")
TCG = EngineStatus("qemu", "ok", "/dev/kvm is absent", "tcg")
NO_QEMU = EngineStatus("qemu", "unavailable", "qemu-system-x86_64 is not installed")
GVISOR = EngineStatus("gvisor", "ok", "runsc 20240729 starts a sandbox", "systrap")
NO_RUNSC = EngineStatus("gvisor", "unavailable", "runsc is not installed")


def test_kvm_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine, why = _decide(monkeypatch, KVM, GVISOR, tmp_path)
    assert engine == "qemu" and "KVM" in why


def test_without_kvm_gvisor_wins_and_says_tcg_was_the_alternative(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine, why = _decide(monkeypatch, TCG, GVISOR, tmp_path)
    assert engine == "gvisor"
    assert "TCG" in why and "/dev/kvm is absent" in why and "runsc 20240729" in why


def test_without_runsc_qemu_under_tcg_and_why(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    engine, why = _decide(monkeypatch, TCG, NO_RUNSC, tmp_path)
    assert engine == "qemu"
    assert "TCG" in why and "runsc is not installed" in why


def test_without_qemu_gvisor_and_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine, why = _decide(monkeypatch, NO_QEMU, GVISOR, tmp_path)
    assert engine == "gvisor" and "not installed" in why


def test_neither_engine_is_a_host_setup_error_naming_both(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(HostSetupError, match="no engine can run here") as info:
        _decide(monkeypatch, NO_QEMU, NO_RUNSC, tmp_path)
    assert "qemu-system-x86_64" in str(info.value) and "runsc" in str(info.value)
