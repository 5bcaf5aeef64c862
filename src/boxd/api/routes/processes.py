"""``/v1/machines/{ref}/processes``: long-lived processes with a framed message stream.

``POST`` spawns one, ``GET`` lists them, ``.../{id}/kill`` signals one and the
WebSocket ``.../{id}/stream`` carries its messages: each binary WebSocket message is
one frame (client to process: one frame on its stdin; process to client: one frame it
wrote to stdout). Text messages are control, JSON: the server first sends
``{"type": "attached", "process": {...}}``, and last ``{"type": "exit", "exit_code",
"signal"}`` or ``{"type": "error", "error": {...}}`` before it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, WebSocket, WebSocketDisconnect, status
from fastapi.encoders import jsonable_encoder

from boxd import process_models as pm
from boxd.api.auth import Account
from boxd.api.errors import ERROR_RESPONSES, error_body
from boxd.api.services.keys import KeyService
from boxd.errors import BoxdError
from boxd.services import ProcessService

router = APIRouter(prefix="/machines", tags=["processes"], responses=ERROR_RESPONSES)
log = logging.getLogger("boxd.api")

#: WebSocket close code after an error message (4000-4999: the application's own).
CLOSE_ERROR = 4000


def _service(request: Request) -> ProcessService:
    service: ProcessService = request.app.state.machines
    return service


Processes = Annotated[ProcessService, Depends(_service)]


@router.post("/{ref}/processes", response_model=pm.Process, status_code=status.HTTP_201_CREATED)
async def spawn(ref: str, body: pm.SpawnRequest, account: Account,
                processes: Processes) -> pm.Process:
    """Start a long-lived process; talk to it over ``.../processes/{id}/stream``."""
    return await processes.spawn(account, ref, body)


@router.get("/{ref}/processes", response_model=pm.ProcessList)
async def list_processes(ref: str, account: Account, processes: Processes) -> pm.ProcessList:
    """The machine's processes (a fork child lists its copies of its source's)."""
    return pm.ProcessList(processes=await processes.processes(account, ref))


@router.post("/{ref}/processes/{process_id}/kill", response_model=pm.Process)
async def kill_process(ref: str, process_id: str, body: pm.ProcessKill, account: Account,
                       processes: Processes) -> pm.Process:
    """Send a signal to the process's group."""
    return await processes.process_kill(account, ref, process_id, body.signal)


def _bearer(ws: WebSocket) -> str | None:
    header = ws.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    return secret.strip() if scheme.lower() == "bearer" and secret.strip() else None


async def _send_json(ws: WebSocket, msg: dict[str, Any]) -> None:
    await ws.send_text(json.dumps(jsonable_encoder(msg), separators=(",", ":")))


@router.websocket("/{ref}/processes/{process_id}/stream")
async def stream(ws: WebSocket, ref: str, process_id: str) -> None:
    """The process's messages both ways (see the module docstring)."""
    await ws.accept()
    service: ProcessService = ws.app.state.machines
    try:
        keys: KeyService = ws.app.state.keys
        account = keys.authenticate(_bearer(ws))
        async with service.process_attach(account, ref, process_id) as proc:
            await _send_json(ws, {"type": "attached", "process": proc.process.model_dump()})
            await _relay(ws, proc)
    except WebSocketDisconnect:
        return
    except BoxdError as exc:
        with contextlib.suppress(Exception):
            await _send_json(ws, {"type": "error", "error": error_body(exc).model_dump()})
            await ws.close(CLOSE_ERROR)
    except Exception as exc:
        log.exception("process stream %s/%s failed", ref, process_id)
        with contextlib.suppress(Exception):
            await _send_json(ws, {"type": "error", "error": error_body(exc).model_dump()})
            await ws.close(CLOSE_ERROR)


async def _inbound(ws: WebSocket, proc: Any) -> None:
    """The client's binary frames to the process, until the client goes."""
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(msg.get("code", 1000))
        data = msg.get("bytes")
        if data is not None:
            await proc.send(data)


async def _outbound(ws: WebSocket, proc: Any) -> None:
    """The process's frames to the client, then its exit (and the close)."""
    while True:
        frame = await proc.recv()
        if frame is None:
            p = proc.process
            await _send_json(ws, {"type": "exit", "exit_code": p.exit_code,
                                  "signal": p.signal, "stderr_tail": p.stderr_tail})
            await ws.close()
            return
        await ws.send_bytes(frame)


async def _relay(ws: WebSocket, proc: Any) -> None:
    tasks = [asyncio.create_task(_inbound(ws, proc)), asyncio.create_task(_outbound(ws, proc))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()  # re-raise what ended the stream
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
