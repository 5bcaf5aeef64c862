"""QEMU command lines for boxd machines (pure functions, unit-tested without QEMU)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from boxd.engine.base import MachineConfig

QBOOT = Path("/usr/share/qemu/qboot.rom")
# A named CPU model, not -cpu host, so saved state moves between hosts of one kind.
# Under TCG the features TCG cannot emulate are switched off explicitly (no warnings).
CPU_MODELS = {
    "kvm": "Haswell-noTSX",
    "tcg": "Haswell-noTSX,-pcid,-tsc-deadline,-invpcid",
}
# Below 64 MB the translation cache makes guest Python imports 2-4x slower (notes).
TCG_TB_SIZE_MB = 64
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
# With -run-with user=, QEMU itself calls setuid after start-up, which the seccomp
# filter would kill; once it runs as an unprivileged user it cannot elevate anyway.
SANDBOX_RUN_AS = "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"


#: The file (in a run directory and in a capture beside the state) naming the guest
#: root a container image's machine runs its agent from: a capture continues on it.
RUNTIME = "runtime"


@dataclass(frozen=True)
class RunFiles:
    """The files of one QEMU process, all under the machine's run directory."""

    run_dir: Path

    @property
    def mem(self) -> Path:
        return self.run_dir / "mem"

    @property
    def qmp(self) -> Path:
        return self.run_dir / "qmp.sock"

    @property
    def agent(self) -> Path:
        return self.run_dir / "agent.sock"

    @property
    def pidfile(self) -> Path:
        return self.run_dir / "qemu.pid"

    @property
    def runtime(self) -> Path:
        """Names the guest root a container image's machine was started with (`RUNTIME`)."""
        return self.run_dir / RUNTIME


@dataclass(frozen=True)
class Memory:
    """How guest RAM is backed: the machine's own file, or a template mapped privately."""

    path: Path
    shared: bool
    readonly: bool = False


#: The serial number of the read-only disk that holds boxd's own guest root in a
#: machine of a container image (its /init finds the disk by it, whatever its order).
RUNTIME_SERIAL = "boxd-rt"


def kernel_cmdline(config: MachineConfig) -> str:
    parts = [
        "console=ttyS0",
        "root=/dev/vda",
        "rw",
        "quiet",
        "panic=-1",
        f"boxd.hostname={config.hostname}",
    ]
    if config.image_root:
        # The guest's /init: the root disk holds a container image's files, and the
        # agent runs on the Python of the disk with this serial (`runtime_args`).
        parts.append(f"boxd.runtime={RUNTIME_SERIAL}")
    if config.cmdline:
        parts.append(config.cmdline)
    return " ".join(parts)


def build(
    *,
    qemu: str,
    config: MachineConfig,
    accel: str,
    files: RunFiles,
    disk: Path,
    memory: Memory,
    console_log: Path,
    incoming: bool,
    sandbox: bool = True,
    readonly_rom_supported: bool = True,
    run_as: str | None = None,
    net_fd: int | None = None,
    runtime: Path | None = None,
) -> list[str]:
    """The full argv of one machine's QEMU process.

    A non-isolated machine's NIC is attached to passt through ``net_fd`` (QEMU's end of
    a socketpair, see ``_net``); an isolated machine has no NIC. A machine of a
    container image (``config.image_root``) gets ``runtime``, boxd's guest root, as a
    second, read-only disk.
    """
    if config.image_root and runtime is None:
        raise ValueError("a machine of a container image needs the guest root (runtime)")
    argv = [
        qemu,
        "-name", f"boxd-{config.id},debug-threads=off",
        "-machine", "microvm,memory-backend=ram,x-option-roms=off,pit=on,pic=off,rtc=on",
        "-accel", f"tcg,tb-size={TCG_TB_SIZE_MB}" if accel == "tcg" else "kvm",
        "-cpu", CPU_MODELS[accel],
        "-smp", str(config.vcpus),
        "-m", f"{config.memory_mib}M",
        "-object", _memory_backend(config, memory, readonly_rom_supported),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        *_boot_args(config, accel, console_log),
        *_device_args(disk, files),
        *(runtime_args(runtime) if config.image_root and runtime is not None else []),
    ]
    if QBOOT.exists():
        argv += ["-bios", str(QBOOT)]
    if not config.isolated:
        argv += _nic_args(net_fd)
    if incoming:
        argv += ["-incoming", "defer"]
    if run_as:
        # Open every file and socket as the daemon's user, then drop to run_as.
        argv += ["-run-with", f"user={run_as}"]
    if sandbox:
        argv += ["-sandbox", SANDBOX_RUN_AS if run_as else SANDBOX]
    return argv


def _memory_backend(config: MachineConfig, memory: Memory, readonly_rom_supported: bool) -> str:
    """The ``-object`` of guest RAM: a file backend over ``memory``."""
    mem_opts = [
        "memory-backend-file",
        "id=ram",
        f"size={config.memory_mib}M",
        f"mem-path={memory.path}",
        f"share={'on' if memory.shared else 'off'}",
    ]
    if memory.readonly and readonly_rom_supported:
        # Open the template read-only and give the guest a private writable copy.
        mem_opts += ["readonly=on", "rom=off"]
    return ",".join(mem_opts)


def _boot_args(config: MachineConfig, accel: str, console_log: Path) -> list[str]:
    """The guest's console, kernel, initrd and kernel command line."""
    return [
        "-serial", f"file:{console_log}",
        "-kernel", str(config.kernel),
        "-initrd", str(config.initrd),
        # TCG does not emulate speculative execution, so the guest's Spectre-class
        # mitigations only cost time there (boot is ~25% faster without them).
        "-append", kernel_cmdline(config) + (" mitigations=off" if accel == "tcg" else ""),
    ]


def _device_args(disk: Path, files: RunFiles) -> list[str]:
    """The disk, the agent's serial port, and QEMU's control socket and pid file."""
    return [
        # cache=unsafe: a running machine does not outlive a host crash anyway (its RAM is
        # gone); durable copies (snapshots) are flattened and fsynced by storage/.
        "-drive", f"file={disk},if=none,id=disk0,format=qcow2,cache=unsafe,discard=unmap",
        "-device", "virtio-blk-device,drive=disk0",
        "-device", "virtio-serial-device,max_ports=2",
        "-chardev", f"socket,id=agent,path={files.agent},server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=boxd.agent",
        "-qmp", f"unix:{files.qmp},server=on,wait=off",
        "-pidfile", str(files.pidfile),
    ]


def runtime_args(runtime: Path) -> list[str]:
    """boxd's guest root (a raw ext4 image every machine shares) as a read-only disk
    named by `RUNTIME_SERIAL`: a container image's machine runs its agent on that
    disk's Python, so the image needs none (docs/images.md)."""
    return [
        "-drive", f"file={runtime},if=none,id=rt0,format=raw,readonly=on",
        "-device", f"virtio-blk-device,drive=rt0,serial={RUNTIME_SERIAL}",
    ]


def _nic_args(net_fd: int | None) -> list[str]:
    """A non-isolated machine's NIC, on passt's end of the socketpair ``net_fd``."""
    if net_fd is None:
        raise ValueError("a machine with a network needs passt's socket (net_fd)")
    return [
        "-netdev", f"stream,id=net0,server=off,addr.type=fd,addr.str={net_fd}",
        "-device", "virtio-net-device,netdev=net0",
    ]
