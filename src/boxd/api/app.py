"""The app factory: routes, the error map and the services, nothing else."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from boxd import models
from boxd.api._limits import AnswerWhenStopped, BodyLimit
from boxd.api.errors import install_error_handlers
from boxd.api.routes import accounts as accounts_routes
from boxd.api.routes import images as images_routes
from boxd.api.routes import keys as keys_routes
from boxd.api.routes import machines as machines_routes
from boxd.api.routes import processes as processes_routes
from boxd.api.routes import reports as reports_routes
from boxd.api.routes import snapshots as snapshots_routes
from boxd.api.routes import system
from boxd.api.services.images import ImageService
from boxd.api.services.keys import KeyService
from boxd.config import Paths, Settings
from boxd.control.accounts import Accounts as AccountsService
from boxd.services import (
    AccountService,
    HostInfoFn,
    MachineService,
    ReportService,
    SnapshotService,
)
from boxd.storage.reports import ReportStore

__all__ = ["create_app"]

API_PREFIX = "/v1"


"""What ``GET /v1/info`` calls: returns the host info, or an awaitable of it."""


def create_app(
    *,
    machines: MachineService,
    snapshots: SnapshotService,
    keys: KeyService,
    host_info: HostInfoFn,
    upload_dir: Path | None = None,
    private_dirs: Sequence[Path] | None = None,
    accounts: AccountService | None = None,
    images: ImageService | None = None,
    reports: ReportService | None = None,
    max_body: int = Settings.max_body,
    max_upload: int = Settings.max_upload,
    body_timeout: float = Settings.body_timeout,
) -> FastAPI:
    """Build the boxd HTTP API over the given services.

    Args:
        machines: the machine service.
        snapshots: the snapshot service.
        keys: accounts and API keys.
        host_info: returns what ``GET /v1/info`` answers.
        upload_dir: where snapshot imports are spooled (default: the system temp dir);
            best on the same file system as the snapshot store.
        private_dirs: folders whose paths never appear in an error body (default:
            the data directory holding ``upload_dir`` and its tmpfs folder).
        accounts: accounts and limits (default: over the keys' database).
        images: the container image store (default: ``oci/`` beside ``upload_dir``).
        reports: saved reproducibility reports (default: ``reports/`` beside ``upload_dir``).
        max_body: bytes a JSON request body may have (``BOXD_MAX_BODY``); more is a 413.
        max_upload: bytes a file upload or snapshot import may have (``BOXD_MAX_UPLOAD``).
        body_timeout: seconds a request body may stall before a 408 (``BOXD_BODY_TIMEOUT``).

    Returns the ASGI app. Its lifespan does not close the services: whoever built them does.
    """
    app = FastAPI(
        title="boxd",
        version=system.version(),
        summary="microVMs with cheap fork, checkpoint and snapshot",
        description="Every route except GET /v1/health needs 'Authorization: Bearer <API key>'."
        " Errors are {\"error\": {\"code\", \"message\", \"hint\", \"details\"}}.",
    )
    app.state.machines = machines
    app.state.snapshots = snapshots
    app.state.keys = keys
    app.state.host_info = host_info
    app.state.upload_dir = upload_dir
    app.state.private_dirs = _private_dirs(upload_dir, private_dirs)
    app.state.accounts = accounts if accounts is not None or keys is None \
        else AccountsService(keys.repos)
    app.state.images = images or _default_images(upload_dir)
    app.state.reports = reports or _default_reports(upload_dir)
    install_error_handlers(app)
    _guard(app, max_body, max_upload, body_timeout)
    for module in (system, machines_routes, snapshots_routes, keys_routes, accounts_routes,
                   processes_routes, images_routes, reports_routes):
        app.include_router(module.router, prefix=API_PREFIX)
    _document_400_not_422(app)
    return app


def _guard(app: FastAPI, max_body: int, max_upload: int, body_timeout: float) -> None:
    """Every request gets an answer: a body over its limit or stalled (`BodyLimit`),
    one the stopping server cancels (`AnswerWhenStopped`, outermost: it answers
    whatever was cut off)."""
    app.add_middleware(BodyLimit, max_body=max_body, max_upload=max_upload,
                       body_timeout=body_timeout)
    app.add_middleware(AnswerWhenStopped)


def _private_dirs(upload_dir: Path | None,
                  private_dirs: Sequence[Path] | None) -> tuple[Path, ...]:
    if private_dirs is None:
        home = upload_dir.parent if upload_dir is not None else None
        private_dirs = (home, Paths(home).shm) if home is not None else ()
    return tuple(private_dirs)


def _default_images(upload_dir: Path | None) -> ImageService:
    return ImageService(upload_dir.parent / "oci" if upload_dir is not None else None)


def _default_reports(upload_dir: Path | None) -> ReportService:
    if upload_dir is not None:
        return ReportStore(upload_dir.parent / "reports")
    # Made on the first save only: building an app (e.g. for its OpenAPI schema) leaves
    # nothing behind.
    return ReportStore(Path(tempfile.gettempdir()) / f"boxd-reports-{secrets.token_hex(8)}")


def _document_400_not_422(app: FastAPI) -> None:
    """Drop FastAPI's default 422 entries: validation errors are answered with 400."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for item in schema.get("paths", {}).values():
                for operation in item.values():
                    if isinstance(operation, dict):
                        operation.get("responses", {}).pop("422", None)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            # The NDJSON exec stream refers to ExecEvent, which no response_model
            # registers (the route returns a StreamingResponse): add it and its parts.
            event = models.ExecEvent.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            for name, sub in event.pop("$defs", {}).items():
                schemas.setdefault(name, sub)
            schemas.setdefault("ExecEvent", event)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
