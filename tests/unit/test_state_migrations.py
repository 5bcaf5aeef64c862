"""Schema migrations: a database written by an older daemon is upgraded in place."""

from __future__ import annotations

import sqlite3
from importlib import resources
from pathlib import Path

from boxd.models import MachineState
from boxd.state import Database, Repos


def test_a_version_1_database_is_migrated_in_place_and_keeps_its_records(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    v1 = resources.files("boxd.state").joinpath("schema.sql").read_text()
    with sqlite3.connect(path) as conn:
        conn.executescript(v1 + "\nPRAGMA user_version=1;")
        conn.execute("INSERT INTO accounts (id, name, created_at) VALUES ('a_1', 'local', 1)")
        conn.execute(
            "INSERT INTO machines (id, account_id, name, state, vcpus, memory_mib, disk_gib,"
            " isolated, port, image, created_at) VALUES"
            " ('m_old', 'a_1', 'old', 'running', 1, 1024, 8, 0, 40001, 'img', 5)"
        )
    db = Database(path)
    try:
        assert db.one("PRAGMA user_version")[0] == 10  # type: ignore[index]
        rec = Repos(db).machines.get("m_old")
        assert rec is not None
        assert (rec.name, rec.state, rec.port) == ("old", MachineState.RUNNING, 40001)
        assert (rec.node_id, rec.engine, rec.vm_id) == ("local", "qemu", "m_old")
        assert rec.fwd_port == 40001  # QEMU of an old machine keeps its forward
        assert rec.last_active == 5 and rec.suspend_after is None
        assert rec.url_token and len(rec.url_token) == 32 and not rec.url_public  # v5
        assert rec.labels == {}  # v6
        assert Repos(db).idempotency.count("a_1") == 0  # v7: the table is there
        assert rec.end_at is None and rec.on_timeout is None  # v8
        assert rec.run_image is None  # v9: the default guest image
        assert not rec.net.restricted  # v10: the default network policy
    finally:
        db.close()
    again = Database(path)  # a second open migrates nothing
    try:
        assert again.one("PRAGMA user_version")[0] == 10  # type: ignore[index]
    finally:
        again.close()
