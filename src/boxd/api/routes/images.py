"""``/v1/images``: import, list, inspect and remove container images."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, status

from boxd import models
from boxd.api.auth import Account
from boxd.api.errors import ERROR_RESPONSES
from boxd.api.services.images import ImageService

router = APIRouter(prefix="/images", tags=["images"], responses=ERROR_RESPONSES)


def _images(request: Request) -> ImageService:
    service: ImageService = request.app.state.images
    return service


Images = Annotated[ImageService, Depends(_images)]


@router.post("", response_model=models.Image, status_code=status.HTTP_201_CREATED)
async def import_image(body: models.ImageImport, account: Account,
                       images: Images) -> models.Image:
    """Import an image from a layout, an archive or a registry (layers stored once)."""
    return await images.import_(account, body)


@router.get("", response_model=models.ImageList)
async def list_images(account: Account, images: Images) -> models.ImageList:
    """The account's images, by name."""
    return models.ImageList(images=await images.list(account))


@router.get("/{name:path}", response_model=models.Image)
async def get_image(name: str, account: Account, images: Images) -> models.Image:
    """One image: its digest, layers and run config (ENV, ENTRYPOINT, CMD, ...)."""
    return await images.get(account, name)


@router.delete("/{name:path}", response_model=models.Image)
async def remove_image(name: str, account: Account, images: Images) -> models.Image:
    """Remove the name; layers no other image holds are freed."""
    return await images.remove(account, name)
