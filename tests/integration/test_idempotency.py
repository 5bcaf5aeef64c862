"""Issue 42 on a real daemon with gVisor machines: idempotent forks (item 3) and
infrastructure errors that are never exit codes (item 6).

- a fork retried with its ``idempotency_key`` returns the same children, also after the
  daemon was killed with SIGKILL and restarted (the keys are in its SQLite state);
- an exec (unary and streaming) running ``sleep 30`` whose sandbox process is killed with
  SIGKILL from the host raises `boxd.InfrastructureError`, never an ``ExecResult``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable

import pytest

from boxd import Boxd, errors, models
from boxd.config import Paths

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]


def _sandbox_pid(daemon, machine_id: str) -> int:  # type: ignore[no-untyped-def]
    """The host pid of a gVisor machine's sandbox process (as test_gvisor finds it)."""
    db = Paths(daemon.home.resolve()).db
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        (vm_id,) = conn.execute("SELECT vm_id FROM machines WHERE id=?",
                                (machine_id,)).fetchone()
    out = subprocess.run(["pgrep", "-f", f"runsc-sandbox .* {vm_id}$"], capture_output=True,
                         text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def _ids(items: list[models.Machine | errors.BoxdError]) -> list[str]:
    assert all(isinstance(i, models.Machine) for i in items), items
    return [i.id for i in items if isinstance(i, models.Machine)]


def test_a_retried_fork_with_its_key_gives_the_same_children(client, gvisor_base) -> None:  # type: ignore[no-untyped-def]
    key = f"fork-{uuid.uuid4()}"
    before = {m.id for m in client.machines.list()}
    kids = client.machines.fork(gvisor_base.id, count=2, idempotency_key=key)
    try:
        again = client.machines.fork(gvisor_base.id, count=2, idempotency_key=key)
        assert _ids(again) == _ids(kids)
        made = {m.id for m in client.machines.list()} - before
        assert made == set(_ids(kids))
        with pytest.raises(errors.IdempotencyKeyReused):
            client.machines.fork(gvisor_base.id, count=3, idempotency_key=key)
        # concurrent retries of a new key: one child between them
        key2 = f"fork-{uuid.uuid4()}"
        got: list[str] = []

        def fork() -> None:
            with Boxd() as c:
                got.append(c.machines.fork(gvisor_base.id, idempotency_key=key2).id)

        threads = [threading.Thread(target=fork) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(got) == 4 and len(set(got)) == 1, got
        kids.append(client.machines.get(got[0]))
        assert {m.id for m in client.machines.list()} - before == set(_ids(kids))
    finally:
        for m in _ids(kids):
            with contextlib.suppress(errors.NotFound):
                client.machines.delete(m)


def test_a_fork_key_survives_a_daemon_killed_and_restarted(client, daemon, gvisor_base) -> None:  # type: ignore[no-untyped-def]
    key = f"fork-{uuid.uuid4()}"
    child = client.machines.fork(gvisor_base.id, idempotency_key=key)
    try:
        daemon.stop(signal.SIGKILL)
        daemon.restart()
        with Boxd() as c:
            again = c.machines.fork(gvisor_base.id, idempotency_key=key)
            assert again.id == child.id and again.name == child.name
            assert [m.id for m in c.machines.list() if m.parent_id == gvisor_base.id
                    and m.name == child.name] == [child.id]
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(child.id)


def _killed_mid_exec(  # type: ignore[no-untyped-def]
    client, daemon, gvisor_base, run: Callable[[Boxd, str], object],
) -> BaseException:
    """Run ``run(client, machine)`` (a ``sleep 30``) on a fresh fork, SIGKILL the fork's
    sandbox once the sleep runs, and return what ``run`` raised (fails if it returned)."""
    m = client.machines.fork(gvisor_base.id)
    try:
        client.machines.exec(m.id, "true")
        pid = _sandbox_pid(daemon, m.id)
        outcome: list[object] = []

        def call() -> None:
            with Boxd() as c:
                try:
                    outcome.append(run(c, m.id))
                except BaseException as exc:  # what the test inspects
                    outcome.append(exc)

        t = threading.Thread(target=call)
        start = time.monotonic()
        t.start()
        deadline = time.monotonic() + 30
        while "sleep 30" not in client.machines.exec(m.id, "ps -eo args").stdout:
            assert time.monotonic() < deadline, "the sleep never started"
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        assert not t.is_alive()
        assert time.monotonic() - start < 28, "the exec waited for the sleep's end"
        (got,) = outcome
        assert isinstance(got, BaseException), f"an exec result, not an error: {got!r}"
        return got
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)


def test_an_exec_whose_sandbox_is_killed_raises_infrastructure_error(  # type: ignore[no-untyped-def]
    client, daemon, gvisor_base,
) -> None:
    err = _killed_mid_exec(client, daemon, gvisor_base,
                           lambda c, m: c.machines.exec(m, "sleep 30", timeout=120))
    assert isinstance(err, errors.InfrastructureError), repr(err)
    assert isinstance(err, errors.MachineFailed) and "gVisor sandbox" in err.message, err


def test_a_streaming_exec_whose_sandbox_is_killed_raises_infrastructure_error(  # type: ignore[no-untyped-def]
    client, daemon, gvisor_base,
) -> None:
    def stream(c: Boxd, m: str) -> list[models.ExecEvent]:
        return list(c.machines.exec_stream(m, "echo started; sleep 30", timeout=120))

    err = _killed_mid_exec(client, daemon, gvisor_base, stream)
    assert isinstance(err, errors.InfrastructureError), repr(err)
    assert isinstance(err, errors.MachineFailed), repr(err)
