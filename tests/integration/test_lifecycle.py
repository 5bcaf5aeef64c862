"""The lifecycle state machine on real machines: transient states and the race of issue 11.

A fork child maps its template's RAM privately; its first fork gives it RAM of its own
by replacing its QEMU process (state ``swapping``). A trainer that polls status while
it forks used to see the child marked failed for good ("killed by SIGKILL") although
its new VM ran. The same interleaving is a fake-engine unit test in
tests/unit/test_node_fake.py.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from boxd import errors
from boxd.config import Paths
from tests._support.guest import bump_counter, read_counter, start_counter
from tests._support.machines import _get, _vm_id

pytestmark = pytest.mark.vm


def test_status_polled_during_the_first_fork_of_a_fork_child(client, machine) -> None:  # type: ignore[no-untyped-def]
    client.machines.exec(machine.id, "echo child > /root/who")
    seen: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.append(client.machines.get(machine.id).state.value)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        grandchild = client.machines.fork(machine.id)
    finally:
        stop.set()
        poller.join()
    try:
        assert "failed" not in seen, seen
        assert "swapping" in seen  # the poller did look during the swap
        got = client.machines.get(machine.id)
        assert got.state.value == "running" and got.error is None
        assert client.machines.exec(machine.id, "cat /root/who").stdout == "child\n"
        assert client.machines.exec(grandchild.id, "cat /root/who").stdout == "child\n"
    finally:
        client.machines.delete(grandchild.id)


def test_exec_sent_during_the_swap_waits_and_answers(client, machine) -> None:  # type: ignore[no-untyped-def]
    results: list[str] = []
    failures: list[BaseException] = []

    def exec_when_swapping() -> None:
        try:
            deadline = time.monotonic() + 120
            while client.machines.get(machine.id).state.value != "swapping":
                if time.monotonic() > deadline:
                    raise AssertionError("never saw the machine swapping")
            results.append(client.machines.exec(machine.id, "echo after-swap").stdout)
        except BaseException as exc:  # reported below
            failures.append(exc)

    t = threading.Thread(target=exec_when_swapping)
    t.start()
    grandchild = client.machines.fork(machine.id)
    t.join(timeout=120)
    try:
        assert not failures, failures
        assert results == ["after-swap\n"]
    finally:
        client.machines.delete(grandchild.id)


def test_a_second_fork_reuses_the_own_ram_and_states_stay_running(client, machine) -> None:  # type: ignore[no-untyped-def]
    first = client.machines.fork(machine.id)
    second = client.machines.fork(machine.id)
    try:
        for m in (machine, first, second):
            assert client.machines.get(m.id).state.value == "running"
        with pytest.raises(errors.MachineNotFound):
            client.machines.get("no-such-machine")
    finally:
        client.machines.delete(first.id)
        client.machines.delete(second.id)


# ------------------------------------------------- suspend, hibernate, wake


def _qemu_pids(vm_id: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"boxd-{vm_id},"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _wait_state(client, ref: str, want: str, timeout: float = 60) -> list[str]:  # type: ignore[no-untyped-def]
    """Poll the state (status reads: never activity) until it is ``want``."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        state = client.machines.get(ref).state.value
        seen.append(state)
        if state == want:
            return seen
        assert time.monotonic() < deadline, f"{ref} never became {want}: {seen[-5:]}"
        time.sleep(0.2)


def test_the_idle_timer_suspends_polls_do_not_wake_and_exec_does(client, daemon) -> None:  # type: ignore[no-untyped-def]
    m = client.machines.new("idle-timer", suspend_after=3, hibernate_after=0)
    try:
        client.machines.wait_until_ready(m.id, timeout=300)
        start_counter(client, m.id)
        bump_counter(client, m.id, 3)
        seen = _wait_state(client, m.id, "suspended")
        assert seen[0] == "running"  # the polls of the loop above did not keep it awake
        (pid,) = _qemu_pids(_vm_id(daemon, m.id))
        before = _cpu_ticks(pid)
        time.sleep(2)
        used = _cpu_ticks(pid) - before
        assert used <= 10, f"a suspended machine used {used} ticks in 2 s"  # ~0 while paused
        got = client.machines.get(m.id)
        assert got.idle_seconds is not None and got.idle_seconds >= 3
        assert read_counter(client, m.id) == 3  # exec woke it; the process's memory is intact
        assert client.machines.get(m.id).state.value == "running"
    finally:
        client.machines.delete(m.id)


