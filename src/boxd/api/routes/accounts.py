"""``/v1/accounts``: accounts and their machine limits (the operator changes them)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from boxd import models
from boxd.api.auth import KeyHolder
from boxd.api.errors import ERROR_RESPONSES
from boxd.services import AccountService

router = APIRouter(prefix="/accounts", tags=["accounts"], responses=ERROR_RESPONSES)


def _accounts(request: Request) -> AccountService:
    service: AccountService = request.app.state.accounts
    return service


Accounts = Annotated[AccountService, Depends(_accounts)]


@router.get("", response_model=models.AccountList)
async def list_accounts(account: KeyHolder, accounts: Accounts) -> models.AccountList:
    """Every account (the operator), else the caller's own."""
    return models.AccountList(accounts=await accounts.list(account))


@router.get("/{name}", response_model=models.Account)
async def get_account(name: str, account: KeyHolder, accounts: Accounts) -> models.Account:
    """One account: its limit and the machines counting against it."""
    return await accounts.get(account, name)


@router.patch("/{name}", response_model=models.Account)
async def update_account(
    name: str, body: models.AccountUpdate, account: KeyHolder, accounts: Accounts
) -> models.Account:
    """Change an account's limit (operator only)."""
    return await accounts.update(account, name, body)
