"""Issue 2 acceptance: exec, files, a killed VM, and error mapping on real machines.

Every test runs on a fork of the session's base machine (``machine``), so tests are
isolated from each other and cheap; none assert on timing (the host is shared).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from boxd import errors
from boxd.config import Paths
from boxd.storage import disks

pytestmark = pytest.mark.vm


# ------------------------------------------------------------------------------ exec


def test_exec_separates_stdout_and_stderr(client, machine) -> None:  # type: ignore[no-untyped-def]
    r = client.machines.exec(machine.id, "echo out; echo err >&2")
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"
    assert r.exit_code == 0
    assert r.signal is None and not r.timed_out


@pytest.mark.parametrize("code", [0, 3])
def test_exec_exit_codes(client, machine, code: int) -> None:  # type: ignore[no-untyped-def]
    r = client.machines.exec(machine.id, f"exit {code}")
    assert r.exit_code == code
    assert r.signal is None


def test_exec_argv_form(client, machine) -> None:  # type: ignore[no-untyped-def]
    r = client.machines.exec(machine.id, ["printf", "%s|", "a b", "$HOME"])
    assert r.stdout == "a b|$HOME|"  # no shell: no splitting, no expansion


def test_exec_killed_command_reports_signal(client, machine) -> None:  # type: ignore[no-untyped-def]
    r = client.machines.exec(machine.id, "echo before; kill -9 $$")
    assert r.stdout == "before\n"
    assert r.signal == 9
    assert r.exit_code == 128 + 9
    assert not r.timed_out


def test_exec_timeout_kills_the_guest_process(client, machine) -> None:  # type: ignore[no-untyped-def]
    marker = "boxd-timeout-marker"
    # `exec -a` names the sleeping process so `ps` can find it afterwards.
    cmd = f"echo started; exec -a {marker} sleep 300"
    with pytest.raises(errors.ExecTimeout) as info:
        client.machines.exec(machine.id, ["bash", "-c", cmd], timeout=3)
    err = info.value
    assert "timed out" in err.message and "killed" in err.message
    assert err.details.get("timeout") == 3
    assert "started" in (err.details.get("stdout") or "")
    # The command is gone from the guest (allow the kill a moment to land).
    deadline = time.monotonic() + 60
    while True:
        ps = client.machines.exec(machine.id, "ps -eo args")
        if marker not in ps.stdout:
            break
        assert time.monotonic() < deadline, f"process still running:\n{ps.stdout}"
        time.sleep(1)
    # ... and the machine still works.
    assert client.machines.exec(machine.id, "echo ok").stdout == "ok\n"


def test_exec_10mb_stdout_arrives_intact(client, machine) -> None:  # type: ignore[no-untyped-def]
    r = client.machines.exec(
        machine.id,
        "head -c 10000000 /dev/urandom | base64 -w0 | tee /tmp/x; sha256sum < /tmp/x >&2",
        timeout=600,
    )
    assert r.exit_code == 0, r.stderr
    guest_hash = r.stderr.split()[0]
    assert len(r.stdout) == 4 * ((10_000_000 + 2) // 3)
    assert hashlib.sha256(r.stdout.encode()).hexdigest() == guest_hash


def test_exec_stdin_env_cwd(client, machine) -> None:  # type: ignore[no-untyped-def]
    r = client.machines.exec(
        machine.id, 'cat; echo "[$GREETING]"; pwd',
        stdin="line one\nline two\n", env={"GREETING": "hello world"}, cwd="/tmp",
    )
    assert r.stdout == "line one\nline two\n[hello world]\n/tmp\n"
    assert r.exit_code == 0


def test_exec_stream_yields_chunks_before_exit(client, machine) -> None:  # type: ignore[no-untyped-def]
    events = list(client.machines.exec_stream(
        machine.id, "echo one; sleep 1; echo two >&2; sleep 1; echo three; exit 4",
    ))
    kinds = [e.type for e in events]
    assert kinds[-1] == "exit"
    assert events[-1].exit_code == 4
    assert "exit" not in kinds[:-1]
    out = "".join(e.data or "" for e in events if e.type == "stdout")
    err = "".join(e.data or "" for e in events if e.type == "stderr")
    assert out == "one\nthree\n"
    assert err == "two\n"
    # Output separated by sleeps arrives as separate events, in order.
    data_events = [(e.type, e.data) for e in events if e.type in ("stdout", "stderr")]
    assert len(data_events) >= 3
    assert data_events[0] == ("stdout", "one\n")


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("size", [0, 1, 50 * 1024 * 1024], ids=["0B", "1B", "50MB"])
def test_files_round_trip(client, machine, size: int) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(size)
    digest = hashlib.sha256(data).hexdigest()
    path = f"/root/upload/sub/f{size}.bin"  # parents are created
    info = client.machines.files.upload(machine.id, path, data, mode=0o600)
    assert info.size == size
    assert info.sha256 == digest
    # The guest sees the same bytes and mode.
    r = client.machines.exec(machine.id, f"sha256sum {path}; stat -c %a {path}", timeout=300)
    assert r.stdout.split() == [digest, path, "600"]
    # Guest → host: a file written in the guest comes back intact.
    assert client.machines.files.download(machine.id, path) == data
    gen = f"/tmp/gen{size}.bin"
    r = client.machines.exec(
        machine.id, f"head -c {size} /dev/urandom > {gen}; sha256sum {gen}", timeout=300
    )
    guest_digest = r.stdout.split()[0]
    back = client.machines.files.download(machine.id, gen)
    assert len(back) == size
    assert hashlib.sha256(back).hexdigest() == guest_digest


def test_download_missing_path(client, machine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.GuestFileNotFound) as info:
        client.machines.files.download(machine.id, "/no/such/file")
    assert "/no/such/file" in str(info.value)


# ----------------------------------------------------------------- a SIGKILLed VM


def _qemu_pid(machine_id: str) -> int:
    out = subprocess.run(
        ["pgrep", "-f", f"boxd-{machine_id},"], capture_output=True, text=True
    ).stdout.split()
    assert len(out) == 1, f"expected one QEMU process for {machine_id}, got {out}"
    return int(out[0])


def _vm_id(daemon, machine_id: str) -> str:  # type: ignore[no-untyped-def]
    """The engine's id of a machine's VM (a claimed standby child keeps its own)."""
    with sqlite3.connect(Paths(daemon.home.resolve()).db) as db:
        (vm_id,) = db.execute("SELECT vm_id FROM machines WHERE id=?", (machine_id,)).fetchone()
    return str(vm_id)


def _layer_file(daemon, machine_id: str) -> Path:  # type: ignore[no-untyped-def]
    paths = Paths(daemon.home.resolve())
    with sqlite3.connect(paths.db) as db:
        (layer_id,) = db.execute(
            "SELECT layer_id FROM machines WHERE id=?", (machine_id,)
        ).fetchone()
    return disks.layer_path(paths.disks, layer_id)


def test_sigkilled_machine_is_failed_and_deletable(client, daemon, machine) -> None:  # type: ignore[no-untyped-def]
    paths = Paths(daemon.home.resolve())
    vm_id = _vm_id(daemon, machine.id)
    run_dir = paths.run_dir(vm_id)
    layer = _layer_file(daemon, machine.id)
    assert run_dir.is_dir() and layer.exists()
    assert client.machines.exec(machine.id, "true").exit_code == 0

    pid = _qemu_pid(vm_id)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and "Z" not in _proc_state(pid):
        assert time.monotonic() < deadline
        time.sleep(0.1)

    with pytest.raises(errors.MachineFailed) as info:
        client.machines.exec(machine.id, "true")
    msg = str(info.value)
    assert machine.name in msg and "SIGKILL" in msg, msg

    got = client.machines.get(machine.id)
    assert got.state.value == "failed"
    assert got.error and "SIGKILL" in got.error

    # Still failed (not re-diagnosed into something vaguer) on a later call.
    with pytest.raises(errors.MachineFailed):
        client.machines.files.download(machine.id, "/etc/hostname")

    client.machines.delete(machine.id)
    with pytest.raises(errors.MachineNotFound):
        client.machines.get(machine.id)
    assert not run_dir.exists()
    assert not layer.exists()
    assert not Path(f"{layer}.tmp").exists()


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ---------------------------------------------------------------------------- errors


def test_unknown_machine(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.MachineNotFound) as info:
        client.machines.get("no-such-machine")
    assert "no-such-machine" in str(info.value)
    with pytest.raises(errors.MachineNotFound):
        client.machines.exec("no-such-machine", "true")


@pytest.mark.parametrize("name", ["Bad_Name", "-leading", "x" * 64, "with space", ""])
def test_invalid_name(client, base, name: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.InvalidRequest):
        client.machines.fork(base.id, name)
    with pytest.raises(errors.InvalidRequest):
        client.machines.new(name)


def test_duplicate_name(client, base, machine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.AlreadyExists) as info:
        client.machines.fork(base.id, machine.name)
    assert machine.name in str(info.value)
    with pytest.raises(errors.AlreadyExists):
        client.machines.new(base.name)


def test_request_on_deleted_machine(client, base) -> None:  # type: ignore[no-untyped-def]
    m = client.machines.fork(base.id)
    client.machines.delete(m.id)
    with pytest.raises(errors.MachineNotFound):
        client.machines.exec(m.id, "true")
    with pytest.raises(errors.MachineNotFound):
        client.machines.get(m.name)
    with pytest.raises(errors.MachineNotFound):
        client.machines.delete(m.id)
    assert m.id not in {x.id for x in client.machines.list()}
