"""What E2B knows of a sandbox and boxd does not: one small JSON file per sandbox.

A sandbox is a boxd machine named by its id; its record here holds the rest of E2B's
view (template, metadata, env vars, end of life, auto-pause, the envd access token),
so that all of it survives a daemon restart. Files live in ``<data dir>/e2b/``, private
to the daemon's user, written atomically (temp file, fsync, rename) and removed with
the sandbox; the records are also kept in memory (one per sandbox: bounded by the
accounts' machine quotas).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from boxd.e2b._ids import is_sandbox_id

__all__ = ["SandboxRecord", "SandboxStore"]

log = logging.getLogger("boxd.e2b")


@dataclass(frozen=True)
class SandboxRecord:
    """E2B's view of one sandbox (the machine holds the rest)."""

    sandbox_id: str
    account: str
    template: str
    token: str
    started_at: float
    end_at: float
    auto_pause: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    #: Who its commands and files are for when a call names no user (`boxd.e2b._users`):
    #: ``user`` (E2B's), ``root`` (a guest without that account), ``""`` (a container
    #: image's own USER: boxd's exec applies it), None (not known yet: found out once).
    user: str | None = None

    def with_end(self, end_at: float) -> SandboxRecord:
        return replace(self, end_at=end_at)


class SandboxStore:
    """The records, in memory and in ``directory`` (one JSON file each)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._records: dict[str, SandboxRecord] = {}
        for path in directory.glob("*.json"):
            rec = _load(path)
            if rec is not None:
                self._records[rec.sandbox_id] = rec

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        return self._records.get(sandbox_id)

    def all(self) -> list[SandboxRecord]:
        return list(self._records.values())

    def by_token(self, token: str) -> SandboxRecord | None:
        """The sandbox whose envd access token is ``token`` (compared in constant time)."""
        found = None
        for rec in self._records.values():
            if hmac.compare_digest(token.encode(), rec.token.encode()):
                found = rec
        return found

    def put(self, rec: SandboxRecord) -> None:
        """Write ``rec`` (replacing the sandbox's record)."""
        path = self.directory / f"{rec.sandbox_id}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(asdict(rec)).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._records[rec.sandbox_id] = rec

    def remove(self, sandbox_id: str) -> None:
        self._records.pop(sandbox_id, None)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / f"{sandbox_id}.json").unlink()


def _load(path: Path) -> SandboxRecord | None:
    try:
        data = json.loads(path.read_text())
        rec = SandboxRecord(**data)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring an unreadable sandbox record %s: %s", path.name, exc)
        return None
    if not is_sandbox_id(rec.sandbox_id) or path.stem != rec.sandbox_id:
        log.warning("ignoring sandbox record %s: its id does not match", path.name)
        return None
    return rec


def now() -> float:
    """Wall-clock seconds (records hold wall-clock times: they outlive the process)."""
    return time.time()
