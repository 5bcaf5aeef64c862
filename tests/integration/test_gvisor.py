"""The core of the integration suite on both engines (QEMU and gVisor), through the daemon.

Each test takes ``engine_base``: the session's QEMU base machine, or a gVisor base
machine made here with ``machines.new(engine="gvisor")`` on the same daemon. gVisor
tests skip, with the probe's reason, where runsc cannot run sandboxes (``info()``
says why). Then gVisor-only checks: the engine choice (``auto``), a snapshot refused
on the other engine, and the spec's RL demo on gVisor forks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import runpy
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd import errors
from boxd.config import Paths
from tests._support.cgroups import _cgroups_of, _gone, _limit, _require_cgroups
from tests._support.machines import _get, _vm_id
from tests._support.rl_guest import EXAMPLES, GUEST_WHEELS, _ok, warm_rl_base

pytestmark = pytest.mark.vm

ENGINES = ["qemu", "gvisor"]


@pytest.fixture(params=ENGINES)
def engine_base(request, client):  # type: ignore[no-untyped-def]
    if request.param == "qemu":
        return request.getfixturevalue("base")
    return request.getfixturevalue("gvisor_base")


@pytest.fixture
def fork_of(client) -> Iterator[object]:  # type: ignore[no-untyped-def]
    made: list[str] = []

    def fork(src, name=None):  # type: ignore[no-untyped-def]
        m = client.machines.fork(src.id, name)
        made.append(m.id)
        return m

    yield fork
    for mid in made:
        with contextlib.suppress(Exception):
            client.machines.delete(mid)


def test_machine_exec_and_files(client, engine_base, fork_of) -> None:  # type: ignore[no-untyped-def]
    assert engine_base.engine in ENGINES
    m = fork_of(engine_base)
    assert client.machines.get(m.id).engine == engine_base.engine
    r = client.machines.exec(m.id, 'python3 -c "print(1+1)"; echo err >&2; exit 3')
    assert (r.stdout, r.stderr, r.exit_code) == ("2\n", "err\n", 3)
    data = os.urandom(300_000)
    info = client.machines.files.upload(m.id, "/home/boxd/blob.bin", data)
    assert info.size == len(data)
    assert client.machines.files.download(m.id, "/home/boxd/blob.bin") == data
    with pytest.raises(errors.NotFound):
        client.machines.files.download(m.id, "/home/boxd/nope")
    host, mid = client.machines.exec(m.id, "hostname; cat /etc/machine-id").stdout.split()
    assert host == m.name and len(mid) == 32


def test_fork_keeps_tmpfs_file_and_process(client, engine_base, fork_of) -> None:  # type: ignore[no-untyped-def]
    """Writes do not cross between source and child."""
    src = fork_of(engine_base)
    _ok(client, src.id, "echo marker-$RANDOM > /dev/shm/m; echo disk > /home/boxd/d; "
                        "nohup sleep 100000 >/dev/null 2>&1 & echo $! > /home/boxd/pid")
    marker = _ok(client, src.id, "cat /dev/shm/m")
    pid = _ok(client, src.id, "cat /home/boxd/pid").strip()
    start = _ok(client, src.id, f"cut -d' ' -f22 /proc/{pid}/stat")
    child = fork_of(src)
    client.machines.wait_until_ready(child.id)
    assert _ok(client, child.id, "cat /dev/shm/m") == marker
    assert _ok(client, child.id, f"cut -d' ' -f22 /proc/{pid}/stat") == start
    _ok(client, child.id, "echo child > /home/boxd/d")
    _ok(client, src.id, "echo parent > /home/boxd/only-parent")
    assert _ok(client, src.id, "cat /home/boxd/d") == "disk\n"
    assert client.machines.exec(child.id, "test -e /home/boxd/only-parent").exit_code == 1
    c_id = _ok(client, child.id, "cat /etc/machine-id")
    assert c_id != _ok(client, src.id, "cat /etc/machine-id")
    # The child's wall clock is the host's (QEMU: set by identity; gVisor: the host's own).
    assert abs(float(_ok(client, child.id, "date +%s.%N")) - time.time()) < 5


def test_batch_fork(client, engine_base) -> None:  # type: ignore[no-untyped-def]
    src = client.machines.fork(engine_base.id)
    try:
        results = client.machines.fork(src.id, count=4)
        assert all(not isinstance(r, errors.BoxdError) for r in results), results
        ids = [r.id for r in results]
        try:
            outs = {client.machines.exec(i, "hostname").stdout.strip() for i in ids}
            assert len(outs) == 4
        finally:
            for i in ids:
                client.machines.delete(i)
    finally:
        client.machines.delete(src.id)


def test_checkpoint_restore_in_place(client, engine_base, fork_of) -> None:  # type: ignore[no-untyped-def]
    m = fork_of(engine_base)
    _ok(client, m.id, "echo one > /home/boxd/f; echo t1 > /tmp/t")
    client.machines.checkpoints.save(m.id, "c1")
    _ok(client, m.id, "echo two > /home/boxd/f; rm /tmp/t; touch /home/boxd/later")
    client.machines.checkpoints.restore(m.id, "c1")
    assert _ok(client, m.id, "cat /home/boxd/f /tmp/t") == "one\nt1\n"
    assert client.machines.exec(m.id, "test -e /home/boxd/later").exit_code == 1
    after = client.machines.get(m.id)
    assert (after.name, after.engine) == (m.name, engine_base.engine)


def test_snapshot_to_new_machine(client, engine_base, fork_of) -> None:  # type: ignore[no-untyped-def]
    m = fork_of(engine_base)
    _ok(client, m.id, "echo snap > /home/boxd/s")
    name = f"snap-{engine_base.engine}-{os.getpid()}"
    snap = client.snapshots.save(m.id, name)
    try:
        new = client.machines.new(from_snapshot=name)
        try:
            client.machines.wait_until_ready(new.id)
            assert client.machines.get(new.id).engine == engine_base.engine
            assert _ok(client, new.id, "cat /home/boxd/s") == "snap\n"
        finally:
            client.machines.delete(new.id)
        other = "qemu" if engine_base.engine == "gvisor" else "gvisor"
        with pytest.raises(errors.InvalidRequest, match=f"saved on the {engine_base.engine}"):
            client.machines.new(from_snapshot=name, engine=other)
    finally:
        client.snapshots.delete(snap.name)


def test_isolated_machine_has_no_network(client, engine_base) -> None:  # type: ignore[no-untyped-def]
    """Nothing on the host's loopback is reachable (QEMU maps it to 10.0.2.2; under
    gVisor 127.0.0.1 is the sandbox's own), and no connection reaches the listener."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    m = client.machines.new(isolated=True, engine=engine_base.engine)
    try:
        client.machines.wait_until_ready(m.id, timeout=300)
        assert client.machines.get(m.id).url is None
        for host in ("10.0.2.2", "127.0.0.1"):
            r = client.machines.exec(
                m.id, f"python3 -c \"import socket; socket.create_connection(({host!r}, "
                      f"{port}), timeout=3)\"", timeout=60)
            assert r.exit_code != 0, (host, r)
        with pytest.raises(TimeoutError):
            srv.accept()
    finally:
        srv.close()
        client.machines.delete(m.id)


