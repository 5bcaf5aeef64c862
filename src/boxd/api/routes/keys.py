"""``/v1/keys``: create, list and revoke API keys (rules in docs/auth.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response, status

from boxd import models
from boxd.api.auth import KeyHolder, key_service
from boxd.api.errors import ERROR_RESPONSES
from boxd.api.services.keys import KeyService

router = APIRouter(prefix="/keys", tags=["keys"], responses=ERROR_RESPONSES)

Keys = Annotated[KeyService, Depends(key_service)]


@router.post("", response_model=models.ApiKeyCreated, status_code=status.HTTP_201_CREATED)
def create_key(body: models.ApiKeyCreate, account: KeyHolder, keys: Keys) -> models.ApiKeyCreated:
    """Create a key; its secret is in this response only.

    ``account`` names another account (created if new); only keys of the local account
    may do that.
    """
    return keys.create_for(account, body.name, body.account)


@router.get("", response_model=models.ApiKeyList)
def list_keys(account: KeyHolder, keys: Keys) -> models.ApiKeyList:
    """The account's keys, revoked ones included (secrets are never shown again)."""
    return models.ApiKeyList(keys=keys.list(account))


@router.delete("/{key_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
def revoke_key(key_id: str, account: KeyHolder, keys: Keys) -> Response:
    """Revoke a key of the account; requests with it fail from now on."""
    keys.revoke(account, key_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
