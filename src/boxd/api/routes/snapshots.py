"""``/v1/snapshots``: save, list, inspect, delete, export and import snapshots."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from boxd import models
from boxd.api.auth import Account
from boxd.api.errors import ERROR_RESPONSES
from boxd.api.routes._deps import (
    BINARY_BODY,
    BINARY_RESPONSE,
    Snapshots,
    UploadDir,
    check_name,
    spooled,
)

router = APIRouter(prefix="/snapshots", tags=["snapshots"], responses=ERROR_RESPONSES)


@router.post("", response_model=models.Snapshot, status_code=status.HTTP_201_CREATED)
async def save_snapshot(
    body: models.SnapshotCreate, account: Account, snapshots: Snapshots
) -> models.Snapshot:
    """Save a machine as a named, versioned snapshot."""
    check_name(body.name)
    return await snapshots.save(account, body.machine, body.name, new_version=body.new_version)


@router.get("", response_model=models.SnapshotList)
async def list_snapshots(account: Account, snapshots: Snapshots) -> models.SnapshotList:
    """Every snapshot version of the account."""
    return models.SnapshotList(snapshots=await snapshots.list(account))


@router.post(
    "/import",
    response_model=models.Snapshot,
    status_code=status.HTTP_201_CREATED,
    openapi_extra=BINARY_BODY,
)
async def import_snapshot(
    request: Request,
    account: Account,
    snapshots: Snapshots,
    upload_dir: UploadDir,
    name: Annotated[str | None, Query(description="name to import under (default: the "
                                                   "name in the file)",
                                       json_schema_extra=models.NAME_SCHEMA)] = None,
) -> models.Snapshot:
    """Import a file written by export; the body is streamed to disk, not held in memory."""
    check_name(name)
    async with spooled(request, upload_dir, prefix="import-", suffix=".boxd") as path:
        return await snapshots.import_(account, path, name)


@router.get("/{ref}", response_model=models.Snapshot)
async def get_snapshot(ref: str, account: Account, snapshots: Snapshots) -> models.Snapshot:
    """One snapshot: ``NAME`` (latest version), ``NAME@N`` or ``sha256:HEX``."""
    return await snapshots.get(account, ref)


@router.delete("/{ref}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
async def delete_snapshot(ref: str, account: Account, snapshots: Snapshots) -> Response:
    """Delete a snapshot version (or every version of a name)."""
    await snapshots.delete(account, ref)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{ref}/export", response_class=FileResponse, responses={200: BINARY_RESPONSE})
async def export_snapshot(ref: str, account: Account, snapshots: Snapshots) -> FileResponse:
    """Download a snapshot as one file (importable with ``POST /v1/snapshots/import``)."""
    path = await snapshots.export(account, ref)
    filename = re.sub(r"[^A-Za-z0-9._@-]", "_", ref) + ".boxd"
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=filename,
        background=BackgroundTask(path.unlink, missing_ok=True),
    )
