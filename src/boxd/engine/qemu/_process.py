"""One QEMU process: spawn or re-attach, QMP, liveness, and its exit reason."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from qemu.qmp import ConnectError, ExecuteError, QMPClient

from boxd.engine.cgroups import Cgroups, VmCgroup
from boxd.errors import HostSetupError, InternalError, MachineFailed
from boxd.storage.fds import OwnedFd

log = logging.getLogger("boxd.engine")


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def pid_matches(pid: int, machine_id: str) -> bool:
    """True when ``pid`` is a live QEMU process of machine ``machine_id``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return f"boxd-{machine_id},".encode() in cmdline and _proc_state(pid) not in (None, "Z")


#: Mode mask of every QEMU process: files it creates are private to its user.
QEMU_UMASK = 0o077
_PR_SET_THP_DISABLE = 41
_thp_disabled = False


def _disable_transparent_hugepages() -> None:
    """Keep QEMU processes (children inherit this) off transparent huge pages.

    TCG's translation buffer is advised for huge pages, so every 2 MiB region a child
    touches costs 2 MiB: an idle fork child carried ~20 MiB of mostly empty huge pages.
    The flag is per process and inherited by children, so the daemon sets it on itself
    once, before it spawns the first QEMU.
    """
    global _thp_disabled
    if _thp_disabled:
        return
    _thp_disabled = True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)
    except (OSError, AttributeError):
        log.debug("event=thp_disable_unavailable")


