"""A cluster node's reaper (boxd.node.cluster): what a node leaves when its actor dies.

Real processes stand in for a node's machines: one whose command line names the
node's tmpfs folder (as a QEMU process or a gVisor sandbox does), and a gVisor
machine's network namespace, pasta and its holder, whose command lines name nothing
of the node's (its ``net.json`` records them). Closing the reaper's pipe is the actor
dying.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boxd.config import Paths
from boxd.node.cluster import _start_reaper


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def test_the_reaper_ends_the_nodes_vms_and_their_namespaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BOXD_SHM", str(tmp_path / "shm"))
    paths = Paths(tmp_path / "home")
    run_dir = paths.run_dir("m_gv")
    run_dir.mkdir(parents=True)
    pasta = tmp_path / "bin" / "pasta"  # argv0 ends in "pasta", as the real one's does
    pasta.parent.mkdir()
    pasta.symlink_to("/bin/sleep")
    vm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                           f"{paths.shm}/machines/m_q/disk"])
    holder = subprocess.Popen(["/bin/sleep", "301"])
    net = subprocess.Popen([str(pasta), "302"])
    other = subprocess.Popen(["/bin/sleep", "303"])  # not the node's: left alone
    procs = (vm, holder, net, other)
    try:
        (run_dir / "net.json").write_text(json.dumps({"pasta": net.pid, "holder": holder.pid}))
        reaper = _start_reaper(paths)
        time.sleep(0.3)
        assert all(_alive(p) for p in procs)  # the node lives
        assert reaper.stdin is not None
        reaper.stdin.close()  # the actor died
        reaper.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in (vm, holder, net)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(vm) and not _alive(holder) and not _alive(net)
        assert _alive(other)
    finally:
        for p in procs:
            if _alive(p):
                p.kill()
            p.wait()
