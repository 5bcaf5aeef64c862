"""``/v1/images``: import, list, inspect and remove container images."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, status
from fastapi.responses import StreamingResponse

from boxd import models
from boxd.api.auth import Account, KeyHolder
from boxd.api.errors import ERROR_RESPONSES
from boxd.api.routes._deps import BINARY_BODY, UploadDir, spooled
from boxd.api.services.images import ImageService
from boxd.api.services.keys import LOCAL_ACCOUNT, KeyService
from boxd.errors import BoxdError, Forbidden, InvalidRequest
from boxd.images.oci import parse_source

NDJSON = "application/x-ndjson"
router = APIRouter(prefix="/images", tags=["images"], responses=ERROR_RESPONSES)


def _images(request: Request) -> ImageService:
    service: ImageService = request.app.state.images
    return service


Images = Annotated[ImageService, Depends(_images)]


def _is_operator(request: Request, account: str) -> bool:
    keys: KeyService = request.app.state.keys
    return keys.repos.keys.account_name(account) == LOCAL_ACCOUNT and not getattr(
        request.state, "machine_credential", False)


def _builder(request: Request, account: KeyHolder) -> str:
    """The operator's account: a build's RUN steps run as the daemon's user on its host
    (buildah's chroot isolation, not a sandbox), so no other account, and no machine's
    credential (not even one of the operator's machines), may start one."""
    if not _is_operator(request, account):
        raise Forbidden(
            "only the operator (the local account) builds Dockerfiles on this daemon: a "
            "build's RUN steps run on the daemon's host, outside any machine",
            hint="build the image where you trust it (buildah, docker) and import it "
                 "with `boxd image import`, or ask the operator to build it")
    return account


Builder = Annotated[str, Depends(_builder)]


async def _check_source(request: Request, account: str, source: str) -> None:
    """What an account other than the operator may import from: a registry on a public
    address. A path (``oci:``, ``oci-archive:``, ``docker-archive:``) names a file of the
    daemon's host, and a registry on a loopback, private or link-local address is a
    service the daemon (not a machine) would connect to: both are the operator's.

    Raises:
        Forbidden: the source is the operator's alone.
        InvalidRequest: a malformed source, or a host that does not resolve.
    """
    src = parse_source(source)
    if _is_operator(request, account):
        return
    if src.transport != "docker":
        raise Forbidden(
            f"only the operator imports from paths on the daemon's host ({src.transport}:)",
            hint="push the image to a registry and import docker://HOST/REPO:TAG, or ask "
                 "the operator to import it")
    host = src.host.rsplit(":", 1)[0] if not src.host.startswith("[") else \
        src.host[1:].split("]", 1)[0]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None)
    except OSError as exc:
        raise InvalidRequest(f"the registry host {host!r} does not resolve: {exc}",
                             hint="check the host name") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0])
        if not ip.is_global:
            raise Forbidden(
                f"the registry {src.host} is at {ip}, a loopback, private or reserved "
                "address: only the operator imports from one (the daemon connects to it)",
                hint="import from a registry on a public address, or ask the operator")


@router.post("", response_model=models.Image, status_code=status.HTTP_201_CREATED,
             responses={200: {"description": "with progress=true: NDJSON lines "
                              '{"type": "progress", "step", "fraction"}, then '
                              '{"type": "image", "image"} or {"error": {...}}',
                              "content": {NDJSON: {}}}})
async def import_image(
    request: Request, body: models.ImageImport, account: Account, images: Images,
    progress: Annotated[bool, Query(description="stream NDJSON progress lines")] = False,
) -> models.Image | StreamingResponse:
    """Import an image from a layout, an archive or a registry (layers stored once).
    Paths on the daemon's host and registries on non-public addresses are the operator's
    (403 for other accounts)."""
    await _check_source(request, account, body.source)
    if not progress:
        return await images.import_(account, body)
    return StreamingResponse(_with_progress(
        lambda report: images.import_(account, body, report)), media_type=NDJSON)


async def _with_progress(
    work: Callable[[Callable[[str, float | None], None]], Awaitable[models.Image]],
) -> AsyncIterator[bytes]:
    """NDJSON lines: the newest progress of ``work`` (coalesced: a slow reader gets the
    latest, not a backlog), then its result or its error."""
    loop = asyncio.get_running_loop()
    latest: list[tuple[str, float | None]] = []
    changed = asyncio.Event()

    def report(step: str, fraction: float | None) -> None:  # from a worker thread
        def note() -> None:
            latest[:] = [(step, fraction)]
            changed.set()
        loop.call_soon_threadsafe(note)

    task = asyncio.ensure_future(work(report))
    try:
        while not task.done():
            waiter = asyncio.ensure_future(changed.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            changed.clear()
            for step, fraction in latest:
                yield _line({"type": "progress", "step": step, "fraction": fraction})
            latest.clear()
        try:
            image = task.result()
        except BoxdError as exc:
            yield _line(exc.to_body())
            return
        yield _line({"type": "image", "image": image.model_dump(mode="json")})
    finally:
        if not task.done():  # the client went away: the import goes on to its end
            task.add_done_callback(lambda t: t.exception())


def _line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


@router.post("/build", response_model=models.Image, status_code=status.HTTP_201_CREATED,
             openapi_extra=BINARY_BODY)
async def build_image(
    request: Request, account: Builder, images: Images, upload_dir: UploadDir,
    name: Annotated[str, Query(description="NAME[:TAG] to store the result under",
                               pattern=models.IMAGE_NAME_PATTERN, max_length=330)],
    dockerfile: Annotated[str, Query(description="the Dockerfile's path in the context")]
    = "Dockerfile",
    build_arg: Annotated[list[str] | None, Query(description="K=V (repeat)")] = None,
    target: Annotated[str | None, Query(description="the stage to build")] = None,
) -> models.Image:
    """Build a Dockerfile: the body is the context as a tar (optionally gzip), streamed
    to disk. Each instruction must be one boxd supports (else a 400 naming its line).
    The operator's keys only (403 otherwise): RUN steps run on the daemon's host."""
    args = {}
    for item in build_arg or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"build_arg {item!r} is not K=V", field="build_arg")
        args[key] = value
    async with spooled(request, upload_dir, prefix="context-", suffix=".tar") as path:
        return await images.build(account, path, name, dockerfile=dockerfile,
                                  build_args=args, target=target)


@router.get("", response_model=models.ImageList)
async def list_images(account: Account, images: Images) -> models.ImageList:
    """The account's images, by name."""
    return models.ImageList(images=await images.list(account))


ImageName = Annotated[str, Path(description="NAME[:TAG]", pattern=models.IMAGE_NAME_PATTERN,
                                max_length=330)]


@router.get("/{name:path}", response_model=models.Image)
async def get_image(name: ImageName, account: Account, images: Images) -> models.Image:
    """One image: its digest, layers and run config (ENV, ENTRYPOINT, CMD, ...)."""
    return await images.get(account, name)


@router.delete("/{name:path}", response_model=models.Image)
async def remove_image(name: ImageName, account: Account, images: Images) -> models.Image:
    """Remove the name; layers no other image holds are freed."""
    return await images.remove(account, name)
