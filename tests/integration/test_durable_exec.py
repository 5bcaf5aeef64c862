"""Durable exec on a real daemon and machine (issue 42, item 5): a client killed mid-exec
leaves its command running and its result readable by the exec's id; a command that
traps SIGTERM is killed (SIGKILL after the grace) at its timeout; a finished exec's
result is read after the daemon is killed (SIGKILL) and restarted, and an exec the
daemon was running when killed (or stopped) answers `AgentLost`; an exec whose engine process (the
gVisor sandbox) is killed raises `InfrastructureError`, and its result says the same."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from boxd import Boxd, errors
from boxd.guest import protocol as P

from .test_faults import kill_daemon, restart
from .test_idempotency import _sandbox_pid

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


def _running(client: Any, machine: str, exec_id: str, said: str | None = None) -> None:
    """Until the daemon runs the exec (and its output has ``said``, if given)."""
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(errors.ExecNotFound):
            st = client.machines.exec_result(machine, exec_id)
            assert st.running, st
            if said is None or said in st.stdout:
                return
        assert time.monotonic() < deadline, f"exec {exec_id} never started"
        time.sleep(0.05)


def _in_thread(call: Callable[[Boxd], object]) -> tuple[threading.Thread, list[object]]:
    """``call`` with a client of its own, in a thread; what it returned or raised."""
    out: list[object] = []

    def run() -> None:
        with Boxd() as c:
            try:
                out.append(call(c))
            except BaseException as exc:  # what the test inspects
                out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_finished_execs_result_is_read_after_the_daemon_is_killed(  # type: ignore[no-untyped-def]
    client, daemon, machine,
) -> None:
    cmd = "echo ran >> /root/runs; echo out; echo err >&2; exit 3"
    first = client.machines.exec(machine.id, cmd, exec_id="fin-1")
    assert (first.stdout, first.stderr, first.exit_code) == ("out\n", "err\n", 3)
    kill_daemon(daemon)
    restart(daemon)
    with Boxd() as c:
        st = c.machines.exec_result(machine.id, "fin-1")
        assert not st.running and st.error is None, st
        assert (st.stdout, st.stderr, st.exit_code, st.duration) == (
            "out\n", "err\n", 3, first.duration)
        # Its id again: the kept result; the command did not run again.
        again = c.machines.exec(machine.id, cmd, exec_id="fin-1")
        assert (again.stdout, again.exit_code, again.duration) == ("out\n", 3, first.duration)
        assert c.machines.exec(machine.id, "cat /root/runs").stdout == "ran\n"


def test_an_exec_running_when_the_daemon_is_killed_answers_agent_lost(  # type: ignore[no-untyped-def]
    client, daemon, machine,
) -> None:
    t, out = _in_thread(lambda c: c.machines.exec(machine.id, "sleep 30", exec_id="cut-1"))
    _running(client, machine.id, "cut-1")
    kill_daemon(daemon)
    t.join(60)
    assert not t.is_alive() and isinstance(out[0], errors.BoxdError), out
    restart(daemon)
    with Boxd() as c:
        st = c.machines.exec_result(machine.id, "cut-1", wait=5)
        assert not st.running and st.exit_code is None and st.error is not None, st
        assert st.error.code == "agent_lost" and "daemon restarted" in st.error.message, st
        err = errors.error_from_body({"error": st.error.model_dump()})
        assert isinstance(err, errors.InfrastructureError), err
        with pytest.raises(errors.AgentLost):  # its id again: not run blindly a second time
            c.machines.exec(machine.id, "sleep 30", exec_id="cut-1")
        assert c.machines.exec(machine.id, "echo alive").stdout == "alive\n"


def test_an_exec_running_when_the_daemon_is_stopped_answers_agent_lost(  # type: ignore[no-untyped-def]
    client, daemon, machine,
) -> None:
    """A graceful stop (SIGTERM) answers as a kill does: its command said nothing yet, but
    it is not an exec a retry should run again."""
    t, out = _in_thread(lambda c: c.machines.exec(machine.id, "sleep 30", exec_id="stop-1"))
    _running(client, machine.id, "stop-1")
    daemon.restart()
    t.join(60)
    assert not t.is_alive() and isinstance(out[0], errors.BoxdError), out
    with Boxd() as c:
        st = c.machines.exec_result(machine.id, "stop-1")
        assert not st.running and st.error is not None, st
        assert st.error.code == "agent_lost" and "daemon stopped" in st.error.message, st


def test_an_exec_whose_sandbox_is_killed_raises_and_its_result_says_so(  # type: ignore[no-untyped-def]
    client, daemon, machine,
) -> None:
    client.machines.exec(machine.id, "true")
    pid = _sandbox_pid(daemon, machine.id)
    t, out = _in_thread(lambda c: c.machines.exec(
        machine.id, "echo started; sleep 30", exec_id="eng-1", timeout=120))
    _running(client, machine.id, "eng-1", said="started")
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    (raised,) = out
    assert isinstance(raised, errors.InfrastructureError), repr(raised)
    st = client.machines.exec_result(machine.id, "eng-1")
    assert not st.running and st.exit_code is None and st.error is not None, st
    assert st.stdout == "started\n"
    kept = errors.error_from_body({"error": st.error.model_dump()})
    assert isinstance(kept, errors.InfrastructureError), kept
    assert (kept.code, kept.message) == (raised.code, raised.message)
