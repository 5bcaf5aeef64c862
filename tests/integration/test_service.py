"""Issue 3 acceptance on a real daemon: the spec's code, threads, errors, restarts."""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from boxd import Boxd, errors

pytestmark = pytest.mark.vm


def cli(daemon, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run(
        [sys.executable, "-m", "boxd", *args], env={**daemon.env(), **(env or {})},
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )


def test_spec_prepare_commands_and_python_upload_exec_delete(daemon, client, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # "Prepare one warm baseline" (pip install is exercised against a local index in
    # test_network.py and with the real packages in test_rl.py; here a stdlib warm-up).
    warm = tmp_path / "warm_up.py"
    warm.write_text("import json\nopen('/run/warm', 'w').write('warm')\nprint('warmed')\n")
    assert cli(daemon, "machine", "new", "spec-base").returncode == 0
    try:
        up = cli(daemon, "machine", "files", "upload", "spec-base", str(warm),
                 "/home/boxd/warm_up.py")
        assert up.returncode == 0, up.stderr
        r = cli(daemon, "machine", "exec", "spec-base", "--", "python3 warm_up.py")
        assert r.returncode == 0 and r.stdout == "warmed\n", r.stderr

        # the spec's Python, verbatim apart from the file it reads
        rollout = tmp_path / "rollout.py"
        rollout.write_text("import sys\nprint('seed', sys.argv[-1])\n")
        boxd = Boxd()
        boxd.machines.files.upload(
            "spec-base", "/home/boxd/rollout.py", open(rollout).read()  # noqa: SIM115
        )
        fork = boxd.machines.fork("spec-base", "spec-rollout")
        boxd.machines.wait_until_ready(fork.id)
        result = boxd.machines.exec(
            fork.id, f"python3 /home/boxd/rollout.py --seed {7}"
        )
        boxd.machines.delete(fork.id)
        assert result.stdout.strip() == "seed 7"
        with pytest.raises(errors.MachineNotFound):
            boxd.machines.get(fork.id)
    finally:
        client.machines.delete("spec-base")


def test_eight_threads_share_one_client(client) -> None:  # type: ignore[no-untyped-def]
    def work(i: int) -> str:
        m = client.machines.new(f"thread-{i}")
        try:
            client.machines.wait_until_ready(m.id, timeout=600)
            return client.machines.exec(m.id, f"echo {i}").stdout.strip()
        finally:
            client.machines.delete(m.id)

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(work, range(8))) == [str(i) for i in range(8)]


def test_typed_errors_in_sdk_and_one_line_in_cli(daemon, client, base) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.MachineNotFound):
        client.machines.get("no-such-machine")
    with pytest.raises(errors.AlreadyExists):
        client.machines.fork(base.id, base.name)
    with pytest.raises(errors.InvalidRequest):
        client.machines.new("Not_A_Valid_Name")
    for args in (["machine", "info", "no-such-machine"],
                 ["machine", "fork", base.name, base.name],
                 ["machine", "new", "Not_A_Valid_Name"]):
        r = cli(daemon, *args)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert "Traceback" not in r.stderr


def test_keys_and_accounts(daemon, client, base) -> None:  # type: ignore[no-untyped-def]
    url_env = {"BOXD_API_KEY": "boxd_wrong_key_000000000000000000000"}
    with Boxd(api_key="boxd_wrong_key_000000000000000000000") as bad, pytest.raises(
        errors.AuthError
    ):
        bad.machines.list()
    r = cli(daemon, "machine", "list", env=url_env)
    assert r.returncode != 0 and r.stderr.startswith("error: ")

    other = client.keys.create("tenant-b", account="tenant-b")
    with Boxd(api_key=other.secret) as b:
        assert b.machines.list() == []
        # another account's machine is indistinguishable from a missing one
        with pytest.raises(errors.MachineNotFound):
            b.machines.get(base.id)
        with pytest.raises(errors.MachineNotFound):
            b.machines.exec(base.name, "true")
        b.keys.revoke(other.id)
        with pytest.raises(errors.AuthError):
            b.machines.list()
    own = client.keys.create("mine")
    client.keys.revoke(own.id)
    with Boxd(api_key=own.secret) as revoked, pytest.raises(errors.AuthError):
        revoked.machines.list()


def test_quota_is_enforced(daemon, client, base) -> None:  # type: ignore[no-untyped-def]
    # What counts is the account's own tally: hibernated machines do not count.
    used = client.accounts.get("local").machines
    client.accounts.update("local", max_machines=used)
    try:
        with pytest.raises(errors.QuotaExceeded) as info:
            client.machines.fork(base.id, "over-quota")
        assert info.value.limit == used
        assert "over-quota" not in [m.name for m in client.machines.list()]
    finally:
        client.accounts.update("local", max_machines=50)


def test_machines_survive_daemon_kill_and_restart(daemon, client, machine) -> None:  # type: ignore[no-untyped-def]
    client.machines.exec(machine.id, "echo kept > /root/kept")
    daemon.stop(signal.SIGKILL)
    daemon.restart()
    names = [m.name for m in client.machines.list()]
    assert machine.name in names
    assert client.machines.get(machine.id).state.value == "running"
    assert client.machines.exec(machine.id, "cat /root/kept").stdout == "kept\n"


def test_one_host_is_one_node(daemon, client, machine) -> None:  # type: ignore[no-untyped-def]
    # Without --ray the daemon is its own single node: no caps, placement unchanged.
    (node,) = client.nodes.list()
    assert node.id == "local" and node.health == "alive" and node.address == "127.0.0.1"
    assert node.machines == len(client.machines.list()) and node.memory_free_mib > 0
    assert client.machines.get(machine.id).node == "local"
    out = cli(daemon, "nodes", "list", "--json")
    assert out.returncode == 0, out.stderr
    assert '"local"' in out.stdout
    with pytest.raises(errors.NotFound) as bad:
        client.machines.new("placed", node="elsewhere")
    assert bad.value.details["field"] == "node"
