"""One SQLite connection per daemon, WAL mode, foreign keys on, migrations by version."""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from boxd.errors import InternalError, ResourceExhausted

# Each entry upgrades the schema by one version. Append only.
_MIGRATIONS: list[str] = [
    resources.files("boxd.state").joinpath(name).read_text()
    for name in ("schema.sql", "migrations_v2.sql", "migrations_v3.sql",
                 "migrations_v4.sql", "migrations_v5.sql", "migrations_v6.sql",
                 "migrations_v7.sql", "migrations_v8.sql", "migrations_v9.sql",
                 "migrations_v10.sql")
]

_ALPHABET = "abcdefghijkmnpqrstuvwxyz23456789"


def new_id(prefix: str) -> str:
    """A random id like ``m_7kq2xw9d4hfa``; the underscore keeps ids apart from names."""
    return prefix + "_" + "".join(secrets.choice(_ALPHABET) for _ in range(12))


class Database:
    """A thread-safe wrapper around one SQLite connection.

    Calls are short and serialised by a lock, so the daemon may call them from the
    event loop and from worker threads alike.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._migrate()

    def _migrate(self) -> None:
        with self._lock:
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            for i, script in enumerate(_MIGRATIONS[version:], start=version + 1):
                self._conn.executescript(
                    "BEGIN;\n" + script + f"\nPRAGMA user_version={i};\nCOMMIT;"
                )

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Run several statements atomically (BEGIN IMMEDIATE ... COMMIT)."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> int:
        """Execute one statement; return the number of changed rows."""
        with self._lock:
            try:
                return self._conn.execute(sql, params).rowcount
            except sqlite3.OperationalError as exc:
                if "disk" in str(exc) or "full" in str(exc):
                    raise ResourceExhausted(
                        f"cannot write state: {exc}", hint="free disk space on the data directory"
                    ) from exc
                raise InternalError(f"state query failed: {exc}") from exc

    def one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> sqlite3.Row | None:
        with self._lock:
            row: sqlite3.Row | None = self._conn.execute(sql, params).fetchone()
            return row

    def all(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._conn.execute(sql, params).fetchall())

    def close(self) -> None:
        with self._lock:
            self._conn.close()
