"""QemuEngine and QemuMachine: boot, start from a memory image, capture, destroy.

Everything QEMU-specific lives here and below: QMP, migration streams, run states,
qcow2 layers, the unprivileged user QEMU drops to. The node runtime sees only the
protocols of `boxd.engine.base`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from boxd.config import GUEST_HTTP_PORT
from boxd.engine import netpolicy as _policy
from boxd.engine.agent import AgentClient, connect_watched, dial_guest_port
from boxd.engine.base import (
    BootDisk,
    EngineInfo,
    Fetcher,
    MachineConfig,
    MemoryImage,
    RootFile,
)
from boxd.engine.cgroups import Cgroups, Limits, memory_limit
from boxd.engine.qemu import _argv, _net
from boxd.engine.qemu._probe import AccelChoice
from boxd.engine.qemu._process import QemuProcess, pid_matches
from boxd.errors import (
    BoxdError,
    HostSetupError,
    InternalError,
    InvalidRequest,
    MachineFailed,
)
from boxd.images import (
    check_disk_name,
    disk_chain,
    disk_format,
    disk_name,
    find_disk,
    image_disk,
    place_disk,
    qcow2_backing,
    virtual_size,
)
from boxd.storage import disks
from boxd.storage.fds import OwnedFd
from boxd.storage.memory import sparse_copy

log = logging.getLogger("boxd.engine")

STATE_FILE = "state"
_MIGRATING = {"setup", "active", "device", "pre-switchover", "cancelling", "wait-unplug"}
MEM_FILE = "mem"


@dataclass(frozen=True)
class RunAs:
    """The unprivileged user QEMU drops to after opening its files (daemon run as root)."""

    user: str
    uid: int
    gid: int


def resolve_run_as(
    name: str, traversed: Iterable[Path], writable: Iterable[Path], listable: Iterable[Path]
) -> RunAs | None:
    """The unprivileged user QEMU drops to when the daemon runs as root (else None).

    ``name`` is ``BOXD_QEMU_USER`` (default ``boxd-qemu``, created by
    scripts/setup-host.sh; empty disables). QEMU reopens files by path after
    dropping privileges, so every directory in ``traversed`` (and its parents) must let
    it through; ``listable`` become traversable-not-listable (0711) and ``writable``
    (disk layers, capture directories) group-writable for its group.
    """
    if os.geteuid() != 0 or not name:
        return None
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        log.warning("event=qemu_runs_as_root reason=%r", f"no user {name!r}")
        return None
    for top in traversed:
        for d in top.parents:
            st = d.stat()
            if not (st.st_mode & stat.S_IXOTH or (st.st_gid == pw.pw_gid
                                                  and st.st_mode & stat.S_IXGRP)):
                log.warning(
                    "event=qemu_runs_as_root reason=%r",
                    f"{d} is not traversable by {name} (use a data directory such as "
                    "/var/lib/boxd)",
                )
                return None
    for d in listable:
        os.chmod(d, 0o711)  # traversable, not listable: QEMU reopens layers by path
    for d in writable:
        os.chown(d, 0, pw.pw_gid)
        os.chmod(d, 0o2770)
    return RunAs(name, pw.pw_uid, pw.pw_gid)


@dataclass(frozen=True)
class NetSetup:
    """How non-isolated machines get their network: passt, as ``user`` (root daemon)."""

    passt: str
    user: _net.NetUser | None
    filtered: bool
    policies: _policy.Policies = field(default_factory=_policy.Policies)

    def own_id(self, config: MachineConfig) -> int | None:
        """The uid and gid of a machine's passt when it has a network policy of its own
        (its rules installed), else None (passt runs as ``user``).

        Raises:
            HostSetupError: the policy cannot be enforced here (see `netpolicy.Policies`).
        """
        if not config.net.restricted:
            return None
        return self.policies.prepare(config.net, self.filtered, _net.resolvers())

    @classmethod
    def detect(cls, user_name: str = "boxd-net") -> NetSetup:
        """Find passt; as root, resolve its user and install the egress filter.

        Raises:
            HostSetupError: passt, nft or the user are missing, or the filter failed.
        """
        passt = _net.passt_binary()
        user = _net.resolve_net_user(user_name)
        if user is not None:
            _net.install_filter(user.uid)
        return cls(passt, user, filtered=user is not None)


class QemuMachine:
    """A live QEMU machine: its process, QMP, agent channel and RAM backing."""

    def __init__(
        self, config: MachineConfig, process: QemuProcess, files: _argv.RunFiles,
        disk: Path, ram_shared: bool, run_as: RunAs | None = None,
    ) -> None:
        self.config = config
        self.run_as = run_as
        self.process = process
        self.files = files
        self.disk = disk
        self._ram_shared = ram_shared
        self._agent: AgentClient | None = None
        self._agent_lock = asyncio.Lock()
        self._announced = False  # passt has seen a frame of this VM process's NIC

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def ram_shared(self) -> bool:
        return self._ram_shared

    def alive(self) -> bool:
        return self.process.alive()

    def exit_reason(self) -> str:
        return self.process.exit_reason()

    async def wait_exit(self) -> str:
        await self.process.wait_exit()
        return self.exit_reason()

    async def recover(self) -> str | None:
        """Cancel a capture a killed daemon left streaming (it would stop the VM again
        when it completes), then resume vCPUs it left paused."""
        await self.cancel_migration()
        status = (await self.process.execute("query-status")).get("status")
        if status in ("paused", "postmigrate", "finish-migrate"):
            await self.resume()
            return f"resumed a VM left {status}"
        return None

    def _failed(self) -> MachineFailed:
        return MachineFailed(
            f"machine {self.config.id} failed: {self.exit_reason()}",
            hint="delete it and create it again", machine=self.config.id,
        )

    async def agent(self, timeout: float = 60.0) -> AgentClient:
        """The agent connection, (re)opened when needed.

        Raises:
            MachineFailed: the VM is gone or its agent does not answer in time.
        """
        async with self._agent_lock:
            if self._agent is not None and self._agent.connected:
                return self._agent
            if not self.alive():
                raise self._failed()
            if self._agent is not None:
                with contextlib.suppress(Exception):
                    await self._agent.close()
                self._agent = None
            self._agent = await connect_watched(
                AgentClient.connect(self.files.agent, timeout=timeout), self.alive,
                self._failed)
            return self._agent

    async def cancel_migration(self, timeout: float = 30.0) -> None:
        """Cancel an outgoing migration left running (a capture whose daemon died)."""
        info = await self.process.execute("query-migrate")
        if info.get("status") not in _MIGRATING:
            return
        await self.process.execute("migrate_cancel")
        deadline = time.monotonic() + timeout
        while (await self.process.execute("query-migrate")).get("status") in _MIGRATING:
            if time.monotonic() > deadline:
                raise InternalError(f"could not cancel the migration of {self.config.id}")
            await asyncio.sleep(0.05)

    async def pause(self) -> None:
        await self.process.execute("stop")

    async def resume(self) -> None:
        await self.process.execute("cont")

    async def freeze_disk(self, new_active: Path) -> Path:
        """Switch writes to a new overlay; the old active layer becomes a frozen backing file."""
        frozen = self.disk
        await self.process.execute(
            "blockdev-snapshot-sync",
            {"device": "disk0", "snapshot-file": str(new_active), "format": "qcow2"},
        )
        self.disk = new_active
        return frozen

    async def collapse_disk(self, base: Path, timeout: float = 600.0) -> None:
        """Copy every layer between the active one and ``base`` into the active layer.

        Runs QEMU's ``block-stream`` job while the guest keeps running; afterwards the
        active layer's backing file is ``base`` and the intermediate layers are unused.

        Raises:
            InternalError: the job failed or ``base`` is not in the chain.
        """
        nodes = await self.process.execute("query-named-block-nodes", {"flat": True})
        base_node = next(
            (n["node-name"] for n in nodes
             if _is_base(str(n.get("file", "")), base) and n.get("drv") != "file"),
            None,
        )
        if base_node is None:
            raise InternalError(f"{base} is not in the disk chain of {self.config.id}")
        job = f"collapse-{self.config.id}"
        await self.process.execute(
            "block-stream", {"job-id": job, "device": "disk0", "base-node": base_node}
        )
        deadline = time.monotonic() + timeout
        while True:
            jobs = await self.process.execute("query-block-jobs")
            if not any(j.get("device") == job for j in jobs):
                break
            if time.monotonic() > deadline:
                raise InternalError(f"collapsing the disk of {self.config.id} timed out")
            await asyncio.sleep(0.05)
        info = await self.process.execute("query-block")
        disk = next(b for b in info if b.get("device") == "disk0")
        backing = disk["inserted"]["image"].get("backing-image", {}).get("filename")
        if backing is None or not _is_base(backing, base):
            raise InternalError(
                f"collapsing the disk of {self.config.id} did not finish (backing {backing})"
            )

    async def capture(self, dest_dir: Path) -> MemoryImage:
        """Write RAM and device state of the paused machine into ``dest_dir``.

        A machine that owns its RAM file (share=on) writes device state only (a few
        tens of KB, with ``x-ignore-shared``) and its RAM file is copied sparsely; a
        machine mapping a template privately streams its whole RAM (mapped-ram).
        The machine is left paused; call ``resume``.
        """
        dest_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.run_as is not None:
            # QEMU writes the state file itself, as its unprivileged user.
            os.chown(dest_dir, self.run_as.uid, self.run_as.gid)
        state = dest_dir / STATE_FILE
        if self._ram_shared:
            caps = [{"capability": "x-ignore-shared", "state": True},
                    {"capability": "mapped-ram", "state": False}]
        else:
            caps = [{"capability": "x-ignore-shared", "state": False},
                    {"capability": "mapped-ram", "state": True}]
        await self.process.execute("migrate-set-capabilities", {"capabilities": caps})
        await self.process.execute("migrate", {"uri": f"file:{state}"})
        await self.process.wait_migration()
        mem: Path | None = None
        if self._ram_shared:
            mem = dest_dir / MEM_FILE
            await asyncio.to_thread(sparse_copy, self.files.mem, mem)
        if self.files.runtime.is_file():  # the guest root it continues on (`_runtime_of`)
            shutil.copyfile(self.files.runtime, dest_dir / _argv.RUNTIME)
        return MemoryImage(mem_path=mem, state_path=state, memory_mib=self.config.memory_mib)

    async def destroy(self) -> None:
        """Kill the VM and remove its run directory."""
        await self.detach()
        await self.process.kill()
        shutil.rmtree(self.files.run_dir, ignore_errors=True)

    async def detach(self) -> None:
        if self._agent is not None:
            with contextlib.suppress(Exception):
                await self._agent.close()
            self._agent = None
        await self.process.disconnect()

    async def open_http(
        self, port: int = GUEST_HTTP_PORT
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Port 8080: passt's forward (the host's 127.0.0.1:``config.port``); another
        guest port: a dialer process in the guest, through the agent (`AgentClient.dial`)."""
        if self.config.port is None:
            raise OSError(f"machine {self.config.id} has no network (isolated)")
        if port == GUEST_HTTP_PORT:
            if not self._announced:
                await self._announce()
            return await asyncio.open_connection("127.0.0.1", self.config.port)
        return await dial_guest_port(self.config.id, self.agent(timeout=10.0), port)

    async def _announce(self) -> None:
        """Show this VM process's passt the guest's MAC address before its forward's
        first connection (QEMU sends one RARP frame from the guest's NIC).

        passt learns the guest's MAC from the guest's first frame and sends to the
        broadcast address until then; the guest's TCP drops a SYN so addressed, and passt
        gives the connection up after 10 s. A guest that continues from an image (wake,
        restore, fork child, RAM swap) is silent on its NIC with a new passt (no
        self-announce after the load: docs/fork.md), so every URL request to port 8080
        was closed after 10 s until the guest happened to send a frame.
        """
        try:
            await self.process.execute(
                "announce-self", {"initial": 1, "max": 1, "rounds": 1, "step": 1})
        except BoxdError as exc:
            log.warning("machine=%s event=announce_failed error=%s", self.config.id, exc)
            return
        self._announced = True


