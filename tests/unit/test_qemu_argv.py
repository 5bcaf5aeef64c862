"""The QEMU command line, built without running QEMU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from boxd.engine.base import MachineConfig
from boxd.engine.qemu import _argv, _net


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
        "console_log": Path("/c.log"), "incoming": False, "net_fd": 7,
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
    argv = _build(config=_config(isolated=True), net_fd=None)
    assert "-netdev" not in argv
    assert not any("virtio-net" in a for a in argv)


def test_the_nic_is_passt_on_an_inherited_socket_never_user_networking() -> None:
    (netdev,) = _opt(_build(), "-netdev")
    assert netdev == "stream,id=net0,server=off,addr.type=fd,addr.str=7"
    assert "user" not in netdev and "hostfwd" not in netdev
    with pytest.raises(ValueError):
        _build(net_fd=None)


def test_passt_never_maps_the_gateway_to_the_host_and_forwards_only_the_url() -> None:
    user = _net.NetUser("boxd-net", 995)
    argv = _net.passt_argv("passt", fd=5, port=4000, user=user, log_file=Path("/l"))
    assert "--no-map-gw" in argv and "--one-off" in argv
    assert argv[argv.index("--fd") + 1] == "5"
    assert argv[argv.index("--tcp-ports") + 1] == "127.0.0.1/4000:8080"
    assert argv[argv.index("--udp-ports") + 1] == "none"
    assert argv[argv.index("--runas") + 1] == "boxd-net"
    bare = _net.passt_argv("passt", fd=5, port=None, user=None, log_file=Path("/l"))
    assert bare[bare.index("--tcp-ports") + 1] == "none" and "--runas" not in bare


def test_the_filter_rejects_new_connections_of_passts_user_only() -> None:
    rules = _net.ruleset(995, ["10.255.255.53"])
    lines = [ln.strip() for ln in rules.splitlines()]
    # The table is replaced atomically (create-if-missing, delete, create).
    assert lines[:2] == [f"table inet {_net.TABLE} {{}}", f"delete table inet {_net.TABLE}"]
    order = [next(i for i, ln in enumerate(lines) if ln.startswith(p)) for p in (
        "meta skuid != 995 accept", "ct state established,related accept",
        "ip daddr { 10.255.255.53 } meta l4proto { tcp, udp } th dport 53 accept",
        "fib daddr type local reject", "ip daddr { 0.0.0.0/8", "ip6 daddr {")]
    assert order == sorted(order)
    for net in ("10.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
                "192.168.0.0/16", "100.64.0.0/10"):
        assert net in rules
    for net in ("::ffff:0:0/96", "fc00::/7", "fe80::/10"):
        assert net in rules
    assert "th dport 53" not in _net.ruleset(995, [])


def test_resolvers_reads_ipv4_name_servers(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# x\nnameserver 10.255.255.53\nnameserver ::1\nnameserver 1.1.1.1\n"
                    "nameserver 10.255.255.53\nsearch example\n")
    assert _net.resolvers(conf) == ["10.255.255.53", "1.1.1.1"]
    assert _net.resolvers(tmp_path / "missing") == []


def test_named_cpu_model_and_tcg_cache() -> None:
    argv = _build()
    assert _opt(argv, "-cpu") == [_argv.CPU_MODELS["tcg"]]
    assert _opt(argv, "-accel") == [f"tcg,tb-size={_argv.TCG_TB_SIZE_MB}"]
    assert "host" not in _opt(_build(accel="kvm"), "-cpu")[0]
    assert "mitigations=off" in _opt(argv, "-append")[0]
    assert "mitigations=off" not in _opt(_build(accel="kvm"), "-append")[0]


def test_a_container_images_machine_gets_the_guest_root_as_a_read_only_disk() -> None:
    from dataclasses import replace

    plain = _build(runtime=Path("/img/rootfs.img"))
    assert "boxd.runtime" not in " ".join(plain) and "rt0" not in " ".join(plain)
    argv = _build(config=replace(_config(), image_root=True), runtime=Path("/img/rootfs.img"))
    drives = _opt(argv, "-drive")
    assert drives[0].startswith("file=/d.qcow2,") and "id=disk0" in drives[0]
    assert drives[1] == "file=/img/rootfs.img,if=none,id=rt0,format=raw,readonly=on"
    assert f"virtio-blk-device,drive=rt0,serial={_argv.RUNTIME_SERIAL}" in _opt(argv, "-device")
    (append,) = _opt(argv, "-append")
    assert f"boxd.runtime={_argv.RUNTIME_SERIAL}" in append.split()
    with pytest.raises(ValueError, match="runtime"):
        _build(config=replace(_config(), image_root=True))


def test_an_image_machine_continues_on_the_guest_root_its_capture_names(tmp_path: Path) -> None:
    """A QEMU image machine's RAM caches blocks of the guest root its agent runs from
    (a second disk): a capture (template, checkpoint, hibernation) notes that root and
    continues on it, not on the daemon's guest root of now; a capture without a note
    (a snapshot's blobs, another node's template) takes the daemon's; one whose root is
    gone says so."""
    from boxd.engine.base import MemoryImage
    from boxd.engine.qemu import QemuEngine
    from boxd.engine.qemu._probe import AccelChoice
    from boxd.errors import MachineFailed

    now, old = tmp_path / "now" / "rootfs.img", tmp_path / "old" / "rootfs.img"
    for p in (now, old):
        p.parent.mkdir()
        p.write_bytes(b"ext4")
    engine = QemuEngine("qemu-system-x86_64", AccelChoice("tcg", "test"), runtime=now,
                        image_disks=tmp_path / "disks")
    cfg = MachineConfig("m1", "m1", 1, 256, True, None, tmp_path / "k", tmp_path / "i", "",
                        image_root=True)
    cap = tmp_path / "cap"
    cap.mkdir()
    image = MemoryImage(cap / "mem", cap / "state", 256)
    assert engine._runtime_of(cfg, image) is None  # no note: the daemon's
    (cap / "runtime").write_text(f"{old}\n")
    assert engine._runtime_of(cfg, image) == old
    assert engine._runtime_of(dataclasses.replace(cfg, image_root=False), image) is None
    old.unlink()
    with pytest.raises(MachineFailed, match=r"guest root .*old/rootfs\.img, which is gone"):
        engine._runtime_of(cfg, image)
