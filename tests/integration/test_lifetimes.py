"""Machine lifetimes on a real daemon with real gVisor machines (issue 42, item 1): a
machine's end deletes it (or hibernates it, and it wakes), ``set_timeout`` moves the
end, and a daemon killed with SIGKILL keeps every deadline and ends at restart those
that passed while it was down.

(The reaper's logic over the fake engine: tests/unit/test_lifetimes.py.)
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from boxd import errors
from boxd.models import MachineState
from tests._support.machines import _gvisor_status

from ..conftest import Daemon

pytestmark = pytest.mark.vm


@pytest.fixture
def gvisor(client: Any) -> Iterator[list[str]]:
    """Skips where runsc cannot run sandboxes; deletes what the test made and left."""
    status, why = _gvisor_status(client)
    if status != "ok":
        pytest.skip(f"gvisor unavailable here: {why}")
    made: list[str] = []
    yield made
    for ref in made:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(ref)


def gone_after(client: Any, ref: str, limit: float) -> float:
    """Seconds (monotonic) at which ``ref`` was gone; fails after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            client.machines.get(ref)
        except errors.MachineNotFound:
            return time.monotonic()
        time.sleep(0.1)
    pytest.fail(f"{ref} still exists {limit:.0f}s later: {client.machines.get(ref)}")


def test_a_machine_with_timeout_3_is_deleted_after_about_3_s(
    client: Any, gvisor: list[str],
) -> None:
    t0, wall = time.monotonic(), time.time()
    m = client.machines.new("life-3", engine="gvisor", timeout=3)
    created = time.monotonic() - t0  # a loaded host may take longer than the lifetime
    gvisor.append(m.id)
    assert m.end_at is not None and m.on_timeout == "delete"
    assert m.end_at.timestamp() - wall == pytest.approx(3, abs=1)  # from the request
    with contextlib.suppress(errors.MachineNotFound):  # unless the boot took it all
        client.machines.wait_until_ready(m.id, timeout=30)
        assert client.machines.exec(m.id, "echo alive").stdout == "alive\n"
    ended = gone_after(client, m.id, 15) - t0
    assert ended >= 2.5, f"deleted {ended:.1f}s after the create, before its end"
    # at its end, or (a boot longer than its lifetime) as soon as the create returned
    assert ended <= max(3.0, created) + 3, f"deleted {ended:.1f}s after ({created:.1f}s)"
    assert m.id not in [x.id for x in client.machines.list()]


def test_on_timeout_hibernate_hibernates_and_the_machine_wakes(
    client: Any, gvisor: list[str],
) -> None:
    m = client.machines.new("life-hib", engine="gvisor", timeout=4, on_timeout="hibernate")
    gvisor.append(m.id)
    client.machines.wait_until_ready(m.id, timeout=30)
    client.machines.exec(m.id, "echo kept > /root/kept")
    deadline = time.monotonic() + 60
    while (now := client.machines.get(m.id)).state != MachineState.HIBERNATED:
        assert time.monotonic() < deadline, f"not hibernated: {now.state}"
        assert now.state not in (MachineState.FAILED, MachineState.LOST), now
        time.sleep(0.2)
    assert now.end_at is None and now.on_timeout is None  # its lifetime is over
    # any request wakes it, with its files
    assert client.machines.exec(m.id, "cat /root/kept").stdout == "kept\n"
    assert client.machines.get(m.id).state == MachineState.RUNNING


def test_set_timeout_extends_and_shortens(client: Any, gvisor: list[str]) -> None:
    m = client.machines.new("life-ext", engine="gvisor", timeout=3)
    gvisor.append(m.id)
    extended = client.machines.set_timeout(m.id, 120)  # before its first end
    assert extended.end_at is not None and extended.end_at > m.end_at
    time.sleep(5)  # past the first end
    assert client.machines.get(m.id).state != MachineState.DELETING
    client.machines.wait_until_ready(m.id, timeout=30)
    assert client.machines.exec(m.id, "echo still").stdout == "still\n"
    t = time.monotonic()
    client.machines.set_timeout(m.id, 2)  # shorten: the reaper wakes for it
    ended = gone_after(client, m.id, 15) - t
    assert 1.5 <= ended <= 8, ended


def test_a_sigkilled_daemon_keeps_every_deadline(
    daemon: Daemon, client: Any, gvisor: list[str],
) -> None:
    keep = client.machines.new("life-keep", engine="gvisor", timeout=600,
                               on_timeout="hibernate")
    soon = client.machines.new("life-soon", engine="gvisor", timeout=4)
    gvisor.extend([keep.id, soon.id])
    client.machines.wait_until_ready(keep.id, timeout=30)
    daemon.stop(signal.SIGKILL)
    time.sleep(max(0.0, soon.end_at.timestamp() - time.time()) + 1)  # ends while down
    daemon.restart()
    gone_after(client, soon.id, 10)  # ended at restart
    kept = client.machines.get(keep.id)
    assert kept.end_at == keep.end_at and kept.on_timeout == "hibernate"
    assert kept.state == MachineState.RUNNING
    assert client.machines.exec(keep.id, "echo up").stdout == "up\n"
    client.machines.set_timeout(keep.id, 1, on_timeout="delete")
    gone_after(client, keep.id, 10)
