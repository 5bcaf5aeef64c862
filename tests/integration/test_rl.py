"""The spec's RL loop on real machines, and what fork must guarantee for it.

``rl-base`` is prepared once per module the way the spec prepares it (gymnasium and
numpy installed, ``warm_up.py`` run), except that the packages come from wheels the
*host* downloads with its own pip configuration and uploads, instead of the guest
network: same packages, a fraction of the time under TCG, and no dependency on the
guest reaching an index. Then ``examples/rl/train_loop.py`` (the spec's "Fork per
rollout" code and "Verify reproducibility" check, verbatim) runs against the test
daemon with the real ``rollout.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import runpy
import time
from pathlib import Path

import pytest

from boxd import errors
from boxd.config import Paths
from tests._support.procs import qemu_cmdlines
from tests._support.rl_guest import EXAMPLES, GUEST_WHEELS, _ok, warm_rl_base

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def rl_base(client, base):  # type: ignore[no-untyped-def]
    """``rl-base``: a fork of the session's base machine with gymnasium, numpy and the
    warm worker, as after the spec's "Prepare one warm baseline"."""
    m = warm_rl_base(client, base.id, f"pip install --no-index --find-links {GUEST_WHEELS}"
                                      " gymnasium numpy")
    try:
        yield m
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)


