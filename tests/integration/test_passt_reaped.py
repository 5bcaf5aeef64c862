"""A deleted QEMU machine leaves no passt behind (issue 39, item 8).

Each QEMU machine with a network has its own passt, a child of the daemon that quits
when QEMU closes its end of their socket. It stayed a zombie of the daemon until the
next launch; now the daemon reaps it when the machine's QEMU ends. The unit test
(tests/unit/test_passt_forward.py) drives the same path with a stand-in QEMU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]


def _passt_children(pid: int) -> dict[int, str]:
    """The daemon's passt children and their states (``Z``: exited, not reaped)."""
    found: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                stat = Path(f"/proc/{child}/stat").read_text()
            except OSError:
                continue
            comm, rest = stat.split("(", 1)[1].rsplit(")", 1)
            if comm.startswith("passt"):
                found[int(child)] = rest.split()[0]
    return found


def test_a_deleted_qemu_machine_leaves_no_passt_zombie(daemon, client) -> None:  # type: ignore[no-untyped-def]
    pid = daemon.server_pid()
    assert pid is not None
    m = client.machines.new("passt-reap", engine="qemu")
    try:
        client.machines.wait_until_ready(m.id, timeout=300)
        assert _passt_children(pid), "the machine's passt is not a child of the daemon"
    finally:
        client.machines.delete(m.id)
    zombies = {p: s for p, s in _passt_children(pid).items() if s == "Z"}
    assert not zombies, f"passt left a zombie of the daemon: {zombies}"
