"""The daemon's SQLite locks survive `Paths.ensure()`.

SQLite coordinates WAL readers and writers with POSIX advisory locks, which a process
loses on a file as soon as it closes *any* descriptor of that file. `Paths.ensure()`
makes the database files private; it used to do so by opening and closing them,
which silently dropped the daemon's locks: another process then read the database
without the daemon's newest commits (machines vanished after a kill -9 and restart).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from boxd.config import Paths
from boxd.state import Database


def _names_seen_by_another_process(db: Path) -> list[str]:
    code = (
        "import sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1])\n"
        "print(','.join(r[0] for r in c.execute('SELECT name FROM accounts ORDER BY name')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(db)], capture_output=True,
                         text=True, check=True).stdout.strip()
    return out.split(",") if out else []


def test_another_process_sees_every_commit_after_paths_ensure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BOXD_SHM", str(tmp_path / "shm"))
    paths = Paths(tmp_path / "home")
    paths.ensure()
    db = Database(paths.db)
    try:
        db.execute("INSERT INTO accounts (id, name, created_at) VALUES ('a_1', 'n1', 0)")
        paths.ensure()  # as the engine registry and build_services do, the db open
        want = ["n1"]
        for i in range(2, 8):
            assert _names_seen_by_another_process(paths.db) == want
            db.execute("INSERT INTO accounts (id, name, created_at) VALUES (?, ?, 0)",
                       (f"a_{i}", f"n{i}"))
            want.append(f"n{i}")
            db.execute("UPDATE accounts SET created_at=created_at+1")
        assert _names_seen_by_another_process(paths.db) == want
    finally:
        db.close()
    assert (paths.db.stat().st_mode & 0o777) == 0o600
