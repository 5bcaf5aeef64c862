"""The one exception tree of boxd, shared by the daemon, the SDKs and the CLI.

::

    BoxdError                      every error boxd raises; .code, .message, .hint
    ├── InvalidRequest             malformed input (bad name, bad size, bad path)     400
    │   ├── CorruptData            data the client sent fails a digest or size check  400
    │   └── PayloadTooLarge        a request body over its limit; .limit (bytes)      413
    ├── AuthError                  missing, unknown or revoked API key                401
    │   └── Forbidden              the key is valid but may not do this               403
    ├── NotFound                   no such resource for this account                  404
    │   ├── MachineNotFound        .machine
    │   ├── CheckpointNotFound     .machine, .checkpoint
    │   ├── SnapshotNotFound       .snapshot
    │   ├── ExecNotFound           .machine, .exec_id (no durable exec kept by that id)
    │   └── GuestFileNotFound      .path (inside the machine)
    ├── Conflict                   the request clashes with what exists               409
    │   ├── AlreadyExists          .kind, .name (duplicate name)
    │   ├── StateError             .machine, .state, .required (wrong lifecycle state)
    │   ├── IdempotencyKeyReused   .key: the key was used for another request
    │   └── ExecIdConflict         .machine, .exec_id (the id's exec ran another command)
    ├── QuotaExceeded              .limit, .used                                      429
    ├── ExecTimeout                a command ran past its timeout and was killed      408
    ├── InfrastructureError        the machine, engine, agent or node failed, not the  503
    │   │                          command: an exec's outcome is unknown; .machine
    │   ├── MachineFailed          the machine's VM (engine process) died or stopped answering
    │   │   ├── AgentLost          the connection to its guest agent broke; the VM still ran
    │   │   └── NodeLost           its cluster node is gone; .machine, .node
    │   └── ConnectionError        the client cannot reach the daemon, or lost it     (client only)
    ├── IntegrityError             a stored blob does not match its digest            500
    ├── ResourceExhausted          host disk or memory is full; .needed, .free        507
    ├── HostSetupError             QEMU, an image or another host prerequisite is missing  500
    └── InternalError              a bug; the daemon's log has the details            500

Each error serialises to ``{"error": {"code", "message", "hint", "details"}}``; the SDKs
rebuild the same class from ``code``. Codes are stable API.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "AgentLost",
    "AlreadyExists",
    "AuthError",
    "BodyTimeout",
    "BoxdError",
    "CheckpointNotFound",
    "Conflict",
    "ConnectionError",
    "CorruptData",
    "ExecIdConflict",
    "ExecNotFound",
    "ExecTimeout",
    "Forbidden",
    "GuestFileNotFound",
    "HostSetupError",
    "IdempotencyKeyReused",
    "InfrastructureError",
    "IntegrityError",
    "InternalError",
    "InvalidRequest",
    "MachineFailed",
    "MachineNotFound",
    "NodeLost",
    "NotFound",
    "PayloadTooLarge",
    "QuotaExceeded",
    "ResourceExhausted",
    "SnapshotNotFound",
    "StateError",
    "error_from_body",
]


class BoxdError(Exception):
    """Root of every error boxd raises.

    Attributes:
        message: what happened, in one sentence.
        hint: what to do about it, or "".
        details: machine-readable fields (also set as attributes).
    """

    code: ClassVar[str] = "error"
    status: ClassVar[int] = 500
    _fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str, *, hint: str = "", **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details
        for name in self._fields:
            setattr(self, name, details.get(name))

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (a cluster node's errors cross processes): message, hint, details.
        return (_rebuild, (type(self), self.message, self.hint, self.details))

    def to_body(self) -> dict[str, Any]:
        """The JSON error body the API sends for this error."""
        return {
            "error": {
                "code": self.code,
                "message": self.message,
                "hint": self.hint,
                "details": self.details,
            }
        }


class InvalidRequest(BoxdError):
    """Malformed input: a bad name, size, path or argument."""

    code = "invalid_request"
    status = 400
    _fields: ClassVar[tuple[str, ...]] = ("field",)


class CorruptData(InvalidRequest):
    """Data the client sent (an imported snapshot file) fails an integrity check.

    The client's data is at fault, not the host: a 4xx. ``digest`` names what failed.
    """

    code = "corrupt_data"
    _fields = ("field", "digest")


class PayloadTooLarge(InvalidRequest):
    """A request body is larger than the daemon accepts (``limit`` bytes; its settings
    ``BOXD_MAX_BODY`` for JSON, ``BOXD_MAX_UPLOAD`` for files and snapshot imports)."""

    code = "payload_too_large"
    status = 413
    _fields = ("field", "limit")


class BodyTimeout(InvalidRequest):
    """The client stopped sending its request body (``seconds`` without a byte, the
    daemon's ``BOXD_BODY_TIMEOUT``) before it was complete."""

    code = "body_timeout"
    status = 408
    _fields = ("field", "seconds")


class AuthError(BoxdError):
    """The API key is missing, unknown or revoked."""

    code = "unauthorized"
    status = 401


class Forbidden(AuthError):
    """The API key is valid, but its account may not do this (e.g. a key of an account
    other than ``local`` creating keys for another account)."""

    code = "forbidden"
    status = 403


class NotFound(BoxdError):
    """No such resource for this account (another account's resources look the same)."""

    code = "not_found"
    status = 404


class MachineNotFound(NotFound):
    """No machine with this name or id."""

    code = "machine_not_found"
    _fields = ("machine",)


class CheckpointNotFound(NotFound):
    """The machine has no checkpoint of this name."""

    code = "checkpoint_not_found"
    _fields = ("machine", "checkpoint")


class SnapshotNotFound(NotFound):
    """No snapshot matches this reference."""

    code = "snapshot_not_found"
    _fields = ("snapshot",)


class GuestFileNotFound(NotFound):
    """A path inside the machine does not exist."""

    code = "guest_file_not_found"
    _fields = ("path",)


class ExecNotFound(NotFound):
    """No exec with this id is kept for the machine (unknown, or past its keeping)."""

    code = "exec_not_found"
    _fields = ("machine", "exec_id")


class Conflict(BoxdError):
    """The request clashes with what exists."""

    code = "conflict"
    status = 409


class AlreadyExists(Conflict):
    """A resource of this kind and name exists already."""

    code = "already_exists"
    _fields = ("kind", "name")


class StateError(Conflict):
    """The machine is in a state that does not allow this operation."""

    code = "invalid_state"
    _fields = ("machine", "state", "required")


class IdempotencyKeyReused(Conflict):
    """An ``Idempotency-Key`` already named a different request of this account (another
    route, source or body): a key names one request, whose retries send it unchanged."""

    code = "idempotency_key_reused"
    _fields = ("key",)


class ExecIdConflict(Conflict):
    """An exec id the machine keeps for another command."""

    code = "exec_id_conflict"
    _fields = ("machine", "exec_id")


class QuotaExceeded(BoxdError):
    """An account limit would be exceeded."""

    code = "quota_exceeded"
    status = 429
    #: ``retry_after``: seconds after which a retry likely finds room (the HTTP answer's
    #: Retry-After header too), set on an admission wait's end (`control/admission.py`).
    _fields = ("limit", "used", "retry_after")


class ExecTimeout(BoxdError):
    """A command ran past its timeout and was killed."""

    code = "exec_timeout"
    status = 408
    _fields = ("timeout", "stdout", "stderr", "exec_id")


class InfrastructureError(BoxdError):
    """The machine, its engine, its guest agent or its node failed: not the command.

    An exec that raises it has no exit status (its outcome is unknown), so a trainer
    retries or drops the rollout instead of scoring it. The subclasses say which part
    failed; ``machine`` names the machine when one is concerned.
    """

    code = "infrastructure_error"
    status = 503
    _fields: ClassVar[tuple[str, ...]] = ("machine",)


class MachineFailed(InfrastructureError):
    """The machine's VM process (its engine: QEMU, the gVisor sandbox) died or stopped
    answering."""

    code = "machine_failed"


class AgentLost(MachineFailed):
    """The connection to the machine's guest agent broke mid-request while its VM
    process still ran (the guest's agent died or its channel closed)."""

    code = "agent_lost"


class NodeLost(MachineFailed):
    """The cluster node that ran the machine is gone; only delete applies."""

    code = "node_lost"
    _fields = ("machine", "node")


class IntegrityError(BoxdError):
    """A stored blob does not match its recorded digest."""

    code = "integrity_error"
    status = 500
    _fields = ("digest", "path")


class ResourceExhausted(BoxdError):
    """The host ran out of disk or memory."""

    code = "resource_exhausted"
    status = 507
    _fields = ("needed", "free")


class HostSetupError(BoxdError):
    """A host prerequisite (QEMU, an image, a tool) is missing or broken."""

    code = "host_setup"
    status = 500


class ConnectionError(InfrastructureError):
    """The client could not reach the boxd daemon, or lost its connection mid-request
    (an exec's outcome is then unknown)."""

    code = "connection_error"
    status = 503


class InternalError(BoxdError):
    """An unexpected failure; the daemon's log has the details."""

    code = "internal_error"
    status = 500


def _all_subclasses(cls: type[BoxdError]) -> list[type[BoxdError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _all_subclasses(sub)
    return out


_BY_CODE: dict[str, type[BoxdError]] = {c.code: c for c in _all_subclasses(BoxdError)}


def _rebuild(cls: type[BoxdError], message: str, hint: str, details: dict[str, Any]) -> BoxdError:
    return cls(message, hint=hint, **details)


def error_from_body(body: Any, status: int = 500) -> BoxdError:
    """Rebuild the typed error from an API error body (the inverse of `to_body`)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return InternalError(f"unexpected error response (HTTP {status}): {body!r}"[:500])
    cls = _BY_CODE.get(str(err.get("code")), BoxdError)
    raw = err.get("details")
    details: dict[str, Any] = raw if isinstance(raw, dict) else {}
    return cls(str(err.get("message", "")), hint=str(err.get("hint", "")), **details)