class QemuProcess:
    """A QEMU process we spawned (``popen``) or found again after a restart (pid only)."""

    def __init__(
        self, machine_id: str, pid: int, qmp_path: Path, log_path: Path,
        popen: subprocess.Popen[bytes] | None = None, *,
        cgroup: VmCgroup | None = None, cgroups: Cgroups | None = None,
    ) -> None:
        self.machine_id = machine_id
        self.pid = pid
        self.qmp_path = qmp_path
        self.log_path = log_path
        self.popen = popen
        # Its passt (a child of ours, reaped once QEMU has ended), if it has a network.
        self.passt: subprocess.Popen[bytes] | None = None
        self.cgroup = cgroup  # its own cgroup (see boxd.engine.cgroups), if any
        self._cgroups = cgroups
        # Read from the cgroup before it is removed, for exit_reason.
        self._oom: bool | None = None
        self._limit: int | None = None
        self._qmp: QMPClient | None = None
        self._qmp_lock = asyncio.Lock()

    @classmethod
    def spawn(
        cls, machine_id: str, argv: list[str], qmp_path: Path, log_path: Path,
        pass_fds: tuple[int, ...] = (), *,
        cgroup: VmCgroup | None = None, cgroups: Cgroups | None = None,
    ) -> QemuProcess:
        """Start QEMU in its own session (it outlives a daemon restart), inside
        ``cgroup`` from its first instruction when one is given.

        ``pass_fds`` stay open in QEMU under their numbers (passt's socket).

        Raises:
            HostSetupError: the QEMU binary is missing.
        """
        _disable_transparent_hugepages()
        # The run directory (RAM file, sockets) and the log directory (QEMU and console
        # logs) are the daemon's alone; QEMU opens all of them before it drops to its
        # own user. umask 077: everything QEMU creates (RAM file, console log, captured
        # state, disk layers made by blockdev-snapshot-sync) is born 0600.
        for d in (qmp_path.parent, log_path.parent):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(d, 0o700)
        with OwnedFd.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) as fd:
            os.fchmod(fd.fd, 0o600)
            logf = fd.as_file("ab")
        with logf:
            logf.write(f"--- {time.strftime('%F %T')} {' '.join(argv)}\n".encode())
            logf.flush()
            try:
                popen = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                    start_new_session=True, close_fds=True, umask=QEMU_UMASK,
                    pass_fds=pass_fds,
                    preexec_fn=cgroup.join() if cgroup is not None else None,
                )
            except FileNotFoundError as exc:
                raise HostSetupError(
                    f"QEMU binary {argv[0]!r} not found",
                    hint="run scripts/setup-host.sh to install QEMU",
                ) from exc
        if cgroup is not None and not cgroup.contains(popen.pid):
            log.warning("machine=%s event=cgroup_not_joined pid=%d: it runs without limits",
                        machine_id, popen.pid)
        return cls(machine_id, popen.pid, qmp_path, log_path, popen, cgroup=cgroup,
                   cgroups=cgroups)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _proc_state(self.pid) not in (None, "Z")

    def exit_reason(self) -> str:
        """A one-line account of why the process is gone, from its status and log."""
        why = "the QEMU process is gone"
        if self.popen is not None and self.popen.returncode is not None:
            rc = self.popen.returncode
            if rc < 0:
                try:
                    name = signal.Signals(-rc).name
                except ValueError:
                    name = str(-rc)
                why = f"the QEMU process was killed by {name}"
                if -rc == signal.SIGKILL and self.oom_killed():
                    limit = self._limit if self.cgroup is None else self.cgroup.memory_limit
                    why += (" by the kernel's OOM killer: it reached its memory limit"
                            + (f" of {limit >> 20} MiB" if limit else "")
                            + " (guest RAM + QEMU's overhead; docs/security.md)")
                elif -rc == signal.SIGBUS:
                    # Guest RAM is a file on tmpfs: touching a page it has no room for
                    # raises SIGBUS.
                    why += (" (its RAM filesystem, BOXD_SHM, is probably full: free "
                            "memory there or give machines less memory)")
            else:
                why = f"the QEMU process exited with status {rc}"
        tail = self.log_tail()
        return f"{why}: {tail}" if tail else why

    def oom_killed(self) -> bool:
        if self._oom is None:
            return self.cgroup is not None and self.cgroup.oom_killed()
        return self._oom

    async def release_cgroup(self) -> None:
        """Remove the process's cgroup (it has ended); its OOM verdict is kept."""
        cg, self.cgroup = self.cgroup, None
        if cg is None:
            return
        self._oom, self._limit = cg.oom_killed(), cg.memory_limit
        if self._cgroups is not None:
            await self._cgroups.release(cg)
        else:
            cg.remove()

    async def reap_passt(self, grace: float = 2.0) -> None:
        """Reap this QEMU's passt once QEMU has ended: passt quits when its end of the
        socket pair closes, and one still running after ``grace`` seconds is killed.
        (Left alone it stayed a zombie of the daemon until the next launch, when
        ``subprocess`` reaps the children whose Popen objects were dropped.)"""
        passt, self.passt = self.passt, None
        if passt is None:
            return
        deadline = time.monotonic() + grace
        while passt.poll() is None:
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    passt.kill()
                await asyncio.to_thread(passt.wait)
                return
            await asyncio.sleep(0.01)

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_bytes()[-4000:].decode(errors="replace")
        except OSError:
            return ""
        keep = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("---")]
        tail = " | ".join(keep[-lines:])
        # QEMU names its files (RAM, disk layers, sockets): these are the daemon's
        # business, and this text reaches clients in error messages and `machine info`.
        for d in (self.log_path.parents[2], self.qmp_path.parents[2]):
            tail = re.sub(re.escape(str(d)) + r"(/[^\s'\"):,]*)?", "<boxd>", tail)
        return tail[-400:]

    async def qmp(self, timeout: float = 10.0) -> QMPClient:
        """The QMP connection, opened on first use (waits for QEMU to create the socket)."""
        async with self._qmp_lock:
            if self._qmp is not None:
                return self._qmp
            deadline = time.monotonic() + timeout
            while True:
                if not self.alive():
                    raise MachineFailed(
                        f"machine {self.machine_id} failed: {self.exit_reason()}",
                        hint="delete it and create it again", machine=self.machine_id,
                    )
                if not self.qmp_path.exists():
                    # QEMU has not created its socket yet (connecting would log errors).
                    if time.monotonic() > deadline:
                        raise MachineFailed(
                            f"machine {self.machine_id}: QMP socket never appeared",
                            machine=self.machine_id,
                        )
                    await asyncio.sleep(0.005)
                    continue
                client = QMPClient(f"boxd-{self.machine_id}")
                try:
                    await client.connect(str(self.qmp_path))
                    self._qmp = client
                    return client
                except (ConnectError, OSError) as exc:
                    with contextlib.suppress(Exception):
                        await client.disconnect()
                    if time.monotonic() > deadline:
                        raise MachineFailed(
                            f"machine {self.machine_id}: QMP did not answer: {exc}",
                            machine=self.machine_id,
                        ) from exc
                    await asyncio.sleep(0.005)

    async def execute(self, cmd: str, args: dict[str, Any] | None = None) -> Any:
        """Run one QMP command, mapping QMP failures to boxd errors.

        Raises:
            MachineFailed: the process is gone or the connection broke.
            InternalError: QEMU refused the command.
        """
        client = await self.qmp()
        try:
            return await client.execute(cmd, args)
        except ExecuteError as exc:
            raise InternalError(f"QEMU refused {cmd}: {exc.error.error.desc}") from exc
        except Exception as exc:
            self._qmp = None
            if not self.alive():
                raise MachineFailed(
                    f"machine {self.machine_id} failed: {self.exit_reason()}",
                    hint="delete it and create it again", machine=self.machine_id,
                ) from exc
            raise MachineFailed(
                f"machine {self.machine_id}: QMP {cmd} failed: {exc!r}", machine=self.machine_id
            ) from exc

    async def wait_migration(self, timeout: float = 120.0) -> None:
        """Poll query-migrate until the migration completes.

        Raises:
            InternalError: the migration failed or timed out.
        """
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            info = await self.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise InternalError(
                    f"migration {status} for {self.machine_id}: {info.get('error-desc', '')}"
                )
            if time.monotonic() > deadline:
                raise InternalError(f"migration timed out for {self.machine_id} ({status})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)

    async def disconnect(self) -> None:
        client, self._qmp = self._qmp, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.disconnect()

    async def wait_exit(self) -> None:
        """Return once the process has ended (and is reaped, when it is our child).

        Event-driven: a pidfd becomes readable when the process exits, for a child and
        for a process re-attached after a daemon restart alike.
        """
        if not self.alive():
            await self.release_cgroup()
            await self.reap_passt()
            return
        try:
            pidfd = OwnedFd.pidfd(self.pid)
        except OSError:
            await self.release_cgroup()
            await self.reap_passt()
            return  # gone already
        with pidfd:
            loop = asyncio.get_running_loop()
            ended: asyncio.Future[None] = loop.create_future()

            def on_exit() -> None:
                if not ended.done():
                    ended.set_result(None)

            loop.add_reader(pidfd.fd, on_exit)
            try:
                if self.alive():
                    await ended
                while self.alive():  # readable means exited; reaping may lag a moment
                    await asyncio.sleep(0.01)
            finally:
                loop.remove_reader(pidfd.fd)
        if not self.alive():
            await self.release_cgroup()
            await self.reap_passt()

    async def kill(self) -> None:
        """SIGKILL the process and reap it."""
        await self.disconnect()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.popen is not None:
            for _ in range(500):
                if self.popen.poll() is not None:
                    break
                await asyncio.sleep(0.01)
        else:
            for _ in range(500):
                if _proc_state(self.pid) in (None, "Z"):
                    break
                await asyncio.sleep(0.01)
        if not self.alive():
            await self.release_cgroup()
            await self.reap_passt()
