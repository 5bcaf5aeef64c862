"""The first acceptance item: a fresh run boots a machine and runs Python in it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vm


def test_boot_and_exec_python(client, base) -> None:  # type: ignore[no-untyped-def]
    result = client.machines.exec(base.id, 'python3 -c "print(1+1)"')
    assert result.stdout == "2\n"
    assert result.exit_code == 0


def test_fork_runs_python_with_own_identity(client, base, machine) -> None:  # type: ignore[no-untyped-def]
    child = client.machines.exec(machine.id, "hostname; cat /etc/machine-id")
    parent = client.machines.exec(base.id, "hostname; cat /etc/machine-id")
    c_host, c_id = child.stdout.split()
    p_host, p_id = parent.stdout.split()
    assert c_host == machine.name and p_host == base.name
    assert c_id != p_id and len(c_id) == 32


def test_qemu_drops_to_an_unprivileged_user(daemon, base) -> None:  # type: ignore[no-untyped-def]
    import os
    import pwd
    import subprocess
    from pathlib import Path

    pids = subprocess.run(
        ["pgrep", "-f", f"boxd-{base.id},"], capture_output=True, text=True
    ).stdout.split()
    assert len(pids) == 1
    status = Path(f"/proc/{pids[0]}/status").read_text()
    uid = int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])
    if os.geteuid() == 0:
        # the daemon runs as root here: QEMU must not (scripts/setup-host.sh adds the user)
        assert uid == pwd.getpwnam("boxd-qemu").pw_uid
    else:
        assert uid == os.geteuid()
