"""Progress output of the CLI: bars and spinners on a terminal, nothing otherwise.

Against a real daemon over the fake services (``test_sdk_support``). Not a terminal:
click's CliRunner. A terminal: ``python -m boxd`` in a child process whose stdout and
stderr are a pseudo-terminal.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner, Result
from tests._support import sdk_daemon as support

from boxd.api.server import Daemon
from boxd.cli import main
from boxd.config import Paths

daemon = support.daemon  # fixtures
paths = support.paths

# What rich's bars and spinners leave behind: bytes, rates, elapsed times, braille frames.
MARKS = ("B/s", "kB", "bytes", "0:00:0", "exporting", "importing", "saving", "waiting for",
         "⠋", "━")


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_no_progress_when_not_a_terminal(daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "env.boxd"
    results = [
        run("machine", "new", "rl-base"),
        run("snapshots", "save", "rl-base", "env-v3"),
        run("snapshots", "export", "env-v3", "-o", str(out)),
        run("snapshots", "import", str(out)),
        run("snapshots", "import", str(out), "--json"),
        run("info"),
    ]
    for r in results:
        assert r.exit_code == 0, r.output
        assert not any(mark in r.stderr for mark in MARKS), r.stderr
    assert results[2].stdout.startswith("exported env-v3 -> ")


def on_a_terminal(paths: Paths, *args: str) -> tuple[int, str]:
    """Run ``boxd ARGS`` with a pseudo-terminal as stdout and stderr; its exit and output."""
    master, slave = pty.openpty()
    env = {**os.environ, "BOXD_HOME": str(paths.home), "COLUMNS": "120", "TERM": "xterm"}
    env.pop("BOXD_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "boxd", *args], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(30), b"".join(chunks).decode(errors="replace")


def test_progress_on_a_terminal(daemon: Daemon, paths: Paths, tmp_path: Path) -> None:
    assert run("machine", "new", "rl-base").exit_code == 0
    assert run("snapshots", "save", "rl-base", "env-v3").exit_code == 0
    out = tmp_path / "env.boxd"
    code, text = on_a_terminal(paths, "snapshots", "export", "env-v3", "-o", str(out))
    assert code == 0, text
    # bytes done/total (the fake's file is 60 kB; too quick for rich to show a rate)
    assert "exporting env-v3" in text and "60.0/60.0 kB" in text, text
    assert "exported env-v3 -> " in text
    code, text = on_a_terminal(paths, "snapshots", "import", str(out))
    assert code == 0, text
    assert "importing env.boxd" in text and "60.0/60.0 kB" in text, text
    # --json stays quiet even on a terminal
    code, text = on_a_terminal(paths, "snapshots", "import", str(out), "--json")
    assert code == 0 and "kB" not in text and '"digest"' in text, text


def test_a_piped_table_keeps_whole_columns(capsys) -> None:  # type: ignore[no-untyped-def]
    # Not a terminal: rich would cut every row to 80 columns ("b790e4f3b4acb6a1896e…").
    from boxd.cli import _render

    long_id = "b790e4f3b4acb6a1896ea2fcc23e55dea5d92e66222088ae1127e393"
    _render.table(["ID", "ADDRESS", "HEALTH", "NOTE"],
                  [[long_id, "127.0.0.1", "alive", "x" * 60]], "none")
    out = capsys.readouterr().out
    assert long_id in out and "x" * 60 in out
    assert "…" not in out
