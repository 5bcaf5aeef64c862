"""Checkpoints rewind one machine in place: files, process memory, same id/name/port."""

from __future__ import annotations

import subprocess
import sys

import pytest

from boxd.errors import AlreadyExists, CheckpointNotFound
from tests._support.guest import bump_counter, read_counter, start_counter

pytestmark = pytest.mark.vm


def cli(daemon, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    proc = subprocess.run(
        [sys.executable, "-m", "boxd", *args], env=daemon.env(), capture_output=True,
        text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_restore_brings_back_file_and_process_state(client, machine) -> None:  # type: ignore[no-untyped-def]
    start_counter(client, machine.id)
    bump_counter(client, machine.id, 3)
    client.machines.files.upload(machine.id, "/root/state.txt", "before")
    before = client.machines.get(machine.id)

    client.machines.checkpoints.save(machine.id, "episode-start")
    bump_counter(client, machine.id, 5)
    client.machines.files.upload(machine.id, "/root/state.txt", "after")
    assert read_counter(client, machine.id) == 8

    restored = client.machines.checkpoints.restore(machine.id, "episode-start")
    assert (restored.id, restored.name, restored.port) == (before.id, before.name, before.port)
    assert client.machines.files.download(machine.id, "/root/state.txt") == b"before"
    assert read_counter(client, machine.id) == 3


def test_restore_ten_times_in_a_row(client, machine) -> None:  # type: ignore[no-untyped-def]
    client.machines.files.upload(machine.id, "/root/n", "0")
    client.machines.checkpoints.save(machine.id, "zero")
    for i in range(10):
        client.machines.exec(machine.id, f"echo {i + 1} > /root/n")
        client.machines.checkpoints.restore(machine.id, "zero")
        assert client.machines.files.download(machine.id, "/root/n") == b"0"
    assert [c.name for c in client.machines.checkpoints.list(machine.id)] == ["zero"]


def test_checkpoint_errors_and_delete(client, machine) -> None:  # type: ignore[no-untyped-def]
    client.machines.checkpoints.save(machine.id, "one")
    with pytest.raises(AlreadyExists):
        client.machines.checkpoints.save(machine.id, "one")
    with pytest.raises(CheckpointNotFound):
        client.machines.checkpoints.restore(machine.id, "missing")
    client.machines.checkpoints.delete(machine.id, "one")
    assert client.machines.checkpoints.list(machine.id) == []


def test_spec_cli_commands_verbatim(daemon, client, machine_factory) -> None:  # type: ignore[no-untyped-def]
    machine_factory("rollout-1")
    client.machines.exec("rollout-1", "echo start > /root/episode")
    cli(daemon, "machine", "checkpoint", "save", "rollout-1", "episode-start")
    client.machines.exec("rollout-1", "echo changed > /root/episode")
    # without -y the CLI asks first; no answer means no restore
    asked = cli(daemon, "machine", "checkpoint", "restore", "rollout-1", "episode-start",
                check=False)
    assert asked.returncode != 0
    assert client.machines.files.download("rollout-1", "/root/episode") == b"changed\n"
    cli(daemon, "machine", "checkpoint", "restore", "rollout-1", "episode-start", "-y")
    assert client.machines.files.download("rollout-1", "/root/episode") == b"start\n"
    listed = cli(daemon, "machine", "checkpoint", "list", "rollout-1")
    assert "episode-start" in listed.stdout


def test_checkpoints_die_with_their_machine(daemon, client, machine_factory) -> None:  # type: ignore[no-untyped-def]
    from boxd.config import Paths

    m = machine_factory()
    ck = client.machines.checkpoints.save(m.id, "gone-soon")
    paths = Paths(daemon.home.resolve())
    assert (paths.checkpoints / ck.id).exists()
    client.machines.delete(m.id)
    assert not (paths.checkpoints / ck.id).exists()


def _chain_length(daemon, machine_id: str) -> int:  # type: ignore[no-untyped-def]
    import sqlite3

    db = sqlite3.connect(daemon.home / "state.db")
    try:
        (layer,) = db.execute(
            "SELECT layer_id FROM machines WHERE id=?", (machine_id,)
        ).fetchone()
        n = 0
        while layer is not None:
            n += 1
            (layer,) = db.execute(
                "SELECT parent_id FROM layers WHERE id=?", (layer,)
            ).fetchone()
        return n
    finally:
        db.close()


def _collapse(daemon, client, machine_id: str) -> None:  # type: ignore[no-untyped-def]
    """Checkpoints past `MAX_CHAIN`, each after a write, until the chain collapses."""
    import time

    from boxd.node.runtime import MAX_CHAIN

    start = _chain_length(daemon, machine_id)
    for i in range(MAX_CHAIN + 2):
        client.machines.exec(machine_id, f"echo {i} > /root/layer-{i}")
        client.machines.checkpoints.save(machine_id, f"c{i}")
    # without collapsing, every save would have added one layer to the chain
    uncollapsed = start + MAX_CHAIN + 2
    deadline = time.monotonic() + 300
    while _chain_length(daemon, machine_id) > MAX_CHAIN and time.monotonic() < deadline:
        time.sleep(1)
    n = _chain_length(daemon, machine_id)
    assert n <= MAX_CHAIN < uncollapsed, f"chain is {n} long"


def test_long_backing_chains_collapse(daemon, client, machine) -> None:  # type: ignore[no-untyped-def]
    from boxd.node.runtime import MAX_CHAIN

    _collapse(daemon, client, machine.id)
    # the data written into every layer is still there, and old checkpoints still restore
    out = client.machines.exec(machine.id, "cat /root/layer-*").stdout.split()
    assert sorted(out, key=int) == [str(i) for i in range(MAX_CHAIN + 2)]
    client.machines.checkpoints.restore(machine.id, "c0")
    assert client.machines.exec(machine.id, "ls /root").stdout.split().count("layer-0") == 1
    assert "layer-1" not in client.machines.exec(machine.id, "ls /root").stdout


def test_a_gvisor_machine_snapshots_and_forks_after_its_chain_collapsed(  # type: ignore[no-untyped-def]
        daemon, client, gvisor_base) -> None:
    """gVisor's collapse wrote the active layer as a "layer" on the guest root's image:
    after it, a snapshot of the machine failed (`layer_base` read the raw image as a
    layer: 503 machine_failed), and so did a cross-node fork."""
    from boxd.node.runtime import MAX_CHAIN

    m = client.machines.fork(gvisor_base.id, "g-collapse")
    try:
        _collapse(daemon, client, m.id)
        snap = client.snapshots.save(m.id, "g-collapsed")
        try:
            again = client.machines.new("g-collapsed-again", from_snapshot=snap.name)
            out = client.machines.exec(again.id, "cat /root/layer-*").stdout.split()
            assert sorted(out, key=int) == [str(i) for i in range(MAX_CHAIN + 2)]
            client.machines.delete(again.id)
        finally:
            client.snapshots.delete(snap.name)
        kid = client.machines.fork(m.id, "g-collapse-kid")
        assert client.machines.exec(kid.id, "cat /root/layer-0").stdout == "0\n"
        client.machines.delete(kid.id)
    finally:
        client.machines.delete(m.id)
