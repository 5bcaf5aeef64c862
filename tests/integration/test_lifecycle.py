"""The lifecycle state machine on real machines: transient states and the race of issue 11.

A fork child maps its template's RAM privately; its first fork gives it RAM of its own
by replacing its QEMU process (state ``swapping``). A trainer that polls status while
it forks used to see the child marked failed for good ("killed by SIGKILL") although
its new VM ran. The same interleaving is a fake-engine unit test in
tests/unit/test_node_fake.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from boxd import errors

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
