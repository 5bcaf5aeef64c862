"""The QEMU command line, built without running QEMU."""

from __future__ import annotations

from pathlib import Path

from boxd.engine.base import MachineConfig
from boxd.engine.qemu import _argv


def _config(isolated: bool = False) -> MachineConfig:
    return MachineConfig(
        id="m_test", hostname="h", vcpus=2, memory_mib=512, isolated=isolated, port=4000,
        kernel=Path("/k"), initrd=Path("/i"), cmdline="lpj=1",
    )


def _build(**kw):  # type: ignore[no-untyped-def]
    args = {
        "qemu": "qemu", "config": _config(), "accel": "tcg",
        "files": _argv.RunFiles(Path("/run/m")), "disk": Path("/d.qcow2"),
        "memory": _argv.Memory(Path("/run/m/mem"), shared=True),
        "console_log": Path("/c.log"), "incoming": False,
    }
    args.update(kw)
    return _argv.build(**args)


def _opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_sandbox_denies_privilege_changes_without_run_as() -> None:
    argv = _build()
    assert _opt(argv, "-sandbox") == [_argv.SANDBOX]
    assert "elevateprivileges=deny" in _argv.SANDBOX
    assert "-run-with" not in argv


def test_run_as_drops_privileges_and_lets_qemu_do_it() -> None:
    argv = _build(run_as="boxd-qemu")
    assert _opt(argv, "-run-with") == ["user=boxd-qemu"]
    assert _opt(argv, "-sandbox") == [_argv.SANDBOX_RUN_AS]
    assert "spawn=deny" in _argv.SANDBOX_RUN_AS


def test_template_memory_is_mapped_private_and_read_only() -> None:
    argv = _build(memory=_argv.Memory(Path("/t/mem"), shared=False, readonly=True),
                  incoming=True)
    (obj,) = _opt(argv, "-object")
    assert "share=off" in obj and "readonly=on" in obj and "rom=off" in obj
    assert _opt(argv, "-incoming") == ["defer"]
    old = _build(memory=_argv.Memory(Path("/t/mem"), shared=False, readonly=True),
                 readonly_rom_supported=False)
    assert "readonly=on" not in _opt(old, "-object")[0]


def test_isolated_machines_have_no_network_device() -> None:
    assert "-netdev" in _build()
    argv = _build(config=_config(isolated=True))
    assert "-netdev" not in argv
    assert not any("virtio-net" in a for a in argv)


def test_named_cpu_model_and_tcg_cache() -> None:
    argv = _build()
    assert _opt(argv, "-cpu") == [_argv.CPU_MODELS["tcg"]]
    assert _opt(argv, "-accel") == [f"tcg,tb-size={_argv.TCG_TB_SIZE_MB}"]
    assert "host" not in _opt(_build(accel="kvm"), "-cpu")[0]
    assert "mitigations=off" in _opt(argv, "-append")[0]
    assert "mitigations=off" not in _opt(_build(accel="kvm"), "-append")[0]
