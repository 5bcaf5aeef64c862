"""SQLite state: schema migrations and a small thread-safe connection wrapper."""

from boxd.state._db import Database, new_id

__all__ = ["Database", "new_id"]
