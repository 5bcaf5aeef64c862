"""Bearer API keys: the dependency that turns ``Authorization: Bearer <key>`` into an account.

The rules (who may create which keys, the default local key) are in docs/auth.md.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from boxd.api.guest import SCOPE_KEY
from boxd.api.services.keys import KeyService, hash_secret
from boxd.errors import AuthError
from boxd.services import GuestCaller

#: Machine credentials (made by the node, never stored) start so; account keys with "boxd_".
MACHINE_KEY_PREFIX = "boxdm_"
GUEST_KEY_HINT = "/run/boxd/key"

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
    caller = request.scope.get(SCOPE_KEY)
    guest = isinstance(caller, GuestCaller) and bool(secret)
    if guest and secret and secret.startswith(MACHINE_KEY_PREFIX):
        assert isinstance(caller, GuestCaller)
        if hash_secret(secret) != caller.key_hash():
            raise AuthError(
                "not this machine's current credential: a machine's credential is accepted "
                "only on its own machine's API socket, until it is replaced or revoked",
                hint=f"read the current one from {GUEST_KEY_HINT} (a fork child, a restored "
                "or woken machine has a new one)")
        account = caller.account_id
    elif secret and secret.startswith(MACHINE_KEY_PREFIX):
        raise AuthError(
            "a machine's credential is accepted only on that machine's own API socket",
            hint="outside it use an API key (the local one is in <data dir>/local.key); "
            f"inside a machine, use its current credential from {GUEST_KEY_HINT}",
        )
    else:
        account = key_service(request).authenticate(secret)
    request.state.account = account
    return account


Account = Annotated[str, Depends(current_account)]
