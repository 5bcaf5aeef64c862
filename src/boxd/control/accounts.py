"""Accounts and their quotas: the operator (the ``local`` account) raises limits."""

from __future__ import annotations

import builtins

from boxd import models
from boxd.errors import Forbidden, NotFound
from boxd.state import AccountRecord, Repos

OPERATOR = "local"


def account_model(rec: AccountRecord) -> models.Account:
    return models.Account(name=rec.name, id=rec.id, max_machines=rec.max_machines,
                          machines=rec.used, created_at=rec.created_at)


class Accounts:
    """The `AccountService`: list, inspect and change accounts' limits."""

    def __init__(self, repos: Repos) -> None:
        self.repos = repos

    def _caller(self, account: str) -> AccountRecord:
        rec = self.repos.accounts.get(account)
        if rec is None:
            raise NotFound(f"no account {account!r}", account=account)
        return rec

    def _visible(self, caller: AccountRecord, name: str) -> AccountRecord:
        rec = self.repos.accounts.get(name)
        # Another account's existence is the operator's business only.
        if rec is None or (caller.name != OPERATOR and rec.id != caller.id):
            raise NotFound(f"no account {name!r}", account=name,
                           hint="`boxd accounts list` shows the accounts you can see")
        return rec

    async def list(self, account: str) -> builtins.list[models.Account]:
        caller = self._caller(account)
        if caller.name == OPERATOR:
            return [account_model(r) for r in self.repos.accounts.list()]
        return [account_model(caller)]

    async def get(self, account: str, name: str) -> models.Account:
        return account_model(self._visible(self._caller(account), name))

    async def update(self, account: str, name: str, req: models.AccountUpdate) -> models.Account:
        """Raises: Forbidden: only the operator changes limits; NotFound."""
        caller = self._caller(account)
        rec = self._visible(caller, name)
        if caller.name != OPERATOR:
            raise Forbidden(
                "only the operator (the local account) changes account limits",
                hint="ask the operator of this daemon to raise it: "
                f"`boxd accounts update {rec.name} --max-machines N`",
            )
        self.repos.accounts.set_quota(rec.id, req.max_machines)
        fresh = self.repos.accounts.get(rec.id)
        assert fresh is not None
        return account_model(fresh)


__all__ = ["OPERATOR", "Accounts", "account_model"]