def _noted_runtime(image: MemoryImage) -> Path | None:
    """The guest root a capture notes beside its state (`QemuMachine.capture`)."""
    noted = image.state_path.with_name(_argv.RUNTIME)
    try:
        return Path(noted.read_text().strip())
    except (FileNotFoundError, NotADirectoryError):
        return None


def _is_qcow2(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"QFI\xfb"


def _is_base(file: str, base: Path) -> bool:
    """Whether a block node's ``file`` is the chain's ``base``: that path, or for a
    container image's tree (the base its records name) the disk of its top layer
    chain, `<chain id>.ext4` or `.qcow2` (`image_disk`: the tree is chains/<chain id>)."""
    if file == str(base):
        return True
    return base.is_dir() and Path(file).name.split(".", 1)[0] == base.resolve().name


class QemuEngine:
    """Boots QEMU microVMs with the accelerator chosen by the probe."""

    name = "qemu"

    def __init__(
        self, qemu: str, accel: AccelChoice, *, readonly_rom: bool = True,
        run_as: RunAs | None = None, version: str = "", net: NetSetup | None = None,
        net_user: str = "boxd-net", cgroups: Cgroups | None = None,
        runtime: Path | None = None, image_disks: Path | None = None,
        received_roots: Path | None = None,
    ) -> None:
        # boxd's guest root (the default image's rootfs.img) and where imported images
        # become disks: with both, machines boot on a container image (`image_roots`).
        self.runtime = runtime
        self.image_disks = image_disks
        # Where other nodes' roots received with a fork's template are kept (`_root`).
        self.received_roots = received_roots
        self._net = net
        self._net_user = net_user
        self.qemu = qemu
        self.accel = accel
        self.readonly_rom = readonly_rom
        self.run_as = run_as
        self.version = version
        self.cgroups = cgroups or Cgroups.off("not set up")
        self._root_locks: dict[str, asyncio.Lock] = {}  # a disk received once at a time

    @property
    def net(self) -> NetSetup:
        """passt and its filter, set up by the first machine that has a network.

        Raises:
            HostSetupError: passt, nft or passt's user are missing (isolated machines
                need none of them).
        """
        if self._net is None:
            self._net = NetSetup.detect(self._net_user)
            log.info("event=machine_network passt=%s user=%s filtered=%s", self._net.passt,
                     self._net.user.name if self._net.user else "-", self._net.filtered)
        return self._net

    @property
    def file_owner(self) -> tuple[int, int] | None:
        return (self.run_as.uid, self.run_as.gid) if self.run_as else None

    def info(self) -> EngineInfo:
        return EngineInfo(
            name=self.name, binary=self.qemu, version=self.version,
            accelerator=self.accelerator, accelerator_reason=self.accelerator_reason,
            cpu_model=self.cpu_model, limits=self.cgroups.summary(),
        )

    def attach(
        self, config: MachineConfig, run_dir: Path, pid: int, disk: Path, ram_shared: bool,
        log_path: Path,
    ) -> QemuMachine:
        return attach(config, run_dir, pid, disk, ram_shared, log_path, run_as=self.run_as,
                      cgroups=self.cgroups)

    def kill_stray(self, vm_id: str, run_dir: Path, pid: int | None = None) -> bool:
        """SIGKILL the QEMU process of ``vm_id`` if it still runs (pids recycle: the
        process's command line must name the VM). ``pid`` (the record's) is tried
        first; when it is not the VM's process (gone: a RAM swap, restore or wake
        started a new one and the daemon died before recording it), the pid file,
        then the command lines of all processes (a QEMU started just before the
        daemon died writes its pid file only once it is up)."""
        if pid is None or not pid_matches(pid, vm_id):
            pid = None
            with contextlib.suppress(OSError, ValueError):
                pid = int((run_dir / "qemu.pid").read_text().strip())
            if pid is None or not pid_matches(pid, vm_id):  # none yet, or a stale one
                pid = next((int(p.name) for p in Path("/proc").iterdir()
                            if p.name.isdigit() and pid_matches(int(p.name), vm_id)), None)
            if pid is None:
                return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.cgroups.release_now(self.cgroups.of(vm_id))
        return True

    async def create_disk(
        self, path: Path, backing: Path, backing_format: str, size_gib: int
    ) -> None:
        """A qcow2 overlay on ``backing``; a directory (a container image's unpacked
        root, `image_roots`) is first made a disk, once per layer chain (a raw ext4
        of the first, qcow2s of each chain's changes above it: `image_disk`)."""
        fmt = "raw" if backing_format == "raw" else "qcow2"
        if backing.is_dir():
            if self.image_disks is None:
                raise InternalError("this QEMU engine was opened without a place for "
                                    "image disks: it cannot boot a container image")
            group = self.file_owner[1] if self.file_owner else None
            backing = await asyncio.to_thread(image_disk, backing, self.image_disks, group)
            fmt = disk_format(backing)
            # An overlay smaller than its base would cut the image's filesystem short.
            need = -(-virtual_size(backing) // (1 << 30))
            if size_gib < need:
                raise InvalidRequest(
                    f"this image's files need a disk of at least {need} GiB; the machine's "
                    f"is {size_gib} GiB", field="disk_gib",
                    hint=f"boxd machine new NAME --image REF --disk {need} (or more)")
        await disks.create_overlay(path, backing, fmt, size_gib, owner=self.file_owner)

    async def flatten_disk(self, layer: Path, dest: Path) -> None:
        await disks.flatten(layer, dest)

    def remove_disk(self, path: Path) -> None:
        disks.remove(path)

    @property
    def image_roots(self) -> bool:
        # The image's tree becomes an ext4 disk (`create_disk`); the guest's /init runs
        # the agent on the Python of boxd's guest root, a second read-only disk.
        return self.runtime is not None and self.image_disks is not None

    @property
    def portable_templates(self) -> bool:
        # A template is a RAM file, a device state stream and qcow2 layers: files.
        return True

    @property
    def portable_image_templates(self) -> bool:
        # A container image's disk is packed on each node by mkfs.ext4 (its own UUID,
        # timestamps and block layout), and a frozen qcow2 layer is written over the
        # sender's block by block: the sender's disk chain goes with the template
        # (`root_files`, `receive_root`), kept here beside this node's own.
        return self.image_roots

    def root_files(self, layer: Path, image: MemoryImage) -> tuple[RootFile, ...]:
        # What the bottom layer sits on, block by block, as made on this node: a
        # container image's disk chain (and the guest root its agent runs from), the
        # guest root itself, or a snapshot's disk. Each goes by a name of its bytes.
        top = qcow2_backing(layer)
        if top is None:
            return ()
        if self.image_disks is not None and top.parent == self.image_disks:
            files = [RootFile(disk_name(d), d) for d in disk_chain(top)]
            runtime = _noted_runtime(image) or self.runtime
            if runtime is not None:
                files.append(RootFile(disk_name(runtime, "rootfs"), runtime))
            return tuple(files)
        if not _is_qcow2(top):
            return (RootFile(disk_name(top, "rootfs"), top),)
        if qcow2_backing(top) is not None:  # none such is made: say so, move nothing
            raise InternalError(f"the disk of this template sits on {top}, which is "
                                "neither a guest root, an image's disk nor a whole disk")
        return (RootFile(disk_name(top, "disk"), top),)

    async def receive_root(self, files: Sequence[tuple[str, Fetcher]],
                           into: Path) -> Path | None:
        below: Path | None = None
        for name, fetch in files:
            check_disk_name(name)
            kind = name.split(".", 1)[0]
            if kind == "rootfs" and below is not None:  # an image machine's guest root
                runtime = await self._root(name, fetch, None)
                (into / _argv.RUNTIME).write_text(str(runtime))  # `_runtime_of`
                continue
            below = await self._root(name, fetch, below)
        return below

    async def _root(self, name: str, fetch: Fetcher, below: Path | None) -> Path:
        """This node's copy of the root named ``name``: its own, kept from an earlier
        fork, or fetched now and kept (an image disk in the image disks, re-pointed at
        ``below``; a guest root or a snapshot's disk in the received roots)."""
        image_disk = name.split(".", 1)[0] not in ("rootfs", "disk")
        dest = self.image_disks if image_disk else self.received_roots
        if dest is None:
            raise HostSetupError(f"this QEMU engine has no place for another node's {name}",
                                 hint="run the node with boxd's own engine set-up")
        async with self._root_locks.setdefault(name, asyncio.Lock()):
            if image_disk:
                here = await asyncio.to_thread(find_disk, dest, name)
            elif self.runtime is not None and disk_name(self.runtime, "rootfs") == name:
                here = self.runtime  # the same guest root file (a shared image cache)
            else:
                here = dest / name if (dest / name).exists() else None
            if here is None:
                here = await self._fetch_disk(dest, name, fetch, below)
        return here

    async def _fetch_disk(self, dest: Path, name: str, fetch: Fetcher,
                          below: Path | None) -> Path:
        dest.mkdir(parents=True, exist_ok=True, mode=0o711)
        tmp = dest / f".{name}.recv-{os.getpid()}"
        t0 = time.monotonic()
        try:
            received = await fetch(tmp)
            group = self.file_owner[1] if self.file_owner else None
            path = await asyncio.to_thread(place_disk, tmp, dest, name, below, group)
        finally:
            tmp.unlink(missing_ok=True)
        log.info("event=root_received name=%s bytes=%d seconds=%.3f", name, received,
                 time.monotonic() - t0)
        return path

    async def retarget_disk(self, path: Path, backing: Path, backing_format: str) -> None:
        fmt = "raw" if backing_format == "raw" else "qcow2"
        if backing.parent in (self.image_disks, self.received_roots):
            fmt = disk_format(backing)  # a root another node's template sat on
        await disks.retarget(path, backing, fmt)

    async def receive_image(self, image: MemoryImage, disk: Path) -> MemoryImage:
        return image  # the RAM file and the device state start as they are

    @property
    def accelerator(self) -> str:
        return self.accel.accelerator

    @property
    def accelerator_reason(self) -> str:
        return self.accel.reason

    @property
    def cpu_model(self) -> str:
        return _argv.CPU_MODELS[self.accel.accelerator]

    def _spawn(
        self, config: MachineConfig, disk: Path, files: _argv.RunFiles, memory: _argv.Memory,
        log_path: Path, *, incoming: bool, runtime: Path | None = None,
    ) -> tuple[QemuProcess, _Forward | None]:
        """Start QEMU (and its passt); the caller checks the forward with `_Forward.wait`
        once QEMU answers, so passt binds its port while QEMU starts. ``runtime``: the
        guest root a container image's machine attaches (default: the daemon's)."""
        runtime = runtime or self.runtime
        net: OwnedFd | None = None
        passt: subprocess.Popen[bytes] | None = None
        forward: _Forward | None = None
        if not config.isolated:
            # Its own passt per QEMU process, a fork child's and a restore's too: the
            # migration stream carries the NIC's state, not its backend.
            passt, net = _net.spawn_passt(
                self.net.passt, port=config.port, user=self.net.user,
                log_file=log_path.with_name("passt.log"), own_id=self.net.own_id(config),
                map_gw=bool(config.net.expose_host),
            )
            if config.port is not None:
                forward = _Forward(passt, config.port, log_path.with_name("passt.log"),
                                   config.id)
        try:
            argv = _argv.build(
                qemu=self.qemu, config=config, accel=self.accel.accelerator, files=files,
                disk=disk, memory=memory, console_log=log_path.with_name("console.log"),
                incoming=incoming, readonly_rom_supported=self.readonly_rom,
                run_as=self.run_as.user if self.run_as else None,
                net_fd=None if net is None else net.fd, runtime=runtime,
            )
            if config.image_root and runtime is not None:
                files.runtime.write_text(str(runtime))  # `capture` keeps it
            for stale in (files.qmp, files.agent, files.pidfile):
                stale.unlink(missing_ok=True)
            cgroup = self.cgroups.create(
                config.id, Limits(memory_limit(config.memory_mib, ram_shared=memory.shared))
            )
            try:
                proc = QemuProcess.spawn(config.id, argv, files.qmp, log_path,
                                         pass_fds=() if net is None else (net.fd,),
                                         cgroup=cgroup, cgroups=self.cgroups)
            except BaseException:
                self.cgroups.release_now(cgroup)
                raise
            proc.passt = passt  # reaped with QEMU (`QemuProcess.reap_passt`)
            return proc, forward
        except BaseException:
            if passt is not None:  # no QEMU will use it: end and reap it now
                with contextlib.suppress(ProcessLookupError):
                    passt.kill()
                passt.wait()
            raise
        finally:
            # QEMU holds its own copy now (or never started: passt saw EOF).
            if net is not None:
                net.close()

    async def boot(
        self, config: MachineConfig, disk: BootDisk, run_dir: Path, log_path: Path
    ) -> QemuMachine:
        """Cold-boot a machine from its image (kernel + initramfs + disk)."""
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        files = _argv.RunFiles(run_dir)
        memory = _argv.Memory(files.mem, shared=True)
        proc, forward = self._spawn(config, disk.path, files, memory, log_path,
                                    incoming=False)
        machine = QemuMachine(
            config, proc, files, disk.path, ram_shared=True, run_as=self.run_as
        )
        try:
            await proc.qmp()
            if forward is not None:
                await forward.wait()
        except BaseException:
            await machine.destroy()
            raise
        return machine

    def _runtime_of(self, config: MachineConfig, image: MemoryImage) -> Path | None:
        """The guest root a container image's machine continues on: the one its capture
        was made on (a RAM file and device state are tied to its blocks: a guest root
        built since, after the daemon's guest image changed, holds other bytes), else
        (a snapshot's blobs, another node's template) the daemon's.

        Raises:
            MachineFailed: the capture's guest root is gone from this host.
        """
        runtime = _noted_runtime(image) if config.image_root else None
        if runtime is None:
            return None
        if not runtime.is_file():
            raise MachineFailed(
                f"machine {config.id} was saved on guest root {runtime}, which is gone",
                machine=config.id, hint="delete it and start it again from its image or a "
                "snapshot (the guest image was rebuilt or its cache cleared)")
        return runtime

    async def start_from(
        self, config: MachineConfig, disk: BootDisk, image: MemoryImage, run_dir: Path,
        log_path: Path, *, copy_memory: bool, paused: bool = False,
    ) -> QemuMachine:
        """Start a machine that continues from ``image`` (fork child, restore, snapshot).

        With ``paused`` the machine is left loaded but stopped; ``resume()`` runs it.
        """
        t0 = time.monotonic()
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        files = _argv.RunFiles(run_dir)
        if image.mem_path is None:
            # RAM is inside the stream: load it into a RAM file of the machine's own.
            memory = _argv.Memory(files.mem, shared=True)
            caps = [{"capability": "mapped-ram", "state": True}]
        elif copy_memory:
            await asyncio.to_thread(sparse_copy, image.mem_path, files.mem)
            memory = _argv.Memory(files.mem, shared=True)
            caps = [{"capability": "x-ignore-shared", "state": True}]
        else:
            memory = _argv.Memory(image.mem_path, shared=False, readonly=True)
            caps = [{"capability": "x-ignore-shared", "state": True}]
        proc, forward = self._spawn(config, disk.path, files, memory, log_path,
                                    incoming=True, runtime=self._runtime_of(config, image))
        machine = QemuMachine(
            config, proc, files, disk.path, ram_shared=memory.shared, run_as=self.run_as
        )
        try:
            t1 = time.monotonic()
            await proc.qmp()
            t2 = time.monotonic()
            await proc.execute("migrate-set-capabilities", {"capabilities": caps})
            # No self-announce after the load: a virtio-net guest would otherwise send
            # gratuitous ARP, IPv6 NA and MLD reports, pointless behind user-mode
            # networking and ~3k translation blocks of kernel work on a child's first run.
            await proc.execute("migrate-set-parameters", {"announce-rounds": 0})
            await proc.execute("migrate-incoming", {"uri": f"file:{image.state_path}"})
            await proc.wait_migration()
            if forward is not None:
                await forward.wait()  # bound long since, as a rule: one read of a table
            t3 = time.monotonic()
            if not paused:
                await proc.execute("cont")
            log.debug(
                "machine=%s event=start_timing copy=%.3f spawn_qmp=%.3f incoming=%.3f cont=%.3f",
                config.id, t1 - t0, t2 - t1, t3 - t2, time.monotonic() - t3,
            )
        except BaseException:
            await machine.destroy()
            raise
        log.debug("machine=%s started from image in %.3fs", config.id, time.monotonic() - t0)
        return machine


@dataclass(frozen=True)
class _Forward:
    """A VM's passt and the host port it forwards to the guest's HTTP port."""

    passt: subprocess.Popen[bytes]
    port: int
    log_file: Path
    machine: str

    async def wait(self) -> None:
        await _net.wait_forward(self.passt, self.port, self.log_file, self.machine)


def attach(
    config: MachineConfig, run_dir: Path, pid: int, disk: Path, ram_shared: bool,
    log_path: Path, run_as: RunAs | None = None, cgroups: Cgroups | None = None,
) -> QemuMachine:
    """Find a machine's QEMU process again after a daemon restart (no engine needed).

    Raises:
        MachineFailed: the process is gone.
    """
    files = _argv.RunFiles(run_dir)
    if not pid_matches(pid, config.id):
        raise MachineFailed(
            f"machine {config.id} failed: its QEMU process (pid {pid}) is gone",
            hint="delete it and create it again", machine=config.id,
        )
    proc = QemuProcess(config.id, pid, files.qmp, log_path,
                       cgroup=cgroups.of(config.id) if cgroups else None, cgroups=cgroups)
    return QemuMachine(config, proc, files, disk, ram_shared=ram_shared, run_as=run_as)
