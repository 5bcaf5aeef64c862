"""Accounts and API keys. No HTTP types here.

A key's secret is ``boxd_`` + 32 URL-safe characters. Only its sha256 is stored;
the secret is shown once, when the key is created. The account named ``local`` is
the daemon's administrator: its keys may create keys for other accounts (see
docs/auth.md).
"""

from __future__ import annotations

import builtins
import hashlib
import secrets
import time

from boxd import models
from boxd.config import Settings
from boxd.errors import AuthError, Forbidden, InvalidRequest, NotFound
from boxd.state import Database, KeyRecord, Repos, new_id

__all__ = ["LOCAL_ACCOUNT", "SECRET_PREFIX", "KeyService", "hash_secret"]

LOCAL_ACCOUNT = "local"
SECRET_PREFIX = "boxd_"
_DISPLAY_PREFIX_LEN = 12  # "boxd_" + 7 characters: enough to tell keys apart, not to guess
_DEFAULT_LOCAL_KEY_NAME = "local-default"

_HOW_TO_GET_A_KEY = (
    "send 'Authorization: Bearer <key>'; on the daemon's host the local key is in "
    "<data dir>/local.key, and 'boxd keys create' makes more"
)


def hash_secret(secret: str) -> str:
    """The stored form of a secret: hex sha256."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(24)  # 24 bytes -> 32 characters


def _key_model(rec: KeyRecord) -> models.ApiKey:
    return models.ApiKey(
        id=rec.id, name=rec.name, prefix=rec.prefix, created_at=rec.created_at,
        revoked_at=rec.revoked_at,
    )


class KeyService:
    """Create, list, revoke and check API keys; create accounts on demand.

    Methods are synchronous: each is one or two short SQLite statements.
    """

    def __init__(self, db: Database) -> None:
        self.repos = Repos(db)
        self._keys = self.repos.keys

    # -- accounts -----------------------------------------------------------------------

    def ensure_account(self, name: str) -> str:
        """Return the id of the account called ``name``, creating it if needed.

        Raises:
            InvalidRequest: the name breaks the DNS-label rule.
        """
        if not models.NAME_RE.match(name):
            raise InvalidRequest(
                f"invalid account name {name!r}", hint=models.NAME_RULE, field="account"
            )
        found = self._keys.account_id(name)
        if found is not None:
            return found
        return self._keys.add_account(name, Settings.from_env().default_max_machines)

    def ensure_local_account(self) -> str:
        """Return the id of the ``local`` account (the daemon's admin), creating it if needed.

        Raises:
            InternalError: the state database failed.
        """
        return self.ensure_account(LOCAL_ACCOUNT)

    def account_name(self, account_id: str) -> str:
        """The name of an account.

        Raises:
            NotFound: no such account.
        """
        name = self._keys.account_name(account_id)
        if name is None:
            raise NotFound(f"no account {account_id!r}", account=account_id)
        return name

    # -- keys ---------------------------------------------------------------------------

    def create(
        self, account_id: str, name: str, *, owner_uid: int | None = None
    ) -> models.ApiKeyCreated:
        """Create a key for an account; the secret is returned here and never again.

        Raises:
            InvalidRequest: the key name is empty or too long.
        """
        if not name or len(name) > 100:
            raise InvalidRequest(
                "a key name must have 1-100 characters", hint="pass a short name", field="name"
            )
        secret = _new_secret()
        key_id = new_id("k")
        created_at = time.time()
        prefix = secret[:_DISPLAY_PREFIX_LEN]
        self._keys.add(key_id, account_id, name, prefix, hash_secret(secret), created_at,
                       owner_uid)
        return models.ApiKeyCreated(
            id=key_id, name=name, prefix=prefix, created_at=created_at, secret=secret
        )

    def create_for(
        self, caller_account_id: str, name: str, account: str | None = None
    ) -> models.ApiKeyCreated:
        """Create a key on behalf of a caller, for its own account or (admin only) another.

        ``account`` is an account *name*; a new name creates the account. Only keys of
        the ``local`` account may name an account other than their own.

        Raises:
            Forbidden: another account was named by a non-admin caller
                (``field="account"``).
            InvalidRequest: a name is invalid.
        """
        if account is None:
            return self.create(caller_account_id, name)
        caller_name = self.account_name(caller_account_id)
        if account == caller_name:
            return self.create(caller_account_id, name)
        if caller_name != LOCAL_ACCOUNT:
            raise Forbidden(
                f"account {caller_name!r} may not create keys for account {account!r}",
                hint="omit 'account' to create a key for your own account; only keys of the "
                "local account may create keys for other accounts",
                field="account",
            )
        return self.create(self.ensure_account(account), name)

    def list(self, account_id: str) -> builtins.list[models.ApiKey]:
        """Every key of an account, revoked ones included, oldest first."""
        return [_key_model(k) for k in self._keys.list(account_id)]

    def revoke(self, account_id: str, key_id: str) -> None:
        """Revoke a key of this account; revoking twice is harmless.

        Raises:
            NotFound: no such key in this account (another account's keys look the same).
        """
        key = self._keys.get(account_id, key_id)
        if key is None:
            raise NotFound(
                f"no API key {key_id!r}", hint="'GET /v1/keys' lists your keys", key=key_id
            )
        if key.revoked_at is None:
            self._keys.revoke(key_id)

    def authenticate(self, secret: str | None) -> str:
        """Return the account id a secret belongs to.

        Raises:
            AuthError: the secret is missing, unknown or revoked.
        """
        if not secret:
            raise AuthError("missing API key", hint=_HOW_TO_GET_A_KEY)
        key = self._keys.by_secret_hash(hash_secret(secret))
        if key is None:
            raise AuthError("unknown API key", hint=_HOW_TO_GET_A_KEY)
        if key.revoked_at is not None:
            raise AuthError("this API key has been revoked", hint=_HOW_TO_GET_A_KEY)
        return key.account_id

    def ensure_default_local_key(self, uid: int, current: str | None) -> str:
        """Return a valid secret of the local account's default key for OS user ``uid``.

        ``current`` is the secret found in the key file, if any: it is kept while it still
        authenticates as the local account. Otherwise the user's old default keys (whose
        secrets are lost) are revoked and a new one is created.

        Raises:
            InternalError: the state database failed.
        """
        local = self.ensure_local_account()
        if current:
            try:
                if self.authenticate(current) == local:
                    return current
            except AuthError:
                pass
        self._keys.revoke_owned(local, uid)
        return self.create(local, _DEFAULT_LOCAL_KEY_NAME, owner_uid=uid).secret