def test_spec_fork_per_rollout_and_verify_reproducibility(client, rl_base, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.chdir(EXAMPLES)  # the spec opens "rollout.py" from the current directory
    ns = runpy.run_path(str(EXAMPLES / "train_loop.py"), run_name="__main__")
    results, a, b = ns["results"], ns["a"], ns["b"]
    assert a == b
    assert len(results) == 8
    import json

    records = [json.loads(line) for line in results]
    assert [r["seed"] for r in records] == list(range(8))
    assert len({r["actions"] for r in records}) > 1, "different seeds, same trajectory"
    assert json.loads(a)["seed"] == 42
    names = {m.name for m in client.machines.list()}
    assert not any(n.startswith(("rollout-", "check-")) for n in names)
    # The same seed on a third fork, through a fresh interpreter that bypasses the warm
    # worker, gives the same bytes: the warm path changes nothing but the time.
    fork = client.machines.fork(rl_base.id)
    try:
        client.machines.wait_until_ready(fork.id)
        cold = _ok(client, fork.id, "python3 /home/boxd/rollout.py --seed 42 --no-worker")
        assert cold.strip() == a
    finally:
        client.machines.delete(fork.id)


def test_fork_inherits_tmpfs_file_and_running_process(client, rl_base):  # type: ignore[no-untyped-def]
    _ok(client, rl_base.id, "echo warm-$(cat /proc/sys/kernel/random/uuid) > /dev/shm/marker")
    marker = _ok(client, rl_base.id, "cat /dev/shm/marker")
    worker = _ok(client, rl_base.id, "python3 warm_up.py")  # "already running (pid N, ...)"
    assert "already running" in worker
    pid = worker.split("pid ")[1].split(",")[0]
    start = _ok(client, rl_base.id, f"cut -d' ' -f22 /proc/{pid}/stat")
    child = client.machines.fork(rl_base.id)
    try:
        client.machines.wait_until_ready(child.id)
        assert _ok(client, child.id, "cat /dev/shm/marker") == marker
        # Same pid, same start time: the very process, not a restart.
        assert _ok(client, child.id, f"cut -d' ' -f22 /proc/{pid}/stat") == start
        assert _ok(client, child.id, f"cat /proc/{pid}/cmdline | tr '\\0' ' '").startswith(
            "python3 warm_up.py")
        r = client.machines.exec(child.id, "python3 /home/boxd/rollout.py --seed 3")
        assert r.exit_code == 0 and "via warm worker" in r.stderr, r
    finally:
        client.machines.delete(child.id)
        client.machines.exec(rl_base.id, "rm -f /dev/shm/marker")


def _exists(client, ref: str, path: str) -> bool:  # type: ignore[no-untyped-def]
    return client.machines.exec(ref, f"test -e {path}").exit_code == 0


def test_writes_are_private_to_each_machine(client, machine_factory):  # type: ignore[no-untyped-def]
    src = machine_factory()
    client.machines.wait_until_ready(src.id)
    _ok(client, src.id, "echo before > /root/shared.txt")
    a, b = client.machines.fork(src.id), client.machines.fork(src.id)
    try:
        for m in (a, b):
            client.machines.wait_until_ready(m.id)
        _ok(client, a.id, "echo a > /root/a.txt; echo a > /dev/shm/a; echo a >> /root/shared.txt")
        _ok(client, src.id, "echo s > /root/s.txt; echo s > /dev/shm/s")
        for path in ("/root/a.txt", "/dev/shm/a"):
            assert _exists(client, a.id, path)
            assert not _exists(client, b.id, path), f"sibling sees {path}"
            assert not _exists(client, src.id, path), f"source sees {path}"
        for path in ("/root/s.txt", "/dev/shm/s"):
            assert _exists(client, src.id, path)
            assert not _exists(client, a.id, path), f"child sees the source's later {path}"
            assert not _exists(client, b.id, path), f"child sees the source's later {path}"
        assert _ok(client, a.id, "cat /root/shared.txt") == "before\na\n"
        assert _ok(client, b.id, "cat /root/shared.txt") == "before\n"
        assert _ok(client, src.id, "cat /root/shared.txt") == "before\n"
    finally:
        for m in (a, b):
            client.machines.delete(m.id)


def _files(paths: Paths) -> set[Path]:
    found: set[Path] = set()
    for d in (paths.disks, paths.templates):
        if d.exists():
            found |= {p for p in d.rglob("*") if p.is_file()}
    return found


def _qemu_files(home: Path) -> list[tuple[set[str], str | None]]:
    """For each QEMU process of this data directory: the files on its command line, and
    the template RAM file it maps (None for a machine with RAM of its own)."""
    out = []
    for argv in qemu_cmdlines(home):
        line = " ".join(argv)
        files = set(re.findall(r"(/[^\s,=]+)", line))
        mem = re.search(r"mem-path=([^,\s]+),share=off", line)
        out.append((files, mem.group(1) if mem else None))
    return out


def test_twenty_children_at_once_then_nothing_left(client, machine_factory, daemon):  # type: ignore[no-untyped-def]
    paths = Paths(daemon.home.resolve())
    src = machine_factory()
    client.machines.wait_until_ready(src.id)
    before = _files(paths)
    children = client.machines.fork(src.id, count=20)
    made = [c for c in children if not isinstance(c, errors.BoxdError)]
    try:
        assert len(made) == 20, [str(c) for c in children if isinstance(c, errors.BoxdError)]
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            ready = list(pool.map(lambda c: client.machines.wait_until_ready(c.id), made))
            hosts = list(pool.map(lambda c: _ok(client, c.id, "hostname").strip(), made))
        assert all(m.state == "running" for m in ready)
        assert sorted(hosts) == sorted(c.name for c in made)  # 20 live, distinct machines
        assert len({m.id for m in client.machines.list()} & {c.id for c in made}) == 20
    finally:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda c: client.machines.delete(c.id), made))
        client.machines.delete(src.id)
    # Templates and frozen layers are reference-counted; give a background collector a
    # moment, then nothing that this test made may remain.
    deadline = time.monotonic() + 30
    while True:
        # Standby children of other sources (base's, refilled after each fork of it) may
        # appear meanwhile: their disks are not this test's. A spare mapping a template
        # that is gone would be this test's, and is not excused.
        others = set().union(*[files for files, mem in _qemu_files(paths.home)
                               if mem is not None and os.path.exists(mem)])
        left = {p for p in _files(paths) - before if str(p) not in others}
        src_layers = {p for p in before if p.parent == paths.disks} - _files(paths)
        if not left and src_layers and not any(
            src.id in str(p) for p in _files(paths)
        ):
            break
        if time.monotonic() > deadline:
            pytest.fail(f"left behind: {sorted(map(str, left))}; "
                        f"files of the source still there: {src_layers == set()}; "
                        f"QEMU processes: {_qemu_files(paths.home)}")
        time.sleep(0.5)
    assert not [mem for _, mem in _qemu_files(paths.home)
                if mem is not None and not os.path.exists(mem)], "a spare outlived its template"
    assert not (paths.templates / src.id).exists()
    assert not os.path.exists(paths.run_dir(src.id))
