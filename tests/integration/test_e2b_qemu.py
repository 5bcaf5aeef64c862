"""The unmodified ``e2b`` SDK against a daemon whose engine is QEMU: the E2B front door
is the same on both engines (test_e2b.py covers every call on gVisor, the default
engine where KVM is missing; this module walks the main path on QEMU machines)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from tests._support.daemon import Daemon
from tests._support.e2b import e2b_daemon

e2b = pytest.importorskip("e2b", reason="the dev extra installs the e2b SDK")

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def e2b_env(daemon: Daemon) -> Iterator[dict[str, str]]:
    with e2b_daemon(daemon, "e2b-qemu", engine="qemu") as (_, exports):
        yield exports


def test_create_run_files_fork_and_kill_on_qemu(e2b_env: dict[str, str]) -> None:
    from boxd import Boxd

    sbx = e2b.Sandbox.create(timeout=900, envs={"GREETING": "qemu"})
    kids: list[object] = []
    try:
        with Boxd() as b:
            assert b.machines.get(sbx.sandbox_id).engine == "qemu"
        r = sbx.commands.run("echo $GREETING; pwd")
        assert r.stdout.split() == ["qemu", "/home/user"], r
        sbx.files.write("notes/a.txt", "from qemu")
        assert sbx.files.read("notes/a.txt") == "from qemu"
        # E2B's user, whose sudo works here (gVisor ignores setuid bits: docs/e2b.md)
        r = sbx.commands.run("whoami; sudo -n whoami; stat -c %U notes/a.txt")
        assert r.stdout.split() == ["user", "root", "user"], r
        sbx.commands.run("echo kept > /tmp/state")
        kids = list(sbx.fork(count=2))
        for kid in kids:
            assert kid.commands.run("cat /tmp/state").stdout == "kept\n"  # type: ignore[attr-defined]
            assert kid.files.read("notes/a.txt") == "from qemu"  # type: ignore[attr-defined]
        kids[0].commands.run("echo child > /tmp/state")  # type: ignore[attr-defined]
        assert sbx.commands.run("cat /tmp/state").stdout == "kept\n"  # the source ran on
        with pytest.raises(e2b.CommandExitException):
            sbx.commands.run("exit 3")
        # metrics from the guest kernel's own counters (/proc/stat works under QEMU)
        [m] = sbx.get_metrics()
        assert m.cpu_count >= 1 and 0 <= m.cpu_used_pct <= 100
        assert 0 < m.mem_used < m.mem_total and 0 < m.disk_used < m.disk_total
        # a signed URL from a plain client
        assert httpx.get(sbx.download_url("notes/a.txt")).content == b"from qemu"
    finally:
        for s in [*kids, sbx]:
            with contextlib.suppress(Exception):
                s.kill()  # type: ignore[attr-defined]
