"""The ``boxd`` CLI through click's CliRunner, against a real daemon over fake services."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from tests._support import sdk_daemon as support

from boxd.api.server import Daemon
from boxd.cli import main

daemon = support.daemon  # fixtures
paths = support.paths


def run(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def test_unknown_machine_is_one_line_and_exit_1(daemon: Daemon) -> None:
    r = run("machine", "info", "nope")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nope" in lines[0]
    assert "Traceback" not in r.output


def test_usage_error_exits_2(daemon: Daemon) -> None:
    assert run("machine", "new").exit_code == 2


def test_new_list_info_fork_delete(daemon: Daemon) -> None:
    r = run("machine", "new", "rl-base")
    assert r.exit_code == 0, r.output
    assert "rl-base" in r.stdout
    assert run("machine", "fork", "rl-base", "rollout-1").exit_code == 0
    r = run("machine", "list", "--json")
    names = [m["name"] for m in json.loads(r.stdout)]
    assert names == ["rl-base", "rollout-1"]
    assert "rl-base" in run("machine", "list").stdout
    r = run("machine", "info", "rollout-1", "--json")
    assert json.loads(r.stdout)["parent_id"] is not None
    r = run("machine", "delete", "rollout-1", "ghost")
    assert r.exit_code == 1 and "deleted rollout-1" in r.stdout and "ghost" in r.stderr


def test_exec_streams_and_propagates_exit_code(daemon: Daemon) -> None:
    run("machine", "new", "a")
    r = run("machine", "exec", "a", "--", "exit 3")
    assert r.exit_code == 3
    assert r.stdout == "out\n" and r.stderr == "err\n"
    r = run("machine", "exec", "a", "--", "pip install gymnasium numpy")
    assert r.exit_code == 0 and "pip install gymnasium numpy 0" in r.stdout
    r = run("machine", "exec", "a", "--", "exit", "0")  # argv form
    assert r.exit_code == 0
    r = run("machine", "exec", "a", "--timeout", "1", "--", "hang")
    assert r.exit_code == 124 and "timed out" in r.stderr


def test_exec_whose_machine_dies_exits_125_not_a_command_status(daemon: Daemon) -> None:
    run("machine", "new", "a")
    r = run("machine", "exec", "a", "--", "die")  # the fake's VM dies after three lines
    assert r.exit_code == 125, r.output
    assert r.stdout == "die 0\ndie 1\ndie 2\n" and "error: the VM died" in r.stderr


def test_checkpoint_restore_asks_without_yes(daemon: Daemon) -> None:
    run("machine", "new", "rollout-1")
    assert run("machine", "checkpoint", "save", "rollout-1", "episode-start").exit_code == 0
    r = run("machine", "checkpoint", "restore", "rollout-1", "episode-start", input="n\n")
    assert r.exit_code == 1 and "Rewind rollout-1" in r.output
    assert "restored" not in r.output
    r = run("machine", "checkpoint", "restore", "rollout-1", "episode-start", input="y\n")
    assert r.exit_code == 0 and "restored" in r.stdout
    r = run("machine", "checkpoint", "restore", "rollout-1", "episode-start", "-y")
    assert r.exit_code == 0
    r = run("machine", "checkpoint", "list", "rollout-1", "--json")
    assert [c["name"] for c in json.loads(r.stdout)] == ["episode-start"]
    assert run("machine", "checkpoint", "delete", "rollout-1", "episode-start").exit_code == 0


def test_files_snapshots_keys_info(daemon: Daemon, tmp_path: Path) -> None:
    run("machine", "new", "rl-base")
    src = tmp_path / "rollout.py"
    src.write_text("print(1)\n")
    assert run("machine", "files", "upload", "rl-base", str(src), "/home/boxd/r.py").exit_code == 0
    dst = tmp_path / "back.py"
    r = run("machine", "files", "download", "rl-base", "/home/boxd/r.py", str(dst))
    assert r.exit_code == 0 and dst.read_text() == "print(1)\n"
    assert run("snapshots", "save", "rl-base", "env-v3").exit_code == 0
    r = run("machine", "new", "rl-base-2", "--from-snapshot", "env-v3")
    assert r.exit_code == 0, r.output
    r = run("snapshots", "list", "--json")
    assert [s["name"] for s in json.loads(r.stdout)] == ["env-v3"]
    assert "env-v3" in run("snapshots", "info", "env-v3").stdout
    out = tmp_path / "env.boxd"
    assert run("snapshots", "export", "env-v3", "-o", str(out)).exit_code == 0
    assert out.exists()
    assert run("snapshots", "import", str(out)).exit_code == 0
    r = run("keys", "create", "ci")
    assert r.exit_code == 0 and r.stdout.strip()
    assert len(json.loads(run("keys", "list", "--json").stdout)) >= 2
    r = run("info", "--json")
    assert r.exit_code == 0 and "accelerator" in json.loads(r.stdout)
    assert "accelerator" in run("info").stdout


def test_bad_url_is_one_clear_line(paths: object) -> None:
    r = run("--url", "http://127.0.0.1:9", "machine", "list")
    assert r.exit_code == 1
    assert r.stderr.startswith("error: cannot reach boxd") and r.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "args",
    [[], ["machine"], ["machine", "exec"], ["machine", "checkpoint"], ["snapshots"], ["image"]],
)
def test_help_texts(args: list[str]) -> None:
    r = run(*args, "--help")
    assert r.exit_code == 0 and "Usage:" in r.stdout
