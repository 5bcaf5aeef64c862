"""Bearer API keys: the dependency that turns ``Authorization: Bearer <key>`` into an account.

The rules (who may create which keys, the default local key) are in docs/auth.md.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from boxd.api.guest import SCOPE_KEY
from boxd.api.services.keys import KeyService, hash_secret
from boxd.errors import AuthError, Forbidden
from boxd.services import GuestCaller

#: Machine credentials (made by the node, never stored) start so; account keys with "boxd_".
MACHINE_KEY_PREFIX = "boxdm_"
GUEST_KEY_HINT = "/run/boxd/key"

__all__ = ["Account", "KeyHolder", "bearer", "current_account", "key_holder", "key_service"]

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
        request.state.machine_credential = True
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


def key_holder(request: Request, account: Account) -> str:
    """The account of a request made with an API key, not a machine's credential.

    A machine's credential is scoped to what a rollout needs: its own account's
    machines (list, get, create, fork, exec, files, processes, checkpoints) and
    snapshots. Keys and accounts are administration: code in a machine must not mint a
    key that outlives it, nor wield the operator's rights because its machine belongs
    to the ``local`` account (docs/auth.md#machine-credentials).

    Raises:
        AuthError: no valid key.
        Forbidden: the request carried a machine's credential.
    """
    if getattr(request.state, "machine_credential", False):
        raise Forbidden(
            "a machine's credential cannot manage keys or accounts: it is scoped to its "
            "account's machines and snapshots",
            hint="manage keys and accounts from outside the machine with an API key; to "
            "give code in a machine an account key, pass one in its environment as "
            "BOXD_API_KEY",
        )
    return account


KeyHolder = Annotated[str, Depends(key_holder)]
"""The account of a request made with an API key (keys and accounts routes)."""
