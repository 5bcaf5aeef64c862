"""What the control routes and the envd shim share: the app's state, E2B's error body."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from boxd.e2b._fs import Watchers
from boxd.e2b._processes import ProcessTable
from boxd.e2b._sandboxes import Sandbox, Sandboxes
from boxd.errors import BoxdError
from boxd.services import SnapshotService

__all__ = [
    "CLIENT_ID", "ENVD_PORT", "ENVD_VERSION", "Authenticate", "E2BState", "e2b_error",
    "iso", "sandbox_json", "state_of",
]

#: The envd version boxd's shim answers for: the highest E2B version whose features the
#: SDKs gate on that the shim implements (docs/e2b.md): stdin (0.3.0), the default user
#: (0.4.0: the SDKs name a user only when the caller does, and the sandbox's default
#: applies otherwise, `boxd.e2b._users`) and CloseStdin (0.5.2); not yet octet-stream
#: uploads (0.5.7) or file metadata (0.6.2).
ENVD_VERSION = "0.5.2"
#: E2B's ``clientID``: a constant.
CLIENT_ID = "boxd"
#: The port envd listens on in an E2B sandbox (the ``E2b-Sandbox-Port`` of its calls).
ENVD_PORT = 49983

Authenticate = Callable[[str | None], str]
"""Turns an API key's secret into its account id; raises AuthError."""


@dataclass
class E2BState:
    """The E2B app's collaborators."""

    sandboxes: Sandboxes
    processes: ProcessTable
    authenticate: Authenticate
    snapshots: SnapshotService | None = None
    #: The operator's sandbox domain (``BOXD_E2B_DOMAIN``): ``<port>-<id>.<domain>`` Host
    #: names reach sandboxes, and creates answer it as ``domain`` (the SDK's ``get_host``).
    domain: str | None = None
    watchers: Watchers = field(default_factory=Watchers)


def state_of(request: Request) -> E2BState:
    state: E2BState = request.app.state.e2b
    return state


def e2b_error(status: int, message: str) -> JSONResponse:
    """E2B's error body: ``{"code": <status>, "message"}``."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


def boxd_error(exc: BoxdError) -> JSONResponse:
    """A boxd error in E2B's shape, at its own status (its hint after the message)."""
    message = exc.message + (f" ({exc.hint})" if exc.hint else "")
    return e2b_error(exc.status, message)


def iso(ts: float) -> str:
    """RFC 3339 in UTC, as E2B's API writes times."""
    when = datetime.datetime.fromtimestamp(min(ts, 253402300799.0), datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def sandbox_json(sandbox: Sandbox, *, detail: bool = False, token: bool = True,
                 domain: str | None = None) -> dict[str, Any]:
    """E2B's ``Sandbox`` (create, connect, fork) or, with ``detail``, ``SandboxDetail`` /
    ``ListedSandbox``; ``domain``: the sandbox domain to answer (None: none)."""
    rec, machine = sandbox.record, sandbox.machine
    out: dict[str, Any] = {
        "sandboxID": rec.sandbox_id, "templateID": rec.template, "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
    }
    if domain is not None:
        out["domain"] = domain
    if token:
        out["envdAccessToken"] = rec.token
    if detail:
        out.update({
            "startedAt": iso(rec.started_at), "endAt": iso(rec.end_at),
            "cpuCount": machine.vcpus, "memoryMB": machine.memory_mib,
            "diskSizeMB": machine.disk_gib * 1024, "state": sandbox.state,
            "metadata": rec.metadata,
        })
    return out
