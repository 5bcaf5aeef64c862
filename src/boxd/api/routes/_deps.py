"""Dependencies shared by the routes: the services the app was built with, name checks."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from boxd import models
from boxd.errors import InvalidRequest
from boxd.services import MachineService, SnapshotService


def _machines(request: Request) -> MachineService:
    service: MachineService = request.app.state.machines
    return service


def _snapshots(request: Request) -> SnapshotService:
    service: SnapshotService = request.app.state.snapshots
    return service


def _upload_dir(request: Request) -> Path | None:
    path: Path | None = request.app.state.upload_dir
    return path


Machines = Annotated[MachineService, Depends(_machines)]
Snapshots = Annotated[SnapshotService, Depends(_snapshots)]
UploadDir = Annotated[Path | None, Depends(_upload_dir)]

# A body that is raw bytes, for the OpenAPI schema (FastAPI cannot infer it).
BINARY_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
BINARY_RESPONSE = {
    "description": "the raw bytes",
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
}


def check_name(name: str | None, field: str = "name") -> None:
    """Reject a name that breaks the DNS-label rule (None means "generate one").

    Raises:
        InvalidRequest: the name is invalid.
    """
    if name is not None and not models.NAME_RE.match(name):
        raise InvalidRequest(f"invalid name {name!r}", hint=models.NAME_RULE, field=field)


@contextlib.asynccontextmanager
async def spooled(request: Request, upload_dir: Path | None, *, prefix: str,
                  suffix: str) -> AsyncIterator[Path]:
    """The request's body streamed to a private file in ``upload_dir`` (not held in
    memory); the file is removed when the block ends."""
    if upload_dir is not None:
        upload_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=upload_dir)
    path = Path(tmp)
    try:
        with open(fd, "wb") as f:  # the file object owns fd
            async for chunk in request.stream():
                f.write(chunk)
        yield path
    finally:
        path.unlink(missing_ok=True)
