"""A VM's forward port: passt must hold it, or the launch fails with a clear error.

Real passt processes on loopback ports (no guest: passt forwards nothing until QEMU
connects, and it quits when its socket's other end closes).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd.engine.base import MachineConfig
from boxd.engine.qemu import AccelChoice, _argv, _net
from boxd.engine.qemu._engine import NetSetup, QemuEngine
from boxd.errors import MachineFailed
from boxd.node._ports import free_port
from boxd.storage.fds import OwnedFd

pytestmark = pytest.mark.skipif(
    shutil.which("passt") is None,
    reason="passt is not installed (scripts/setup-host.sh installs it; the integration "
           "network tests cover the same path through real machines)",
)


@pytest.fixture
def passt(tmp_path: Path) -> Iterator[list[object]]:
    started: list[object] = []
    yield started
    for item in started:
        if isinstance(item, OwnedFd):
            item.close()
        else:
            item.kill()  # type: ignore[attr-defined]
            item.wait()  # type: ignore[attr-defined]


def _spawn(port: int, log: Path, started: list[object]):  # type: ignore[no-untyped-def]
    popen, fd = _net.spawn_passt(shutil.which("passt") or "passt", port=port, user=None,
                                 log_file=log)
    started += [popen, fd]
    return popen


def test_the_forward_is_ready_once_passt_itself_listens(tmp_path: Path, passt) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    popen = _spawn(port, tmp_path / "passt.log", passt)
    asyncio.run(_net.wait_forward(popen, port, tmp_path / "passt.log", "m_test"))
    assert _net._holds(popen.pid, _net._listeners(port))


def test_a_forward_port_taken_by_another_process_fails_the_launch(tmp_path: Path, passt) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    with socket.socket() as other:  # someone else listens there before passt starts
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        popen = _spawn(port, tmp_path / "passt.log", passt)
        with pytest.raises(MachineFailed) as info:
            asyncio.run(_net.wait_forward(popen, port, tmp_path / "passt.log", "m_test"))
    # not mistaken for passt's: the message says what happened and names the port
    assert "network did not start" in info.value.message
    assert str(port) in (info.value.hint or "") and info.value.machine == "m_test"


def test_passt_starts_in_a_machine_folder_that_does_not_exist_yet(tmp_path: Path, passt) -> None:  # type: ignore[no-untyped-def]
    # passt opens its log first thing: a new machine's folder (created by QEMU's start a
    # moment later) must exist before passt runs, or passt quits and the machine has no
    # network (its URL answered 502).
    port = free_port()
    log = tmp_path / "machines" / "m_new" / "passt.log"
    popen = _spawn(port, log, passt)
    asyncio.run(_net.wait_forward(popen, port, log, "m_new"))
    assert log.parent.stat().st_mode & 0o777 == 0o700
    assert (log.parent / "passt.log.stderr").stat().st_mode & 0o777 == 0o600  # private


def test_a_host_without_a_route_is_told_so(tmp_path: Path) -> None:
    # In a network namespace with only loopback, passt has no interface to use: the
    # launch fails saying so, not "try again".
    import subprocess
    import sys

    code = (
        "import asyncio, shutil, sys\n"
        "from pathlib import Path\n"
        "from boxd.engine.qemu import _net\n"
        "from boxd.errors import MachineFailed\n"
        f"log = Path({str(tmp_path / 'm' / 'passt.log')!r})\n"
        "p, fd = _net.spawn_passt(shutil.which('passt'), port=25000, user=None, log_file=log)\n"
        "try:\n"
        "    asyncio.run(_net.wait_forward(p, 25000, log, 'm_x'))\n"
        "except MachineFailed as e:\n"
        "    print(e.hint)\n"
    )
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60)
    if "unshare failed" in out.stderr or "Operation not permitted" in out.stderr:
        pytest.skip(f"cannot make a network namespace here: {out.stderr.strip()[:200]} "
                    "(the cluster tests run machines in one)")
    assert "no default route" in out.stdout, out.stdout + out.stderr


def _passt_state(pid: int) -> str | None:
    """passt's state letter (``Z``: exited, not reaped), or None once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_a_deleted_machines_passt_is_reaped_with_it(tmp_path: Path) -> None:
    # Through the engine's own launch: QEMU (a stand-in that holds passt's socket as QEMU
    # does, and ignores its options) and its passt. Killing the machine reaps passt too:
    # it stayed a zombie of the daemon until the next launch, when subprocess reaps the
    # children whose Popen objects were dropped.
    qemu = tmp_path / "qemu-stand-in"
    qemu.write_text("#!/bin/sh\nexec sleep 60\n")
    qemu.chmod(0o755)
    engine = QemuEngine(str(qemu), AccelChoice("tcg", "test"),
                        net=NetSetup(shutil.which("passt") or "passt", None, filtered=False))
    config = MachineConfig("m_reap", "m-reap", 1, 64, isolated=False, port=free_port(),
                           kernel=tmp_path / "k", initrd=tmp_path / "i", cmdline="")
    files = _argv.RunFiles(tmp_path / "run")
    proc, forward = engine._spawn(config, tmp_path / "disk.qcow2", files,
                                  _argv.Memory(files.mem, shared=True),
                                  tmp_path / "m" / "qemu.log", incoming=False)
    assert forward is not None
    passt_pid = forward.passt.pid
    try:
        asyncio.run(forward.wait())  # passt runs, its peer is the stand-in
        asyncio.run(proc.kill())
        assert _passt_state(passt_pid) is None, \
            "passt outlives its deleted machine (to end a zombie of the daemon)"
        assert forward.passt.returncode is not None
    finally:
        forward.passt.kill()
        forward.passt.wait()
