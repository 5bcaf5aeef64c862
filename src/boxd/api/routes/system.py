"""``/v1/health`` (no auth) and ``/v1/info``."""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from boxd import models
from boxd._version import __version__
from boxd.api.auth import Account
from boxd.api.errors import ERROR_RESPONSES
from boxd.api.routes._deps import Machines

if TYPE_CHECKING:
    from boxd.services import HostInfoFn

router = APIRouter(tags=["system"])


def version() -> str:
    """The daemon's version string."""
    return __version__


@router.get("/health", response_model=models.Health)
async def health() -> models.Health:
    """Whether a daemon answers here (no API key needed)."""
    return models.Health(ok=True, version=version(), pid=os.getpid())


@router.get("/info", response_model=models.HostInfo, responses=ERROR_RESPONSES)
async def info(request: Request, account: Account, machines: Machines) -> models.HostInfo:
    """What the host runs: engine, QEMU, accelerator, CPU model, data directory; and the
    caller's creates and forks waiting for room (``queue``)."""
    host_info: HostInfoFn = request.app.state.host_info
    result = host_info()
    if inspect.isawaitable(result):
        result = await result
    return result.model_copy(update={"queue": machines.queue(account)})


@router.get("/nodes", response_model=models.NodeList, responses=ERROR_RESPONSES)
async def nodes(account: Account, machines: Machines) -> models.NodeList:
    """The nodes that run machines: this host, or each boxd node of a Ray cluster."""
    return models.NodeList(nodes=await machines.nodes_list())
