"""Shared fixtures.

Integration tests drive real machines through a real daemon: one daemon and one
booted *base* machine per test run (a cold boot takes seconds under TCG), and a fork
of the base per test for isolation (a fraction of a second). The guest image is
cached in ``<repo>/.cache/images`` so a run builds it once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IMAGE_CACHE = REPO / ".cache" / "images"


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

    for run_dir in (_shm_of(home) / "machines").glob("*/"):
        if (ns := _net.load(run_dir)) is not None:
            ns.signal_end()


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


_VM_COMMANDS = (b"runsc-sandbox", b"runsc-gofer", b"qemu-system-")


def _vm_processes() -> dict[int, str]:
    """Live QEMU, gVisor sandbox and gofer processes: pid -> command line."""
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in "ZX" and argv and any(c in Path(argv[0].decode(errors="replace")).name
                                             .encode() for c in _VM_COMMANDS):
            found[int(proc.name)] = b" ".join(argv).decode(errors="replace")[:240]
    return found


def _kill_left(pids: Collection[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                if "freezer" in controllers.split(",") and path != "/":
                    Path("/sys/fs/cgroup/freezer", path.lstrip("/"), "freezer.state") \
                        .write_text("THAWED")  # a frozen task does not die until thawed
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _live_daemons() -> set[bytes]:
    """The tmpfs folder names (``boxd-<hash>``) of the boxd daemons running now. The
    run's own daemons are all stopped by the time the guards below look; one still
    running is another's on this host (a developer's, a benchmark's), with machines
    and files the guards must leave alone."""
    from boxd.config import Paths

    names: set[bytes] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"serve" not in argv or not any(b"boxd" in a for a in argv[:3]):
                continue
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes()
                       .split(b"\0") if b"=" in kv)
        except OSError:
            continue
        home = Path(env.get(b"BOXD_HOME", b"/var/lib/boxd").decode()).expanduser()
        names.add(Paths(home.resolve()).shm.name.encode())
    return names


def _of_live_daemon(pid: int, live: set[bytes]) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(name in cmdline for name in live)


def _shm_trees() -> set[Path]:
    """The daemons' tmpfs folders (``/dev/shm/boxd-<hash of the data directory>``)."""
    return set(Path("/dev/shm").glob("boxd-*"))


def _files_in(tree: Path) -> list[Path]:
    """What a daemon's tmpfs folder holds besides runsc's own bookkeeping (``gvisor/``:
    its log, and the state files of sandboxes killed without ``runsc delete``)."""
    return [f for f in tree.rglob("*")
            if not f.is_dir() and f.relative_to(tree).parts[0] != "gvisor"]


@pytest.fixture(scope="session", autouse=True)
def _no_tmpfs_outlives_the_run() -> Iterator[None]:
    """The tmpfs folder (and cgroup parent) of every daemon the run starts goes with
    it. A daemon keeps them (its machines outlive it), so the tests remove the ones
    they made: quietly when only empty folders and runsc's bookkeeping are left. One
    that still holds a template, a checkpoint or a machine's files is host memory the
    code leaked: it is removed too, and the run fails. A running daemon's folder is
    not the run's (see `_live_daemons`)."""
    before = _shm_trees()
    yield
    leaked: dict[Path, list[Path]] = {}
    live = _live_daemons()
    for tree in sorted(_shm_trees() - before):
        if tree.name.encode() in live:
            continue
        if files := _files_in(tree):
            leaked[tree] = files
        shutil.rmtree(tree, ignore_errors=True)
        _remove_cgroups_named(tree.name)  # its daemon's cgroup parent, once empty
    if leaked:
        pytest.fail("tmpfs files outlived the test run:\n" + "\n".join(
            f"  {t}: {', '.join(str(f.relative_to(t)) for f in fs[:5])}"
            for t, fs in leaked.items()))


@pytest.fixture(scope="session", autouse=True)
def _no_vm_outlives_the_run() -> Iterator[None]:
    """Every VM process the run starts ends with it: after every daemon is stopped and
    its machines killed, one still running was left behind by the code (a sandbox
    started after its daemon's clean-up, say). It is killed, and the run fails. (A
    daemon still running is not the run's: its machines are left alone.)"""
    before = set(_vm_processes())
    yield
    deadline = time.monotonic() + 20  # killed VMs take a moment to exit
    live = _live_daemons()
    while (left := {p: c for p, c in _vm_processes().items()
                    if p not in before and not _of_live_daemon(p, live)}) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        _kill_left(left)
        pytest.fail("VM processes outlived the test run:\n" +
                    "\n".join(f"  {p}: {c}" for p, c in sorted(left.items())))


@pytest.fixture(scope="session", autouse=True)
def _image_cache_env() -> Iterator[None]:
    os.environ.setdefault("BOXD_IMAGE_CACHE", str(IMAGE_CACHE))
    yield


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One real daemon for the whole run, on a fresh data directory."""
    # Not under pytest's 0700 base: QEMU drops to the boxd-qemu user and reopens disk
    # layers by path, so the directories above the data directory must be traversable.
    home = Path(tempfile.mkdtemp(prefix="boxd-test-", dir="/tmp"))
    old = os.environ.get("BOXD_HOME")
    os.environ["BOXD_HOME"] = str(home)
    d = start_daemon(home)
    try:
        yield d
    finally:
        d.stop()
        kill_machines_of(home)
        time.sleep(0.2)  # the killed VMs leave their cgroups
        remove_cgroups_of(home)
        import shutil

        shutil.rmtree(_shm_of(home), ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
        if old is None:
            os.environ.pop("BOXD_HOME", None)
        else:
            os.environ["BOXD_HOME"] = old


@pytest.fixture(scope="session")
def client(daemon: Daemon) -> Iterator[object]:
    """A `boxd.Boxd` client of the session daemon (local key, unix socket)."""
    from boxd import Boxd

    with Boxd() as b:
        yield b


@pytest.fixture(scope="session")
def base(client):  # type: ignore[no-untyped-def]
    """One cold-booted machine for the whole run; tests fork it, never change it."""
    m = client.machines.new("base")
    client.machines.wait_until_ready(m.id, timeout=300)
    return client.machines.get(m.id)


@pytest.fixture
def machine_factory(client, base, request):  # type: ignore[no-untyped-def]
    """Fork the base machine; every fork is deleted after the test (logs kept on failure)."""
    made: list[str] = []

    def make(name: str | None = None):  # type: ignore[no-untyped-def]
        m = client.machines.fork(base.id, name)
        made.append(m.id)
        return m

    yield make
    for mid in made:
        with contextlib.suppress(Exception):
            client.machines.delete(mid)


@pytest.fixture
def machine(machine_factory):  # type: ignore[no-untyped-def]
    """A fresh fork of the base machine, deleted after the test."""
    return machine_factory()


MachineFactory = Callable[..., object]
