"""A real daemon for tests: `boxd serve` on its own data directory, and the clean-up of
what its machines leave (QEMU processes, gVisor sandboxes, cgroups, tmpfs folders)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import vm_guard

REPO = Path(__file__).resolve().parents[2]
# Where the suite builds and finds guest images: BOXD_IMAGE_CACHE if set (a worktree can
# share its checkout's), else the repo's own.
IMAGE_CACHE = Path(os.environ.get("BOXD_IMAGE_CACHE") or REPO / ".cache" / "images")


@dataclass
class Daemon:
    """A `boxd serve` process on its own data directory."""

    home: Path
    proc: subprocess.Popen[bytes]

    @property
    def log(self) -> Path:
        return self.home / "daemon.log"

    @property
    def socket(self) -> Path:
        return self.home / "boxd.sock"

    def env(self) -> dict[str, str]:
        return {**os.environ, "BOXD_HOME": str(self.home)}

    def restart(self) -> None:
        """Stop the daemon (its machines keep running) and start a new one."""
        self.stop()
        self.proc = start_daemon(self.home).proc

    def server_pid(self) -> int | None:
        """The pid of the process that serves this data directory (holds its lock).

        Usually ``proc``; but a client that found no daemon answering (one was being
        restarted) starts one itself, as the SDK does, and that one may win the lock.
        """
        return _lock_holder(self.home)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop whichever process serves the data directory (and ours, if it is not)."""
        pids = {p for p in (self.server_pid(),) if p is not None}
        if self.proc.poll() is None:
            pids.add(self.proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if self.proc.poll() is None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + 30
        while (pid := self.server_pid()) is not None:  # a daemon started by a client
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


def _lock_holder(home: Path) -> int | None:
    """The pid written in a data directory's lock file while a daemon holds the lock."""
    from boxd.config import Paths
    from boxd.sdk._local import daemon_holds_lock

    paths = Paths(home)
    if not daemon_holds_lock(paths):
        return None
    try:
        text = paths.lock.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def start_daemon(home: Path, *extra: str) -> Daemon:
    """Start `python -m boxd serve` on ``home`` and wait until it answers."""
    from boxd.sdk._local import is_healthy

    vm_guard.require_vm("started a real daemon (boxd serve)")
    home.mkdir(parents=True, exist_ok=True)
    # The daemon's default engine is `auto` (gVisor on a host without KVM); the suite's
    # daemons run QEMU unless BOXD_ENGINE says otherwise, so QEMU stays covered on every
    # host. gVisor machines are asked for by name (`engine="gvisor"`) or get a daemon of
    # their own (test_gvisor.py's `_auto_daemon`).
    env = {"BOXD_ENGINE": "qemu", **os.environ, "BOXD_HOME": str(home),
           "BOXD_IMAGE_CACHE": str(IMAGE_CACHE)}
    fd = os.open(home / "serve.out", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with open(fd, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "boxd", "serve", *extra], env=env, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while not is_healthy(home / "boxd.sock"):
        if proc.poll() is not None or time.monotonic() > deadline:
            text = (home / "serve.out").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"boxd serve did not start: {text}")
        time.sleep(0.1)
    while not (home / "local.key").exists():
        time.sleep(0.05)
    d = Daemon(home, proc)
    holder = d.server_pid()
    if holder is not None and holder != proc.pid:
        # A client started a daemon on this home meanwhile (it found none answering):
        # tests stop and kill "the daemon", so it must be this one.
        d.stop()
        return start_daemon(home, *extra)
    return d


def kill_machines_of(home: Path) -> None:
    """SIGKILL any QEMU process or gVisor sandbox (its gofer, its namespace's pasta) left
    by a data directory (test clean-up safety net)."""
    # A frozen task (a paused gVisor sandbox's cgroup) does not die until it is thawed.
    for state in Path("/sys/fs/cgroup").glob(f"freezer/**/{_shm_of(home).name}/*/freezer.state"):
        with contextlib.suppress(OSError):
            state.write_text("THAWED")
    out = subprocess.run(["pgrep", "-f", "boxd-m_"], capture_output=True, text=True).stdout
    gvisor = subprocess.run(["pgrep", "-f", "--", f"--root={_shm_of(home)}/gvisor"],
                            capture_output=True, text=True).stdout
    for pid in gvisor.split():
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)
    for pid in out.split():
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(home).encode() in env or str(_shm_of(home)).encode() in env:
                os.kill(int(pid), signal.SIGKILL)
    # A gVisor machine's network namespace: pasta and its holder, recorded in its run
    # directory (their command lines do not name the data directory).
    from boxd.engine.gvisor import _net

    _net.end_recorded(_shm_of(home) / "machines")


def remove_cgroups_of(home: Path) -> None:
    """Remove the per-machine cgroups of a data directory whose VMs are gone (a daemon
    removes them itself; one stopped before its machines were killed cannot)."""
    _remove_cgroups_named(_shm_of(home).name)  # the parent is named like the tmpfs folder


def _remove_cgroups_named(name: str) -> None:
    for parent in Path("/sys/fs/cgroup").glob(f"**/{name}"):
        for d in [*parent.glob("*/"), parent]:
            with contextlib.suppress(OSError):
                if d.is_dir() and not (d / "cgroup.procs").read_text().strip():
                    d.rmdir()


def _shm_of(home: Path) -> Path:
    from boxd.config import Paths

    return Paths(home.resolve()).shm
