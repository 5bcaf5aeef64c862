"""Bearer API keys: the dependency that turns ``Authorization: Bearer <key>`` into an account.

The rules (who may create which keys, the default local key) are in docs/auth.md.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from boxd.api.services.keys import KeyService

__all__ = ["Account", "bearer", "current_account", "key_service"]

# auto_error=False: a missing header must become our AuthError body, not FastAPI's 403.
bearer = HTTPBearer(
    auto_error=False,
    scheme_name="apiKey",
    description="a boxd API key (boxd_...); the local one is in <data dir>/local.key",
)


def key_service(request: Request) -> KeyService:
    """The app's `KeyService`."""
    keys: KeyService = request.app.state.keys
    return keys


def current_account(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    """The id of the account whose key authorised this request.

    Raises:
        AuthError: the key is missing, unknown or revoked.
    """
    secret = credentials.credentials if credentials is not None else None
    account = key_service(request).authenticate(secret)
    request.state.account = account
    return account


Account = Annotated[str, Depends(current_account)]
