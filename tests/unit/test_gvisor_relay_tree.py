"""Which relay a gVisor sandbox gets: boxd-init when init.c compiles, agent.py otherwise."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from boxd.engine.gvisor._spec import Roots, build
from boxd.images import RELAY_ENV, agent_tree, native_relay


def test_a_compiled_tree_runs_boxd_init_as_pid_1(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RELAY_ENV, raising=False)
    tree = agent_tree(tmp_path)
    assert native_relay(tree) and os.access(tree / "boxd-init", os.X_OK)
    args = build("m1", Roots(tmp_path / "root", tree), 512)["process"]["args"]
    assert args[:5] == ["/opt/boxd/boxd-init", "--stdio", "--host-clock", "--memory-mib",
                        "512"]  # the guest's OOM killer at the machine's memory
    assert args[-2:] == ["--", "--host-clock"]
    # The binary is the init.c front end, static (no host C library in the sandbox).
    out = subprocess.run(["file", str(tree / "boxd-init")], capture_output=True, text=True)
    if out.returncode == 0:
        assert "statically linked" in out.stdout


def test_without_a_c_compiler_agent_py_is_pid_1(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(RELAY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no cc, no gcc
    tree = agent_tree(tmp_path)
    assert tree.name.endswith("-py") and not native_relay(tree)
    assert "relay=python" in caplog.text and "C compiler" in caplog.text
    args = build("m1", Roots(tmp_path / "root", tree), 512)["process"]["args"]
    assert args == ["/usr/bin/python3", "-u", "/opt/boxd/agent.py", "--stdio", "--host-clock"]


def test_the_python_relay_can_be_asked_for(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RELAY_ENV, "python")
    py = agent_tree(tmp_path)
    monkeypatch.delenv(RELAY_ENV)
    native = agent_tree(tmp_path)
    assert not native_relay(py) and native_relay(native) and py != native
    assert py.name == native.name + "-py"
