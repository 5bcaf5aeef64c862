"""The one map from errors to HTTP responses.

Every `BoxdError` becomes its ``.status`` and ``to_body()``; FastAPI's request validation
errors become ``invalid_request`` (400) with the offending ``field``; Starlette's own
HTTP errors (unknown route, wrong method) keep their status in the same body shape;
anything else is a bug: 500 ``internal_error``, traceback in the log, never in the body.

No body names a file of the daemon: paths under its data directory or tmpfs folder
(``app.state.private_dirs``) are replaced by ``<boxd>``, and a host-side error's
``path`` detail stays in the log.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from boxd import models
from boxd.errors import BoxdError, InternalError, InvalidRequest

__all__ = [
    "ERROR_RESPONSES",
    "ErrorResponse",
    "error_body",
    "error_response",
    "install_error_handlers",
]

log = logging.getLogger("boxd.api")


class ErrorResponse(BaseModel):
    """Body of every error response: ``{"error": {"code", "message", "hint", "details"}}``."""

    error: models.ErrorBody


def _doc(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# Documented on every route; individual routes add nothing route-specific (the codes
# inside the body say what happened).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _doc("invalid_request: malformed input"),
    401: _doc("unauthorized: missing, unknown or revoked API key"),
    403: _doc("forbidden: the key's account may not do this"),
    404: _doc("not found for this account"),
    409: _doc("conflict: duplicate name, wrong machine state or an idempotency key "
               "reused for another request"),
    429: _doc("quota_exceeded"),
    500: _doc("internal_error, integrity_error or host_setup"),
    503: _doc("infrastructure_error: machine_failed, agent_lost or node_lost (the "
               "machine, its engine, agent or node failed; not the command)"),
    507: _doc("resource_exhausted"),
}


def error_body(exc: BaseException) -> models.ErrorBody:
    """The wire body of an error; unexpected exceptions become ``internal_error``."""
    if not isinstance(exc, BoxdError):
        exc = InternalError("internal error", hint="the daemon's log has the details")
    return models.ErrorBody.model_validate(jsonable_encoder(exc.to_body()["error"]))


def error_response(exc: BoxdError) -> JSONResponse:
    """A JSON response carrying a domain error at its status (and, when the error says
    when to retry, ``Retry-After`` in whole seconds)."""
    retry = exc.details.get("retry_after")
    headers = ({"Retry-After": str(max(1, math.ceil(retry)))}
               if isinstance(retry, int | float) and not isinstance(retry, bool) else None)
    return JSONResponse(status_code=exc.status, content=jsonable_encoder(exc.to_body()),
                        headers=headers)


def _field(loc: Sequence[Any]) -> str:
    # ("body", "vcpus") -> "vcpus"; ("query", "path") -> "path"; ("body",) -> "body";
    # ("body", "env", "A=B", "[key]") -> "env"; ("body", "command", "list[...]", 1)
    # -> "command": the request field, not pydantic's path inside it.
    parts = [str(p) for p in loc]
    if len(parts) > 1 and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return parts[0] if parts else ""


_PLACEHOLDER = "<boxd>"


def scrub(text: str, private_dirs: Sequence[Path]) -> str:
    """``text`` with every path under one of ``private_dirs`` replaced by ``<boxd>``."""
    for d in private_dirs:
        text = re.sub(re.escape(str(d)) + r"(/[^\s'\"):,]*)?", _PLACEHOLDER, text)
    return text


def _public(exc: BoxdError, private_dirs: Sequence[Path]) -> BoxdError:
    """A copy of ``exc`` fit for a client: no daemon paths in what it says."""
    details = dict(exc.details)
    if exc.status >= 500:
        details.pop("path", None)  # a host file (a corrupt blob): the log has it
    for k, v in details.items():
        if isinstance(v, str):
            details[k] = scrub(v, private_dirs)
    return type(exc)(scrub(exc.message, private_dirs), hint=scrub(exc.hint, private_dirs),
                     **details)


def _private_dirs(request: Request) -> Sequence[Path]:
    dirs: Sequence[Path] = getattr(request.app.state, "private_dirs", ())
    return dirs


async def _boxd_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BoxdError)
    if exc.status >= 500:
        log.error("request failed: %s %s: %s (%s) details=%s", request.method,
                  request.url.path, exc.code, exc.message, exc.details)
    return error_response(_public(exc, _private_dirs(request)))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = _field(first.get("loc", ()))
    message = f"{field}: {first.get('msg', 'invalid value')}" if field else str(first.get("msg"))
    problems = [
        {"field": _field(e.get("loc", ())), "message": str(e.get("msg", ""))} for e in errors
    ]
    return error_response(
        InvalidRequest(message, hint="see /openapi.json for the request schema",
                       field=field, errors=problems)
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 401: "unauthorized", 405: "method_not_allowed"}.get(
        exc.status_code, "invalid_request" if exc.status_code < 500 else "internal_error"
    )
    message = scrub(str(exc.detail), _private_dirs(request))
    hint, headers = "", exc.headers
    if exc.status_code == 405:
        # Starlette's Allow names the methods of the first route matching the path;
        # a path served by several routes (GET and DELETE /v1/machines/{ref}) needs all.
        allowed = _allowed_methods(request)
        headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        hint = f"{request.url.path} answers {', '.join(allowed)}"
    body = {"error": {"code": code, "message": message, "hint": hint, "details": {}}}
    return JSONResponse(status_code=exc.status_code, content=body, headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves on the request's path.

    Asked of the routes themselves (``matches`` is the public routing interface, and sees
    through included routers), one method at a time.
    """
    scope = {**request.scope, "type": "http"}
    return [m for m in _METHODS
            if any(route.matches({**scope, "method": m})[0] is Match.FULL
                   for route in request.app.router.routes)]


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(InternalError("internal error", hint="the daemon's log has the details"))


def install_error_handlers(app: FastAPI) -> None:
    """Register the error map on an app."""
    app.add_exception_handler(BoxdError, _boxd_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
