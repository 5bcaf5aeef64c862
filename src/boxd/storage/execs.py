"""Durable exec records on disk: one JSON file per exec, ``<root>/<machine id>/<exec
id>.json`` (folders 0700, files 0600).

A file is written through a temporary file in its folder and a rename, so a daemon
killed at any point leaves the whole old record, the whole new one, or none, never half
of one; a temporary file a kill left behind is removed by the next `read_all`. Files
are not fsynced: they outlive the daemon's process, not a crash of the host (a record
the host lost half of is unreadable, and `read_all` drops it). What a record holds is
the node's business (`boxd.node._exec_records`); here it is a JSON object.

Files rather than a table of ``state.db``: a record holds up to 2 MiB of output and is
written at each exec's start and end, which in the database would grow its WAL and take
its one writer (that every state change waits for) per exec; a file per record is
dropped by an unlink and a machine's by one folder; and the records are the node's
(on a Ray cluster, in the node's own data directory).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from boxd.errors import InvalidRequest
from boxd.models import EXEC_ID_MAX, EXEC_ID_PATTERN
from boxd.storage._files import os_errors, write_atomic

__all__ = ["ExecFiles"]

log = logging.getLogger("boxd.storage")

_EXEC_ID = re.compile(EXEC_ID_PATTERN)
# Machine ids are the daemon's own (``m-<hex>``); anything that is not one plain name
# could leave the folder.
_MACHINE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")


class ExecFiles:
    """The exec records of one node under ``root`` (``Paths.execs``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _folder(self, machine_id: str) -> Path:
        if not _MACHINE_ID.match(machine_id):
            raise InvalidRequest(f"machine id {machine_id!r} cannot name a folder")
        return self.root / machine_id

    def _path(self, machine_id: str, exec_id: str) -> Path:
        if not (_EXEC_ID.match(exec_id) and len(exec_id) <= EXEC_ID_MAX):
            raise InvalidRequest(f"invalid exec id {exec_id!r}", field="exec_id")
        return self._folder(machine_id) / f"{exec_id}.json"

    def write(self, machine_id: str, exec_id: str, doc: dict[str, Any]) -> None:
        """Write (or replace) one record, whole or not at all.

        Raises:
            InvalidRequest: an id that cannot name a file.
            ResourceExhausted: the disk is full. InternalError: another OS error.
        """
        path = self._path(machine_id, exec_id)
        data = json.dumps(doc, separators=(",", ":")).encode()
        with os_errors("keep an exec's record", path):
            # Each folder its own 0700 (mkdir's parents=True would make parents 0755).
            for folder in (self.root, path.parent):
                if not folder.is_dir():
                    folder.mkdir(mode=0o700, exist_ok=True)
                    folder.chmod(0o700)
            write_atomic(path, data, mode=0o600, durable=False)

    def remove(self, machine_id: str, exec_id: str) -> None:
        """Remove one record (none: nothing to do). An OS error is logged, not raised: the
        record is gone from memory already and `read_all` sweeps what it finds."""
        path = self._path(machine_id, exec_id)
        try:
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: the machine has others
                path.parent.rmdir()
        except OSError as exc:
            log.warning("machine=%s event=exec_record_not_removed exec=%s error=%r",
                        machine_id, exec_id, exc)

    def remove_machine(self, machine_id: str) -> None:
        """Remove every record of a machine."""
        shutil.rmtree(self._folder(machine_id), ignore_errors=True)

    def read_all(self) -> list[dict[str, Any]]:
        """Every readable record, each with its ``machine_id`` and ``exec_id`` as named by
        its path. Temporary files of interrupted writes, unreadable records and stray
        entries are removed."""
        docs: list[dict[str, Any]] = []
        if not self.root.is_dir():
            return docs
        for folder in sorted(self.root.iterdir()):
            if not (folder.is_dir() and _MACHINE_ID.match(folder.name)):
                _remove_stray(folder)
                continue
            for path in sorted(folder.iterdir()):
                doc = _read(path)
                if doc is None:
                    _remove_stray(path)
                    continue
                docs.append({**doc, "machine_id": folder.name, "exec_id": path.name[:-5]})
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if it was left empty
        return docs


def _read(path: Path) -> dict[str, Any] | None:
    name = path.name
    if not (name.endswith(".json") and _EXEC_ID.match(name[:-5]) and path.is_file()):
        return None
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _remove_stray(path: Path) -> None:
    log.warning("event=exec_record_dropped path=%s", path)
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            os.unlink(path)
