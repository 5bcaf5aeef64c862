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
import sqlite3
import time

from boxd import models
from boxd.config import Settings
from boxd.errors import AuthError, InvalidRequest, NotFound
from boxd.state import Database, new_id

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


def _key_from_row(row: sqlite3.Row) -> models.ApiKey:
    return models.ApiKey(
        id=row["id"],
        name=row["name"],
        prefix=row["prefix"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
    )


class KeyService:
    """Create, list, revoke and check API keys; create accounts on demand.

    Methods are synchronous: each is one or two short SQLite statements.
    """

    def __init__(self, db: Database) -> None:
        self._db = db

    @property
    def db(self) -> Database:
        return self._db

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
        row = self._db.one("SELECT id FROM accounts WHERE name = ?", (name,))
        if row is not None:
            return str(row["id"])
        account_id = new_id("a")
        self._db.execute(
            "INSERT INTO accounts (id, name, created_at, machine_quota) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(name) DO NOTHING",
            (account_id, name, time.time(), Settings.from_env().default_max_machines),
        )
        row = self._db.one("SELECT id FROM accounts WHERE name = ?", (name,))
        assert row is not None  # inserted just above, or by a concurrent caller
        return str(row["id"])

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
        row = self._db.one("SELECT name FROM accounts WHERE id = ?", (account_id,))
        if row is None:
            raise NotFound(f"no account {account_id!r}", account=account_id)
        return str(row["name"])

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
        self._db.execute(
            "INSERT INTO api_keys (id, account_id, name, prefix, secret_hash, created_at, "
            "owner_uid) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (key_id, account_id, name, prefix, hash_secret(secret), created_at, owner_uid),
        )
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
            InvalidRequest: another account was named by a non-admin caller
                (``field="account"``), or a name is invalid.
        """
        if account is None:
            return self.create(caller_account_id, name)
        caller_name = self.account_name(caller_account_id)
        if account == caller_name:
            return self.create(caller_account_id, name)
        if caller_name != LOCAL_ACCOUNT:
            raise InvalidRequest(
                f"account {caller_name!r} may not create keys for account {account!r}",
                hint="omit 'account' to create a key for your own account; only keys of the "
                "local account may create keys for other accounts",
                field="account",
            )
        return self.create(self.ensure_account(account), name)

    def list(self, account_id: str) -> builtins.list[models.ApiKey]:
        """Every key of an account, revoked ones included, oldest first."""
        rows = self._db.all(
            "SELECT * FROM api_keys WHERE account_id = ? ORDER BY created_at, id", (account_id,)
        )
        return [_key_from_row(r) for r in rows]

    def revoke(self, account_id: str, key_id: str) -> None:
        """Revoke a key of this account; revoking twice is harmless.

        Raises:
            NotFound: no such key in this account (another account's keys look the same).
        """
        row = self._db.one(
            "SELECT revoked_at FROM api_keys WHERE id = ? AND account_id = ?",
            (key_id, account_id),
        )
        if row is None:
            raise NotFound(
                f"no API key {key_id!r}", hint="'GET /v1/keys' lists your keys", key=key_id
            )
        if row["revoked_at"] is None:
            self._db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                (time.time(), key_id),
            )

    def authenticate(self, secret: str | None) -> str:
        """Return the account id a secret belongs to.

        Raises:
            AuthError: the secret is missing, unknown or revoked.
        """
        if not secret:
            raise AuthError("missing API key", hint=_HOW_TO_GET_A_KEY)
        row = self._db.one(
            "SELECT account_id, revoked_at FROM api_keys WHERE secret_hash = ?",
            (hash_secret(secret),),
        )
        if row is None:
            raise AuthError("unknown API key", hint=_HOW_TO_GET_A_KEY)
        if row["revoked_at"] is not None:
            raise AuthError("this API key has been revoked", hint=_HOW_TO_GET_A_KEY)
        return str(row["account_id"])

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
        self._db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE account_id = ? AND owner_uid = ? "
            "AND revoked_at IS NULL",
            (time.time(), local, uid),
        )
        return self.create(local, _DEFAULT_LOCAL_KEY_NAME, owner_uid=uid).secret
