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
import tempfile
import time
from collections.abc import Callable, Collection, Generator, Iterator
from pathlib import Path

import pytest

from tests._support import vm_guard
from tests._support.daemon import (
    IMAGE_CACHE,
    REPO,
    Daemon,
    _remove_cgroups_named,
    _shm_of,
    kill_machines_of,
    remove_cgroups_of,
    start_daemon,
)

__all__ = ["IMAGE_CACHE", "REPO", "Daemon", "kill_machines_of", "remove_cgroups_of",
           "start_daemon"]


# ------------------------------------------------ no machine outside a vm test


def pytest_configure(config: pytest.Config) -> None:
    vm_guard.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Between its setup and its teardown, a test may start machines only if marked vm."""
    vm_guard.STATE.allowed = item.get_closest_marker("vm") is not None
    vm_guard.STATE.test = item.nodeid
    vm_guard.STATE.older = vm_guard.live_pids() if not vm_guard.STATE.allowed else set()
    yield
    vm_guard.STATE.allowed = False
    vm_guard.STATE.test = "(between tests)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None],
) -> Generator[None, pytest.TestReport, None]:
    """A non-vm test that tried to start a machine fails, even if it caught the refusal;
    so does one that leaves a real engine process of this run behind it."""
    outcome = yield
    report = outcome.get_result()
    if item.get_closest_marker("vm") is not None:
        return
    problems = list(vm_guard.STATE.refused)
    vm_guard.STATE.refused.clear()
    if call.when == "teardown":
        problems += [f"{item.nodeid} left a machine process: {pid} {argv}" for pid, argv in
                     sorted(vm_guard.engine_descendants(os.getpid(), vm_guard.STATE.older).items())]
    if problems and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = "not marked vm, but drives a machine:\n  " + "\n  ".join(problems)

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
        if b"--ray" in argv:  # a cluster's control plane: its nodes' folders are its too
            root = Path(env.get(b"BOXD_NODE_ROOT", bytes(home)).decode()).expanduser()
            names.update(Paths(n).shm.name.encode() for n in (root / "nodes").glob("*"))
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


def _starts_machines(request: pytest.FixtureRequest) -> bool:
    """Whether the run holds a test marked ``vm``. One without (the fast tier, the
    fresh-host tier scripts/test.sh runs beside the rest) starts no daemon with an
    engine (tests/_support/vm_guard.py fails it if it tries), so the two guards below
    stay out of it: what they would find is another run's."""
    return any(item.get_closest_marker("vm") for item in request.session.items)


@pytest.fixture(scope="session", autouse=True)
def _no_tmpfs_outlives_the_run(request: pytest.FixtureRequest) -> Iterator[None]:
    """The tmpfs folder (and cgroup parent) of every daemon the run starts goes with
    it. A daemon keeps them (its machines outlive it), so the tests remove the ones
    they made: quietly when only empty folders and runsc's bookkeeping are left. One
    that still holds a template, a checkpoint or a machine's files is host memory the
    code leaked: it is removed too, and the run fails. A running daemon's folder is
    not the run's (see `_live_daemons`)."""
    if not _starts_machines(request):
        yield
        return
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
def _no_vm_outlives_the_run(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every VM process the run starts ends with it: after every daemon is stopped and
    its machines killed, one still running was left behind by the code (a sandbox
    started after its daemon's clean-up, say). It is killed, and the run fails. (A
    daemon still running is not the run's: its machines are left alone.)"""
    if not _starts_machines(request):
        yield
        return
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
