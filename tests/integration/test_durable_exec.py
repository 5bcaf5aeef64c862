"""Durable exec on a real daemon and machine (issue 42, item 5): a client killed mid-exec
leaves its command running and its result readable by the exec's id; a command that
traps SIGTERM is killed (SIGKILL after the grace) at its timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from boxd import errors
from boxd.guest import protocol as P

pytestmark = pytest.mark.vm


@pytest.fixture
def machine(client: Any, gvisor_base: Any) -> Iterator[Any]:
    """A fork of the module's gVisor base machine (gVisor: the default engine)."""
    m = client.machines.fork(gvisor_base.id)
    yield m
    with contextlib.suppress(errors.NotFound):
        client.machines.delete(m.id)

CLIENT = """
import sys
from boxd import Boxd
with Boxd() as b:
    b.machines.exec(sys.argv[1], "sleep 2; echo done", exec_id="dropped-1")
print("the exec returned before the client was killed", flush=True)
"""


def test_a_killed_clients_exec_runs_on_and_is_read_by_its_id(client, machine) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, machine.id],
                            env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:  # until the daemon has the exec (then its command runs)
            try:
                st = client.machines.exec_result(machine.id, "dropped-1")
                break
            except errors.ExecNotFound:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the exec never started"
                time.sleep(0.05)
        assert st.running, st
        proc.send_signal(signal.SIGKILL)  # the client and its connection are gone
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    st = client.machines.exec_result(machine.id, "dropped-1", wait=30)
    assert not st.running and st.error is None, st
    assert (st.stdout, st.exit_code, st.timed_out) == ("done\n", 0, False), st
    assert st.duration is not None and st.duration >= 1.5
    # The same id again: its kept result, the command not run again.
    again = client.machines.exec(machine.id, "sleep 2; echo done", exec_id="dropped-1")
    assert again.exec_id == "dropped-1" and again.stdout == "done\n"
    assert again.duration == st.duration


def test_a_command_trapping_term_is_killed_at_its_timeout(client, machine) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(errors.ExecTimeout) as err:
        client.machines.exec(
            machine.id,
            "trap 'echo got TERM' TERM; echo started; while :; do sleep 0.2; done",
            timeout=1, exec_id="trapper")
    took = time.monotonic() - start
    assert "started" in str(err.value.details.get("stdout")), err.value.details
    assert err.value.details.get("exec_id") == "trapper"
    st = client.machines.exec_result(machine.id, "trapper")
    assert st.timed_out and not st.running
    assert (st.exit_code, st.signal) == (137, signal.SIGKILL), st  # TERM was not enough
    assert "got TERM" in st.stdout  # but it was asked first
    assert 1 + P.EXEC_KILL_GRACE - 0.2 < took < 1 + P.EXEC_KILL_GRACE + 15, took
    # Nothing of it is left in the machine.
    left = client.machines.exec(machine.id, "ps -eo args | grep -c '[g]ot TERM' || true")
    assert left.stdout.strip() == "0", left
