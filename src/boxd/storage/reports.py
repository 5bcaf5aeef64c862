"""Saved reproducibility reports: one JSON file per report, ``<root>/<account>/<name>.json``
(directories 0700, files 0600, written atomically). A report is what ``boxd rl verify
--json`` printed; the store adds its name and when it was saved."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from boxd import models
from boxd.errors import InvalidRequest, NotFound

__all__ = ["ReportStore"]

_ACCOUNT = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")


class ReportStore:
    """The daemon's `boxd.services.ReportService`: reports on disk under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, account: str, name: str) -> Path:
        if not _ACCOUNT.match(account):
            raise InvalidRequest(f"account id {account!r} cannot name a folder")
        if not models.NAME_RE.match(name):
            raise InvalidRequest(f"invalid report name {name!r}: {models.NAME_RULE}",
                                 field="name")
        return self.root / account / f"{name}.json"

    @staticmethod
    def _summary(name: str, created_at: float, report: dict[str, Any]) -> models.Report:
        return models.Report(name=name, created_at=created_at, env=str(report["env"]),
                             identical=bool(report["identical"]),
                             seeds=int(report["seeds"]), diverged=int(report["diverged"]))

    def _save(self, account: str, req: models.ReportSave) -> models.Report:
        path = self._path(account, req.name)
        # Each folder its own 0700 (mkdir's parents=True makes the parents 0755: other
        # local users could list every account's report names).
        for folder in (self.root, path.parent):
            folder.mkdir(mode=0o700, exist_ok=True)
            folder.chmod(0o700)
        created = time.time()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"name": req.name, "created_at": created, "report": req.report}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return self._summary(req.name, created, req.report)

    def _read(self, path: Path) -> models.ReportData:
        data = json.loads(path.read_text(encoding="utf-8"))
        summary = self._summary(data["name"], data["created_at"], data["report"])
        return models.ReportData(**summary.model_dump(), report=data["report"])

    def _get(self, account: str, name: str) -> models.ReportData:
        path = self._path(account, name)
        try:
            return self._read(path)
        except FileNotFoundError:
            raise NotFound(f"no report {name!r}", hint="boxd rl verify ... --save NAME "
                           "saves one", kind="report", name=name) from None

    def _list(self, account: str) -> builtins.list[models.Report]:
        folder = self.root / account
        if not _ACCOUNT.match(account) or not folder.is_dir():
            return []
        out = []
        for path in folder.glob("*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                data = self._read(path)
                out.append(models.Report(**data.model_dump(exclude={"report"})))
        return sorted(out, key=lambda r: -r.created_at)

    def _delete(self, account: str, name: str) -> None:
        try:
            self._path(account, name).unlink()
        except FileNotFoundError:
            raise NotFound(f"no report {name!r}", kind="report", name=name) from None

    async def save(self, account: str, req: models.ReportSave) -> models.Report:
        """Save (or replace) a report. Raises: InvalidRequest."""
        return await asyncio.to_thread(self._save, account, req)

    async def list(self, account: str) -> builtins.list[models.Report]:
        """The account's reports, newest first."""
        return await asyncio.to_thread(self._list, account)

    async def get(self, account: str, name: str) -> models.ReportData:
        """A report whole. Raises: NotFound, InvalidRequest (a bad name)."""
        return await asyncio.to_thread(self._get, account, name)

    async def delete(self, account: str, name: str) -> None:
        """Delete a report. Raises: NotFound, InvalidRequest (a bad name)."""
        await asyncio.to_thread(self._delete, account, name)
