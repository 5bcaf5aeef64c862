"""Snapshots: durable, versioned, integrity-checked, portable between data directories."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from boxd import Boxd, errors
from boxd.errors import AlreadyExists, IntegrityError, SnapshotNotFound
from tests._support.daemon import kill_machines_of, start_daemon
from tests._support.guest import bump_counter, read_counter, start_counter

pytestmark = pytest.mark.vm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_snapshot_outlives_machine_and_daemon(daemon, client, machine_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = machine_factory("snap-src")
    client.machines.files.upload(src.id, "/root/baseline.txt", "env-v3 contents")
    start_counter(client, src.id)
    bump_counter(client, src.id, 4)

    snap = client.snapshots.save(src.id, "env-v3")
    assert snap.version == 1 and snap.digest.startswith("sha256:")
    with pytest.raises(AlreadyExists):
        client.snapshots.save(src.id, "env-v3")
    client.machines.delete(src.id)

    daemon.restart()

    a = client.machines.new("from-snap-a", from_snapshot="env-v3")
    b = client.machines.new("from-snap-b", from_snapshot=f"env-v3@{snap.version}")
    try:
        for m in (a, b):
            assert m.snapshot == snap.digest.removeprefix("sha256:")
            assert client.machines.files.download(m.id, "/root/baseline.txt") == b"env-v3 contents"
            assert read_counter(client, m.id) == 4
            assert client.machines.exec(m.id, "hostname").stdout.strip() == m.name
        # they diverge independently
        bump_counter(client, a.id, 2)
        client.machines.files.upload(a.id, "/root/baseline.txt", "changed in a")
        assert read_counter(client, a.id) == 6
        assert read_counter(client, b.id) == 4
        assert client.machines.files.download(b.id, "/root/baseline.txt") == b"env-v3 contents"

        # export, then import into a second data directory served by another daemon
        out = tmp_path / "env-v3.boxd"
        client.snapshots.export("env-v3", out)
        assert out.stat().st_size > 0
        home2 = tmp_path / "home2"
        port = _free_port()
        other = start_daemon(home2, "--listen", f"127.0.0.1:{port}")
        try:
            key = (home2 / "local.key").read_text().strip()
            with Boxd(api_key=key, base_url=f"http://127.0.0.1:{port}") as c2:
                imported = c2.snapshots.import_(out)
                assert imported.digest == snap.digest
                m2 = c2.machines.new("imported", from_snapshot="env-v3")
                assert c2.machines.files.download(m2.id, "/root/baseline.txt") == (
                    b"env-v3 contents"
                )
                assert read_counter(c2, m2.id) == 4
                c2.machines.delete(m2.id)
        finally:
            other.stop()
            kill_machines_of(home2)
    finally:
        client.machines.delete(a.id)
        client.machines.delete(b.id)
    client.snapshots.delete("env-v3")
    with pytest.raises(SnapshotNotFound):
        client.snapshots.get("env-v3")


def test_versions_and_references(client, machine) -> None:  # type: ignore[no-untyped-def]
    v1 = client.snapshots.save(machine.id, "versioned")
    client.machines.files.upload(machine.id, "/root/v", "2")
    v2 = client.snapshots.save(machine.id, "versioned", new_version=True)
    assert (v1.version, v2.version) == (1, 2)
    assert v1.digest != v2.digest
    assert client.snapshots.get("versioned").digest == v2.digest
    assert client.snapshots.get("versioned@1").digest == v1.digest
    assert client.snapshots.get(v1.digest).version == 1
    with pytest.raises(SnapshotNotFound):
        client.snapshots.get("versioned@3")
    client.snapshots.delete("versioned@1")
    client.snapshots.delete("versioned")
    assert [s.name for s in client.snapshots.list()].count("versioned") == 0


def test_flipped_byte_is_detected(daemon, client, machine) -> None:  # type: ignore[no-untyped-def]
    snap = client.snapshots.save(machine.id, "corrupt-me")
    store = Path(daemon.home) / "snapshots"
    digest = snap.digest.removeprefix("sha256:")
    manifest = json.loads((store / "manifests" / f"{digest}.json").read_text())
    # flip one byte in the middle of this snapshot's device-state blob
    victim = store / "blobs" / "sha256" / manifest["blobs"]["state"]["digest"]
    os.chmod(victim, 0o644)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as info:
        client.machines.new("never-boots", from_snapshot="corrupt-me")
    assert "corrupt-me" not in [m.name for m in client.machines.list()]
    assert "never-boots" not in [m.name for m in client.machines.list()]
    assert info.value.message
    client.snapshots.delete(snap.digest)


def test_spec_cli_commands_verbatim(daemon, client, machine_factory) -> None:  # type: ignore[no-untyped-def]
    machine_factory("rl-base")
    env = daemon.env()
    for args in (["snapshots", "save", "rl-base", "env-v3"],
                 ["machine", "new", "rl-base-2", "--from-snapshot", "env-v3"]):
        proc = subprocess.run([sys.executable, "-m", "boxd", *args], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    assert client.machines.exec("rl-base-2", "hostname").stdout.strip() == "rl-base-2"
    client.machines.delete("rl-base-2")
    client.snapshots.delete("env-v3")


def test_interrupted_save_leaves_nothing_after_restart(daemon, client, machine) -> None:  # type: ignore[no-untyped-def]
    import signal
    import threading
    import time

    store = Path(daemon.home) / "snapshots"
    blobs_before = set((store / "blobs" / "sha256").iterdir())
    snapshots_before = [s.digest for s in client.snapshots.list()]
    client.machines.exec(machine.id, "head -c 50000000 /dev/urandom > /root/big")

    outcome: list[object] = []

    def save() -> None:
        with Boxd() as c:
            try:
                outcome.append(c.snapshots.save(machine.id, "interrupted"))
            except Exception as exc:  # the daemon died under it: what the test wants
                outcome.append(exc)

    staged_before = set((store / "staging").iterdir())
    saver = threading.Thread(target=save)
    saver.start()
    # kill the daemon while the save is under way (its own staging has begun: an entry
    # left by an earlier test must not end the wait before the save was even sent, or
    # the client starts a daemon and sends it again, and the save completes)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
        p.name.startswith("save-") for p in set((store / "staging").iterdir()) - staged_before
    ):  # the save's own work folder (`NodeRuntime.save_snapshot`): the request is in
        time.sleep(0.01)
    assert daemon.server_pid() == daemon.proc.pid  # the kill hits the daemon that saves
    daemon.stop(signal.SIGKILL)
    saver.join(120)
    # the save was cut off, not finished before the kill came
    assert outcome and isinstance(outcome[0], errors.BoxdError), outcome
    daemon.restart()

    assert [s.digest for s in client.snapshots.list()] == snapshots_before
    assert "interrupted" not in [s.name for s in client.snapshots.list()]
    assert list((store / "staging").iterdir()) == []
    assert set((store / "blobs" / "sha256").iterdir()) == blobs_before
    # the machine was paused mid-capture; after the restart it runs again
    assert client.machines.exec(machine.id, "echo alive", timeout=60).stdout == "alive\n"