def test_hibernate_ends_qemu_and_a_request_wakes_it(client, daemon, machine) -> None:  # type: ignore[no-untyped-def]
    start_counter(client, machine.id)
    bump_counter(client, machine.id, 5)
    before = client.machines.get(machine.id)
    vm = _vm_id(daemon, machine.id)
    hib = client.machines.hibernate(machine.id)
    assert hib.state.value == "hibernated"
    assert _qemu_pids(vm) == []  # no QEMU process while hibernated
    assert not Paths(daemon.home.resolve()).run_dir(vm).exists()  # no RAM on /dev/shm
    with pytest.raises(errors.StateError):
        client.machines.suspend(machine.id)
    assert read_counter(client, machine.id) == 5  # exec woke it from disk
    after = client.machines.get(machine.id)
    assert after.state.value == "running"
    assert (after.id, after.name, after.url) == (before.id, before.name, before.url)
    # the clock was stepped to the host's at the wake
    guest_now = float(client.machines.exec(machine.id, "date +%s.%N").stdout)
    assert abs(guest_now - time.time()) < 5


def test_explicit_suspend_and_resume(client, machine) -> None:  # type: ignore[no-untyped-def]
    assert client.machines.suspend(machine.id).state.value == "suspended"
    assert client.machines.suspend(machine.id).state.value == "suspended"  # idempotent
    assert client.machines.resume(machine.id).state.value == "running"
    assert client.machines.exec(machine.id, "echo ok").stdout == "ok\n"


def test_deleting_suspended_and_hibernated_machines(client, daemon, machine_factory) -> None:  # type: ignore[no-untyped-def]
    a, b = machine_factory(), machine_factory()
    client.machines.suspend(a.id)
    client.machines.hibernate(b.id)
    vm_a = _vm_id(daemon, a.id)
    client.machines.delete(a.id)
    client.machines.delete(b.id)
    for m in (a, b):
        with pytest.raises(errors.MachineNotFound):
            client.machines.get(m.id)
    assert _qemu_pids(vm_a) == []
    assert not (Paths(daemon.home.resolve()).hibernated / b.id).exists()


def test_hibernated_machines_do_not_count_against_the_quota(client, daemon) -> None:  # type: ignore[no-untyped-def]
    from boxd import Boxd

    created = client.keys.create("quota-test", account="quota-test")
    with Boxd(api_key=created.secret) as other:
        assert client.accounts.update("quota-test", max_machines=1).max_machines == 1
        with pytest.raises(errors.AuthError):  # only the operator raises limits
            other.accounts.update("quota-test", max_machines=100)
        a = other.machines.new("qa")
        try:
            other.machines.wait_until_ready(a.id, timeout=300)
            with pytest.raises(errors.QuotaExceeded):
                other.machines.new("qb")
            other.machines.hibernate(a.id)
            assert other.accounts.get("quota-test").machines == 0
            b = other.machines.new("qb")  # a hibernated machine does not count
            try:
                with pytest.raises(errors.QuotaExceeded) as info:
                    other.machines.exec(a.id, "true")  # waking it would exceed the limit
                assert info.value.details["limit"] == 1
                assert other.machines.get(a.id).state.value == "hibernated"
            finally:
                other.machines.delete(b.id)
            assert other.machines.exec(a.id, "echo up").stdout == "up\n"
        finally:
            other.machines.delete(a.id)


# --------------------------------------------------------------- machine URLs


def test_the_url_stays_across_restore_and_hibernate_and_wakes_the_machine(  # type: ignore[no-untyped-def]
    client, daemon, machine
):
    client.machines.files.upload(machine.id, "/srv/www/index.html", "v1")
    r = client.machines.exec(
        machine.id, "cd /srv/www && nohup python3 -m http.server 8080 >/tmp/http.log 2>&1 &")
    assert r.exit_code == 0, r.stderr
    url = machine.url
    assert url and _get(url + "/") == "v1"
    client.machines.checkpoints.save(machine.id, "serving")
    client.machines.files.upload(machine.id, "/srv/www/index.html", "v2")
    assert _get(url + "/") == "v2"
    restored = client.machines.checkpoints.restore(machine.id, "serving")
    assert restored.url == url and _get(url + "/") == "v1"  # same URL, rewound server
    client.machines.hibernate(machine.id)
    assert _qemu_pids(_vm_id(daemon, machine.id)) == []
    assert _get(url + "/") == "v1"  # the request woke it
    got = client.machines.get(machine.id)
    assert got.state.value == "running" and got.url == url
