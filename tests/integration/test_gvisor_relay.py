"""The step channel of a gVisor machine is relayed by boxd-init (C), as in a QEMU guest.

A gVisor sandbox's PID 1 is boxd-init when the agent tree has it (``guest/init.c``
compiled at image time): it answers streamed execs (``machines.spawn``, boxd.rl's env
servers) itself and hands everything else to agent.py behind it. These tests check that
the native relay is the one serving (``/proc/1``), and that frames, the 64 MiB bound and
the error paths (a dead process, a killed one, a fork's copy) behave as before.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest

from boxd import errors

pytestmark = pytest.mark.vm

ECHO = (
    "import sys\n"
    "r, w = sys.stdin.buffer, sys.stdout.buffer\n"
    "while True:\n"
    "    h = r.read(4)\n"
    "    if len(h) < 4: break\n"
    "    body = r.read(int.from_bytes(h, 'big'))\n"
    "    if body == b'die': sys.exit(3)\n"
    "    if body == b'huge': w.write((65 << 20).to_bytes(4, 'big')); w.flush(); continue\n"
    "    w.write(h + body); w.flush()\n"
)


@pytest.fixture
def gfork(client: Any, gvisor_base: Any) -> Any:
    m = client.machines.fork(gvisor_base.id, "grelay")
    client.machines.wait_until_ready(m.id, timeout=120)
    client.machines.files.upload(m.id, "/home/boxd/echo.py", ECHO)
    yield m
    with contextlib.suppress(errors.NotFound):
        client.machines.delete(m.id)


def test_pid_1_is_boxd_init_with_agent_py_behind_it(client: Any, gfork: Any) -> None:
    r = client.machines.exec(gfork.id, "tr '\\0' ' ' < /proc/1/cmdline; echo; "
                             "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done")
    assert r.exit_code == 0, r.stderr
    first, *rest = r.stdout.splitlines()
    assert "boxd-init --stdio --host-clock" in first
    assert any("agent.py --relay-fd 3" in line for line in rest), r.stdout


def test_frames_bounds_and_errors_through_the_native_relay(client: Any, gfork: Any) -> None:
    proc = client.machines.spawn(gfork.id, ["python3", "-u", "/home/boxd/echo.py"])
    for payload in (b"", b"x" * 100, os.urandom(300_000), os.urandom(8 << 20)):
        proc.send(payload)
        assert proc.recv(timeout=60) == payload
    # A dead env server: its exit status reaches the client as before.
    proc.send(b"die")
    with pytest.raises(errors.Conflict, match="exit status 3"):
        proc.recv(timeout=60)
    # A frame header over the bound kills the process, with the node's reason.
    big = client.machines.spawn(gfork.id, ["python3", "-u", "/home/boxd/echo.py"])
    big.send(b"huge")
    with pytest.raises(errors.Conflict, match="exited"):
        big.recv(timeout=60)
    (listed,) = [p for p in client.machines.processes(gfork.id) if p.id == big.id]
    assert listed.state == "exited" and "frame header" in (listed.reason or ""), listed
    # A killed process (a closed channel).
    third = client.machines.spawn(gfork.id, ["python3", "-u", "/home/boxd/echo.py"])
    third.send(b"ping")
    assert third.recv(timeout=60) == b"ping"
    third.kill()
    with pytest.raises(errors.Conflict, match="exited"):
        third.recv(timeout=60)


def test_a_fork_child_runs_its_own_copy_of_the_process(client: Any, gfork: Any) -> None:
    proc = client.machines.spawn(gfork.id, ["python3", "-u", "/home/boxd/echo.py"])
    proc.send(b"before")
    assert proc.recv(timeout=60) == b"before"
    child = client.machines.fork(gfork.id, "grelay-child")
    try:
        copy = client.machines.attach(child.id, proc.id)
        copy.send(b"in the child")
        proc.send(b"in the parent")
        assert copy.recv(timeout=60) == b"in the child"
        assert proc.recv(timeout=60) == b"in the parent"
        r = client.machines.exec(child.id, "tr '\\0' ' ' < /proc/1/cmdline")
        assert "boxd-init" in r.stdout
    finally:
        client.machines.delete(child.id)