# --------------------------------------------------------------- gVisor only


def test_info_lists_every_engine(client, gvisor_base) -> None:  # type: ignore[no-untyped-def]
    info = client.info()
    by = {e.name: e for e in info.engines}
    assert set(by) == {"qemu", "gvisor"}
    assert by["gvisor"].status == "ok" and "user-space kernel" in by["gvisor"].reason
    assert by["qemu"].accelerator in ("kvm", "tcg")
    assert gvisor_base.engine == "gvisor"


def test_unknown_engine_is_a_clear_error(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.InvalidRequest, match="unknown engine"):
        client.machines.new(engine="firecracker")


@contextlib.contextmanager
def _auto_daemon(daemon, **env: str) -> Iterator[object]:  # type: ignore[no-untyped-def]
    """A second daemon with BOXD_ENGINE=auto (and ``env``), the session's probes copied."""
    from boxd import Boxd

    from ..conftest import _shm_of, kill_machines_of, remove_cgroups_of, start_daemon

    home = Path(f"/tmp/boxd-auto-{os.getpid()}")
    env = {"BOXD_ENGINE": "auto", **env}
    old = {k: os.environ.get(k) for k in (*env, "BOXD_HOME")}
    os.environ.update(env)
    home.mkdir(parents=True, exist_ok=True)
    for cached in ("host.json", "host-gvisor.json"):  # the session daemon's probes
        if (daemon.home / cached).exists():
            (home / cached).write_bytes((daemon.home / cached).read_bytes())
    try:
        d = start_daemon(home)
        os.environ["BOXD_HOME"] = str(home)
        try:
            with Boxd() as b:
                yield b
        finally:
            d.stop()
            kill_machines_of(home)
            time.sleep(0.2)  # the killed sandboxes leave their cgroups
            remove_cgroups_of(home)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import shutil

        shutil.rmtree(_shm_of(home), ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def test_auto_picks_gvisor_without_kvm(daemon) -> None:  # type: ignore[no-untyped-def]
    """A daemon left to its default engine (BOXD_ENGINE empty: `auto`) on this host (no
    usable KVM) runs machines on gVisor and says why."""
    with _auto_daemon(daemon, BOXD_ENGINE="") as b:
        info = b.info()
        by = {e.name: e for e in info.engines}
        if by["qemu"].accelerator == "kvm":
            assert info.engine == "qemu"
            return
        if by["gvisor"].status != "ok":
            pytest.skip(f"gvisor unavailable here: {by['gvisor'].reason}")
        assert info.engine == "gvisor"
        assert info.engine_reason and info.engine_reason.startswith("auto: gVisor")
        assert "TCG" in info.engine_reason
        m = b.machines.new("auto-1")
        b.machines.wait_until_ready(m.id, timeout=60)
        assert b.machines.get(m.id).engine == "gvisor"
        assert b.machines.exec(m.id, "echo ok").stdout == "ok\n"
        b.machines.delete(m.id)


def test_packages_baked_into_the_daemons_image_need_no_install(daemon) -> None:  # type: ignore[no-untyped-def]
    """BOXD_IMAGE_PIP puts packages into the image every new machine starts from: a new
    machine imports them before anything was installed in it, and a baseline's `pip
    install` of them is a no-op (so nothing lands in its own writes, which on gVisor
    live in memory and go into every fork's restore)."""
    with _auto_daemon(daemon, BOXD_ENGINE="gvisor", BOXD_IMAGE_PIP="gymnasium numpy") as b:
        by = {e.name: e for e in b.info().engines}
        if by["gvisor"].status != "ok":
            pytest.skip(f"gvisor unavailable here: {by['gvisor'].reason}")
        m = b.machines.new("baked")  # the first machine builds the image (~1-2 min)
        b.machines.wait_until_ready(m.id, timeout=900)
        where = _ok(b, m.id, "python3 -c 'import gymnasium, numpy; print(numpy.__file__)'")
        assert where.startswith("/usr/local/lib/python3"), where
        r = b.machines.exec(m.id, "pip install --no-index gymnasium numpy")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.count("Requirement already satisfied") >= 2, r.stdout
        b.machines.delete(m.id)


def test_auto_without_runsc_falls_back_to_qemu(daemon) -> None:  # type: ignore[no-untyped-def]
    """runsc missing (BOXD_RUNSC names no binary): auto runs QEMU and `info` says why."""
    with _auto_daemon(daemon, BOXD_RUNSC="/nonexistent/runsc") as b:
        info = b.info()
        by = {e.name: e for e in info.engines}
        assert by["gvisor"].status == "unavailable"
        assert "not an executable" in by["gvisor"].reason
        if by["qemu"].accelerator != "kvm":
            assert info.engine == "qemu"
            assert "gVisor is unavailable" in (info.engine_reason or "")
        with pytest.raises(errors.BoxdError, match="gvisor engine cannot run here"):
            b.machines.new("no-gvisor", engine="gvisor")
        assert not [m for m in b.machines.list() if m.name == "no-gvisor"]


def test_gvisor_machine_survives_a_daemon_restart(daemon, client, gvisor_base) -> None:  # type: ignore[no-untyped-def]
    """The sandbox keeps running; the new daemon reopens its agent FIFOs."""
    m = client.machines.fork(gvisor_base.id)
    try:
        _ok(client, m.id, "echo kept > /tmp/k; nohup sleep 9999 >/dev/null 2>&1 &")
        daemon.restart()
        assert _ok(client, m.id, "cat /tmp/k; pgrep -xc sleep") == "kept\n1\n"
        child = client.machines.fork(m.id)
        try:
            assert _ok(client, child.id, "cat /tmp/k") == "kept\n"
        finally:
            client.machines.delete(child.id)
    finally:
        client.machines.delete(m.id)


def test_killed_sandbox_fails_the_machine(client, daemon, gvisor_base) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL of the sandbox: the machine is failed with the reason and still deletable."""
    import signal
    import sqlite3
    import subprocess

    from boxd.config import Paths

    m = client.machines.fork(gvisor_base.id)
    db = Paths(daemon.home.resolve()).db
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        (vm_id,) = conn.execute("SELECT vm_id FROM machines WHERE id=?", (m.id,)).fetchone()
    out = subprocess.run(["pgrep", "-f", f"runsc-sandbox .* {vm_id}$"], capture_output=True,
                         text=True).stdout.split()
    assert len(out) == 1, out
    os.kill(int(out[0]), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while client.machines.get(m.id).state.value != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with pytest.raises(errors.MachineFailed, match="gVisor sandbox"):
        client.machines.exec(m.id, "true")
    client.machines.delete(m.id)
    with pytest.raises(errors.NotFound):
        client.machines.get(m.id)


def _nices(pid: int) -> set[int]:
    """The niceness of every thread of ``pid`` and of its descendants (systrap stubs)."""
    out: set[int] = set()
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            with contextlib.suppress(OSError):
                out.add(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def _check_standby(b, home: Path, base_id: str) -> str:  # type: ignore[no-untyped-def]
    """Fork ``base_id`` twice on the daemon of ``home`` and check the standby copy made
    after the first: low priority while it waits, the daemon's once the second fork
    claims it. Returns how it was held low ("cpu.idle" or "nice")."""
    import sqlite3
    import subprocess

    from boxd.config import Paths
    from boxd.engine.cgroups import Cgroups

    paths = Paths(home.resolve())
    log_file = home / "daemon.log"

    def vm_ids() -> set[str]:
        with contextlib.closing(sqlite3.connect(f"file:{paths.db}?mode=ro", uri=True)) as conn:
            return {r[0] for r in conn.execute("SELECT vm_id FROM machines")}

    def sandboxes() -> dict[str, int]:
        out = subprocess.run(["pgrep", "-af", "runsc-sandbox"], capture_output=True,
                             text=True).stdout.splitlines()
        return {line.split()[-1]: int(line.split()[0]) for line in out
                if str(paths.shm) in line}

    def cpu_idle(vm_id: str) -> str | None:
        cg = Cgroups.open(paths.shm.name).of(vm_id)
        if cg is None or "cpu" not in cg.dirs:
            return None
        return (cg.dirs["cpu"] / "cpu.idle").read_text().strip()

    def freezer(vm_id: str) -> str | None:
        cg = Cgroups.open(paths.shm.name).of(vm_id)
        return _freezer_state(cg) if cg is not None else None

    daemon_pid = int((home / "daemon.lock").read_text().split()[0])
    daemon_nice = os.getpriority(os.PRIO_PROCESS, daemon_pid)
    first = b.machines.fork(base_id)  # the template; one standby copy follows
    try:
        deadline = time.monotonic() + 60
        while not (spares := {v: p for v, p in sandboxes().items() if v not in vm_ids()
                              and f"machine={v} event=spare_ready" in log_file.read_text()}):
            assert time.monotonic() < deadline, "no standby copy was made"
            time.sleep(0.1)
        how = "nice" if any(cpu_idle(v) is None for v in spares) else "cpu.idle"
        if how == "cpu.idle":
            # The whole sandbox idles; its threads keep the niceness runsc gives them
            # (the daemon's, some gVisor threads one more).
            assert {v: cpu_idle(v) for v in spares} == dict.fromkeys(spares, "1")
            assert all(19 not in _nices(p) for p in spares.values()), spares
            if all(freezer(v) is not None for v in spares):
                # Paused and waiting: frozen, so its Sentry's timers cost no CPU.
                for v in spares:
                    _wait_frozen(lambda v=v: freezer(v), "FROZEN")
        else:
            assert all(_nices(p) == {19} for p in spares.values()), spares
        child = b.machines.fork(base_id)
        try:
            (claimed,) = set(spares) & vm_ids()
            if how == "cpu.idle":
                assert cpu_idle(claimed) == "0"
                assert 19 not in _nices(spares[claimed])
                assert freezer(claimed) in (None, "THAWED")
            else:
                assert _nices(spares[claimed]) == {daemon_nice}
            assert _ok(b, child.id, "echo ok") == "ok\n"
        finally:
            b.machines.delete(child.id)
    finally:
        b.machines.delete(first.id)
    return how


def test_a_standby_copy_restores_at_low_priority_and_runs_at_full_once_claimed(  # type: ignore[no-untyped-def]
    client, daemon, gvisor_base,
) -> None:
    """A standby copy's CPU-bound restore yields to running machines: its cgroup is
    cpu.idle (a sandbox's threads share one cgroup, so niceness would only rank them
    against each other); the fork that claims it gives it an equal share again."""
    from boxd.config import Paths
    from boxd.engine.cgroups import Cgroups

    cpu = Cgroups.open(Paths(daemon.home.resolve()).shm.name).parents.get("cpu")
    expect = "cpu.idle" if cpu is not None and (cpu / "cpu.idle").exists() else "nice"
    assert _check_standby(client, daemon.home, gvisor_base.id) == expect


def test_a_standby_copy_without_cgroups_runs_at_niceness_19(daemon) -> None:  # type: ignore[no-untyped-def]
    """BOXD_CGROUPS=off (or no CPU controller): every thread of the standby copy's
    sandbox gets niceness 19 instead, raised to the daemon's when it is claimed."""
    with _auto_daemon(daemon, BOXD_ENGINE="gvisor", BOXD_CGROUPS="off") as b:
        base = b.machines.new("nice-base")
        b.machines.wait_until_ready(base.id, timeout=120)
        assert _check_standby(b, Path(os.environ["BOXD_HOME"]), base.id) == "nice"


def _freezer_state(cg) -> str | None:  # type: ignore[no-untyped-def]
    """v1 ``freezer.state`` of a machine's cgroup, or None without a freezer hierarchy."""
    d = cg.dirs.get("freezer")
    return (d / "freezer.state").read_text().strip() if d is not None else None


def _wait_frozen(state, want: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while (now := state()) != want:
        assert time.monotonic() < deadline, f"freezer state {now!r}, expected {want!r}"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _cpu_ticks(pids: set[int]) -> int:
    """User + system clock ticks of every thread of ``pids`` so far."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])
    return total


def test_a_suspended_sandbox_is_frozen_spends_no_cpu_and_wakes(  # type: ignore[no-untyped-def]
    client, daemon, gvisor_base,
) -> None:
    """A paused Sentry's Go runtime still wakes every millisecond (3-6% of a core per
    sandbox here): a gVisor machine left paused has its cgroup frozen, so a suspended
    machine costs no CPU. Whatever talks to it thaws it first: a daemon restart's
    recovery (which pauses it again), an exec that wakes it, a delete (a frozen task
    cannot even die)."""
    from boxd.config import Paths
    from boxd.engine.cgroups import Cgroups

    _require_cgroups(client)
    m = client.machines.fork(gvisor_base.id)
    try:
        _ok(client, m.id, "echo before > /tmp/f")
        cg = Cgroups.open(Paths(daemon.home.resolve()).shm.name).of(_vm_id(daemon, m.id))
        assert cg is not None
        if _freezer_state(cg) is None:
            pytest.skip("no v1 freezer hierarchy here (set_frozen is unit-tested)")
        client.machines.suspend(m.id)
        _wait_frozen(lambda: _freezer_state(cg), "FROZEN")
        pids = cg.pids()
        assert pids
        ticks = _cpu_ticks(pids)
        time.sleep(1.0)
        assert _cpu_ticks(pids) == ticks  # not one tick in a second: nothing ran

        daemon.restart()  # recovery thaws and resumes it, then pauses it again
        assert client.machines.get(m.id).state.value == "suspended"
        _wait_frozen(lambda: _freezer_state(cg), "FROZEN")
        assert _ok(client, m.id, "cat /tmp/f") == "before\n"  # wakes it
        assert _freezer_state(cg) == "THAWED"
        assert client.machines.get(m.id).state.value == "running"

        client.machines.suspend(m.id)
        _wait_frozen(lambda: _freezer_state(cg), "FROZEN")
        pids = cg.pids()
    finally:
        client.machines.delete(m.id)
    deadline = time.monotonic() + 15
    while alive := [p for p in pids if _running(p)]:
        assert time.monotonic() < deadline, f"frozen sandbox processes left: {alive}"
        time.sleep(0.1)


def _sandbox_pids(vm_id: str) -> list[int]:
    import subprocess

    out = subprocess.run(["pgrep", "-f", f"runsc-sandbox .* {vm_id}$"], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def test_url_on_gvisor_across_restore_suspend_and_hibernate(client, daemon, gvisor_base,  # type: ignore[no-untyped-def]
                                                           fork_of) -> None:
    """A gVisor machine's URL reaches its port 8080 (the daemon's proxy, then a dialer
    in the sandbox), stays the same across restore and hibernate, and a request wakes a
    suspended or hibernated machine."""
    m = fork_of(gvisor_base)
    client.machines.files.upload(m.id, "/srv/www/index.html", "v1")
    # Over 16 KiB in one segment: runsc 20240729's port forward panicked the Sentry.
    big = os.urandom(256 * 1024)
    client.machines.files.upload(m.id, "/srv/www/big.bin", big)
    r = client.machines.exec(
        m.id, "cd /srv/www && nohup python3 -m http.server 8080 >/tmp/http.log 2>&1 &")
    assert r.exit_code == 0, r.stderr
    url = client.machines.get(m.id).url
    assert url and _get(url + "/", timeout=30) == "v1"
    with urllib.request.urlopen(url + "/big.bin", timeout=30) as resp:
        assert resp.read() == big
    assert client.machines.exec(m.id, "true").exit_code == 0  # the machine lives on
    client.machines.checkpoints.save(m.id, "serving")
    client.machines.files.upload(m.id, "/srv/www/index.html", "v2")
    assert _get(url + "/", timeout=30) == "v2"
    restored = client.machines.checkpoints.restore(m.id, "serving")
    assert restored.url == url and _get(url + "/", timeout=30) == "v1"
    client.machines.suspend(m.id)
    assert client.machines.get(m.id).state.value == "suspended"
    assert _get(url + "/", timeout=30) == "v1"  # the request woke it
    assert client.machines.get(m.id).state.value == "running"
    client.machines.hibernate(m.id)
    # The sandbox is killed before hibernate answers; it exits in the background (a
    # sentry freeing its memory takes a few hundred ms on a busy host).
    deadline = time.monotonic() + 10
    while _sandbox_pids(_vm_id(daemon, m.id)):
        assert time.monotonic() < deadline, "a hibernated machine's sandbox still runs"
        time.sleep(0.05)
    assert _get(url + "/", timeout=60) == "v1"
    got = client.machines.get(m.id)
    assert got.state.value == "running" and got.url == url
    # A fork child has a URL of its own, to its own copy of the server.
    child = fork_of(m)
    assert child.url and child.url != url
    assert _get(child.url + "/", timeout=30) == "v1"


# In the guest: touch memory 16 MiB at a time, printing how much so far.
HOG = """
import sys
chunks = []
for i in range(int(sys.argv[1]) // 16):
    chunks.append(bytearray(16 << 20))
    print((i + 1) * 16, flush=True)
"""


def test_a_sandbox_is_bounded_by_its_cgroup_and_memory_hogs_are_contained(  # type: ignore[no-untyped-def]
    client, daemon, gvisor_base, fork_of
) -> None:
    """Each sandbox (its Sentry, gofer and systrap stubs) runs in a cgroup of its own:
    memory twice its memory_mib plus the Sentry's overhead, an equal CPU share, a tasks
    limit. A guest process past the machine's memory is killed by boxd-init inside the
    guest (the machine runs on, the host's OOM killer never acts); past the cgroup's
    limit, when the memory is the guest's files (tmpfs), the host's OOM killer takes the
    Sentry (the machine fails, saying so). Other machines run on either way."""
    from boxd.engine.cgroups import GVISOR_OVERHEAD_MIB, GVISOR_PIDS_MAX

    _require_cgroups(client)
    limit_mib = 2 * 256 + GVISOR_OVERHEAD_MIB
    other = fork_of(gvisor_base)
    m = client.machines.new("gv-hog", engine="gvisor", memory_mib=256)
    try:
        client.machines.wait_until_ready(m.id, timeout=120)
        vm_id = _vm_id(daemon, m.id)
        (pid,) = _sandbox_pids(vm_id)
        dirs = _cgroups_of(pid)
        assert set(dirs) == {"memory", "cpu", "pids"}, dirs
        for d in dirs.values():
            assert d.name == vm_id and d.parent.name.startswith("boxd-"), d
        assert _limit(dirs) == limit_mib << 20
        assert int((dirs["pids"] / "pids.max").read_text()) == GVISOR_PIDS_MAX
        names = {Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].rsplit(b"/")[-1]
                 for p in (dirs["memory"] / "cgroup.procs").read_text().split()}
        assert {b"runsc-sandbox", b"runsc-gofer"} <= names, names

        # A guest process allocating past the machine's memory: killed by the guest's
        # own OOM killer near 256 MiB (SIGKILL, as a QEMU guest's kernel would), before
        # the sandbox's cgroup limit; the machine runs on. It was the whole sandbox.
        client.machines.files.upload(m.id, "/root/hog.py", HOG)
        r = client.machines.exec(m.id, "python3 /root/hog.py 1024", timeout=120)
        assert r.exit_code == 128 + 9, r  # the shell reports its child's SIGKILL
        assert 128 <= int(r.stdout.split()[-1]) <= 256 + 64, r.stdout[-200:]
        oom = (dirs["memory"] / "memory.oom_control").read_text()
        assert "oom_kill 0" in oom, oom  # the host's OOM killer had nothing to do
        console = Paths(daemon.home.resolve()).machines / vm_id / "console.log"
        assert "out of memory: killed process" in console.read_text(errors="replace")
        assert _ok(client, m.id, "echo alive") == "alive\n"
        assert client.machines.get(m.id).state.value == "running"
        r = client.machines.exec(m.id, "python3 /root/hog.py 128", timeout=120)
        assert r.exit_code == 0, r  # under the machine's memory: untouched

        # The guest's files past the limit: the sandbox is killed, the machine fails.
        with pytest.raises(errors.MachineFailed, match="OOM killer"):
            client.machines.exec(m.id, "dd if=/dev/zero of=/dev/shm/fill bs=1M count=2048",
                                 timeout=120)
        got = client.machines.get(m.id)
        assert got.state.value == "failed", got
        assert f"OOM killer: it reached its memory limit of {limit_mib} MiB" in (got.error or "")
        assert _gone(dirs), "the dead sandbox's cgroup (its gofer ended with it)"
        assert _ok(client, other.id, "echo alive") == "alive\n"
    finally:
        client.machines.delete(m.id)


@pytest.fixture(scope="module")
def gvisor_rl_base(client, gvisor_base):  # type: ignore[no-untyped-def]
    """``rl-base`` on gVisor, prepared like test_rl's (host-downloaded wheels)."""
    # The wheels and pip's cache would stay in the machine's memory (gVisor keeps a
    # machine's file changes there) and in every fork's restore.
    m = warm_rl_base(client, gvisor_base.id,
                     f"pip install -q --no-cache-dir --no-index --find-links {GUEST_WHEELS}"
                     f" gymnasium numpy && rm -rf {GUEST_WHEELS}")
    try:
        yield m
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)


def test_spec_rl_demo_on_gvisor(client, gvisor_rl_base, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The spec's fork-per-rollout loop and same-seed check, verbatim, on gVisor forks."""
    monkeypatch.chdir(EXAMPLES)
    t0 = time.monotonic()
    ns = runpy.run_path(str(EXAMPLES / "train_loop.py"), run_name="__main__")
    took = time.monotonic() - t0
    results, a, b = ns["results"], ns["a"], ns["b"]
    assert a == b
    records = [json.loads(line) for line in results]
    assert [r["seed"] for r in records] == list(range(8))
    assert len({r["actions"] for r in records}) > 1
    print(f"spec RL demo on gvisor: {took:.2f}s (8 rollouts + 2 checks)")
    # Same seed on parallel forks: byte-identical trajectories.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        def one(i: int) -> str:
            f = client.machines.fork(gvisor_rl_base.id)
            try:
                return _ok(client, f.id, "python3 /home/boxd/rollout.py --seed 7").strip()
            finally:
                client.machines.delete(f.id)

        outs = set(pool.map(one, range(4)))
    assert len(outs) == 1
