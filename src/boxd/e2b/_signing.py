"""E2B's signed file URLs: ``download_url`` / ``upload_url`` (``downloadUrl`` / ``uploadUrl``).

The SDK signs ``GET`` (read) or ``POST`` (write) ``/files?path=P`` for a secure sandbox
(every boxd sandbox is: it has an ``envdAccessToken``) without sending the token:
``signature=v1_<base64 sha256 of "P:OPERATION:USER:TOKEN[:EXPIRATION]">`` (unpadded),
``signature_expiration`` (Unix seconds) when the caller asked for one, ``username``
when it named a user (else USER is empty). envd checks it as here: a request carrying
``X-Access-Token`` is judged by the token alone; else the signature must match, and
must not be past its expiration. Errors are envd's: 401 ``{code, message}``.

Such a URL has no ``E2b-Sandbox-Id`` header and, on the shared ``E2B_SANDBOX_URL``, no
sandbox in its host name: the signature itself names the sandbox, since only the
holder of one sandbox's token can make it (`find`). The daemon computes one sha256 per
sandbox of the daemon for such a request; with ``BOXD_E2B_DOMAIN`` the host name
names the sandbox and no search is made.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping

from boxd.e2b._connect import ConnectError
from boxd.e2b._store import SandboxRecord

__all__ = ["check", "find", "operation_of", "signature"]


def signature(path: str, operation: str, user: str, token: str,
              expiration: int | None) -> str:
    """E2B's v1 signature of a file URL."""
    raw = f"{path}:{operation}:{user}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def operation_of(method: str) -> str | None:
    """The signed operation of a ``/files`` request's method (None: none is signed)."""
    return {"GET": "read", "POST": "write"}.get(method.upper())


def _expiration(query: Mapping[str, str]) -> int | None:
    text = query.get("signature_expiration")
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConnectError("invalid_argument",
                           f"signature_expiration must be Unix seconds, not {text!r}") from None


def _matches(query: Mapping[str, str], operation: str, token: str) -> bool:
    given = query.get("signature", "")
    expected = signature(query.get("path", ""), operation, query.get("username", ""), token,
                         _expiration(query))
    return hmac.compare_digest(given.encode(), expected.encode())


def check(query: Mapping[str, str], operation: str, token: str) -> None:
    """A request without ``X-Access-Token``: its signature must be the sandbox's and not
    expired.

    Raises:
        ConnectError: ``unauthenticated`` (missing, invalid or expired signature; envd's
            messages), ``invalid_argument`` (a malformed expiration).
    """
    if "signature" not in query:
        raise ConnectError("unauthenticated", "missing signature query parameter: send "
                           "X-Access-Token or use the SDK's download_url / upload_url")
    if not _matches(query, operation, token):
        raise ConnectError("unauthenticated", "invalid signature")
    expiration = _expiration(query)
    if expiration is not None and expiration < int(time.time()):
        raise ConnectError("unauthenticated", "signature is already expired")


def find(records: Iterable[SandboxRecord], query: Mapping[str, str],
         operation: str) -> SandboxRecord | None:
    """The sandbox whose token made the request's signature (None: none did)."""
    try:
        found = None
        for rec in records:  # every one compared: the time says nothing of which
            if _matches(query, operation, rec.token):
                found = rec
        return found
    except ConnectError:
        return None  # a malformed expiration: `check` says so once routed
