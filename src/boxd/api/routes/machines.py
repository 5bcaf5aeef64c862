"""``/v1/machines``: create, inspect, exec, files, fork, checkpoints, delete."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, cast

from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from pydantic import StringConstraints

from boxd import models
from boxd.api.auth import Account
from boxd.api.errors import ERROR_RESPONSES, ErrorResponse, error_body
from boxd.api.routes._deps import BINARY_BODY, BINARY_RESPONSE, Machines, check_name
from boxd.errors import BoxdError, InvalidRequest

router = APIRouter(prefix="/machines", tags=["machines"], responses=ERROR_RESPONSES)
log = logging.getLogger("boxd.api")

MAX_FORK_BATCH = 64
NDJSON = "application/x-ndjson"
#: Seconds `GET ./execs/{exec_id}` may wait for a running exec.
MAX_EXEC_RESULT_WAIT = 600.0

#: The ``Idempotency-Key`` header of create and fork.
IdempotencyKey = Annotated[
    str | None,
    Header(alias="Idempotency-Key", min_length=1, max_length=255,
           pattern=models.IDEMPOTENCY_KEY_PATTERN,
           description="a key of the logical request (e.g. a UUID), the same on each of "
           "its retries: a retry within 24 h returns the first request's machines, never "
           "new ones; waits for the first if it still runs; a key sent with another "
           "request is a 409 idempotency_key_reused; a failed request frees its key"),
]


@router.post(
    "", response_model=models.Machine, status_code=status.HTTP_201_CREATED
)
async def create_machine(
    body: models.MachineCreate, account: Account, machines: Machines,
    idempotency_key: IdempotencyKey = None,
) -> models.Machine:
    """Create and boot a machine (returns while it is still starting)."""
    check_name(body.name)
    return await machines.create(account, body, idempotency_key=idempotency_key)


#: One ``KEY=VALUE`` of a selector, as the schema states it (`models.LABEL_RULE`).
LABEL_SELECTOR_PATTERN = (models.LABEL_KEY_PATTERN.removesuffix("$") + "="
                          + models.LABEL_VALUE_PATTERN.removeprefix("^"))
LabelQuery = Annotated[
    list[Annotated[str, StringConstraints(pattern=LABEL_SELECTOR_PATTERN)]] | None,
    Query(description="KEY=VALUE; repeat it: a machine must carry every label given",
          max_length=models.MAX_LABELS),
]
StateQuery = Annotated[models.MachineState | None, Query(description="only machines in "
                                                           "this state")]


def _selector(label: list[str] | None) -> dict[str, str] | None:
    """``["k=v", ...]`` as a mapping; None when no machine can match it (one key asked
    with two values: a machine has one value per key). The same item twice is once.

    Raises:
        InvalidRequest: an item without '='.
    """
    out: dict[str, str] = {}
    for item in label or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise InvalidRequest(f"label {item[:140]!r} is not KEY=VALUE", field="label",
                                 hint="e.g. label=boxd.rl/run=r-1a2b")
        if out.setdefault(key, value) != value:
            return None
    return out


@router.get("", response_model=models.MachineList)
async def list_machines(
    account: Account,
    machines: Machines,
    label: LabelQuery = None,
    state: StateQuery = None,
    limit: Annotated[int, Query(ge=1, le=models.MAX_LIST_LIMIT,
                                description="machines per page")] = models.DEFAULT_LIST_LIMIT,
    cursor: Annotated[str | None, Query(max_length=512, description="a page's next_cursor: "
                                        "the page after it")] = None,
) -> models.MachineList:
    """The account's machines, oldest first, a page at a time (``next_cursor`` is set
    while more follow); ``label`` and ``state`` select."""
    selector = _selector(label)
    if selector is None:
        return models.MachineList(machines=[], next_cursor=None)
    return await machines.list_page(account, labels=selector, state=state,
                                    limit=limit, cursor=cursor)


@router.delete("", response_model=models.MachinesDeleted)
async def delete_machines(
    account: Account, machines: Machines,
    label: Annotated[list[Annotated[str, StringConstraints(pattern=LABEL_SELECTOR_PATTERN)]],
                     Query(description="KEY=VALUE; repeat it: a machine must carry every "
                           "label given (at least one)", min_length=1,
                           max_length=models.MAX_LABELS)],
    state: StateQuery = None,
) -> models.MachinesDeleted:
    """Delete every machine that carries all the labels given (at least one: an empty
    selector is refused) and is in ``state`` if given: what was deleted, and each
    machine that could not be with its error."""
    out = models.MachinesDeleted(deleted=[])
    selector = _selector(label)
    if selector is None:
        return out
    for ref, err in await machines.delete_many(account, selector, state):
        if err is None:
            out.deleted.append(ref)
        else:
            if not isinstance(err, BoxdError):
                log.error("delete of %s failed", ref.id, exc_info=err)
            out.errors.append(models.DeleteItemError(machine=ref, error=error_body(err)))
    return out


@router.get("/{ref}", response_model=models.Machine)
async def get_machine(ref: str, account: Account, machines: Machines) -> models.Machine:
    """One machine by name or id."""
    return await machines.get(account, ref)


@router.delete("/{ref}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
async def delete_machine(ref: str, account: Account, machines: Machines) -> Response:
    """Stop the machine and remove its files."""
    await machines.delete(account, ref)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/{ref}/suspend", response_model=models.Machine)
async def suspend_machine(ref: str, account: Account, machines: Machines) -> models.Machine:
    """Stop the machine's vCPUs; its memory stays resident. Any request wakes it."""
    return await machines.suspend(account, ref)


@router.post("/{ref}/hibernate", response_model=models.Machine)
async def hibernate_machine(ref: str, account: Account, machines: Machines) -> models.Machine:
    """Write memory and device state to disk and end the VM. Any request wakes it."""
    return await machines.hibernate(account, ref)


@router.post("/{ref}/timeout", response_model=models.Machine)
async def set_timeout(
    ref: str, body: models.SetTimeout, account: Account, machines: Machines
) -> models.Machine:
    """Give the machine a new end, ``timeout`` seconds from now (``null``: no lifetime;
    it runs until deleted). At its end it is deleted, or hibernated with
    ``on_timeout: "hibernate"`` (omitted: what it was)."""
    return await machines.set_timeout(account, ref, body.timeout, body.on_timeout)


@router.post("/{ref}/resume", response_model=models.Machine)
async def resume_machine(ref: str, account: Account, machines: Machines) -> models.Machine:
    """Wake a suspended or hibernated machine."""
    return await machines.resume(account, ref)


@router.post("/{ref}/wait", response_model=models.Machine)
async def wait_until_ready(
    ref: str,
    account: Account,
    machines: Machines,
    timeout: Annotated[float, Query(gt=0, le=3600, description="seconds")] = 60.0,
) -> models.Machine:
    """Wait until the machine's agent answers."""
    return await machines.wait_until_ready(account, ref, timeout)


@router.post(
    "/{ref}/exec",
    response_model=models.ExecResult,
    responses={408: {"model": ErrorResponse,
                     "description": "exec_timeout; partial output in details"}},
)
async def exec_command(
    ref: str, body: models.ExecRequest, account: Account, machines: Machines
) -> models.ExecResult:
    """Run a command to completion."""
    return await machines.exec(account, ref, body)


@router.get("/{ref}/execs", response_model=models.ExecList)
async def exec_list(
    ref: str,
    account: Account,
    machines: Machines,
    limit: Annotated[int, Query(ge=1, le=models.MAX_EXEC_LIST,
                                description="execs to list")] = models.DEFAULT_EXEC_LIST,
) -> models.ExecList:
    """The machine's last ``limit`` kept execs, newest first, without their output (the
    node keeps each 15 minutes after it ends, the last 64 per machine)."""
    return models.ExecList(execs=await machines.exec_list(account, ref, limit))


@router.get("/{ref}/execs/{exec_id}", response_model=models.ExecStatus)
async def exec_result(
    ref: str,
    exec_id: Annotated[str, PathParam(min_length=1, max_length=models.EXEC_ID_MAX,
                                 pattern=models.EXEC_ID_PATTERN)],
    account: Account,
    machines: Machines,
    wait: Annotated[float, Query(ge=0, le=MAX_EXEC_RESULT_WAIT,
                                 description="seconds to wait for a running exec to end")] = 0.0,
) -> models.ExecStatus:
    """A durable exec's output (the last MiB of each stream) and exit: a running one is
    waited for up to ``wait`` seconds, then answered with ``running: true``."""
    return await machines.exec_result(account, ref, exec_id, wait)


#: Seconds `GET ./logs` may wait for more output.
MAX_LOGS_WAIT = 60.0


@router.get("/{ref}/logs", response_model=models.ServiceLog)
async def logs(
    ref: str, account: Account, machines: Machines,
    after: Annotated[int | None, Query(ge=0, le=2**62, description="the offset to read "
                                       "after (the last answer's end); absent: all "
                                       "that is kept")] = None,
    wait: Annotated[float, Query(ge=0, le=MAX_LOGS_WAIT, description="seconds to wait "
                                 "for more when there is none after the offset")] = 0.0,
) -> models.ServiceLog:
    """The machine's service output (its image's ENTRYPOINT + CMD; stdout and stderr as
    written) after offset ``after``; the node keeps the last 64 KiB. 404 without a
    service."""
    return await machines.logs(account, ref, after, wait)


@router.get("/{ref}/metrics", response_model=models.MachineMetrics)
async def metrics(
    ref: str, account: Account, machines: Machines,
    start: Annotated[float | None, Query(ge=0, le=2**40, description="the oldest sample "
                                         "to answer (Unix time); absent: all kept")] = None,
    end: Annotated[float | None, Query(ge=0, le=2**40, description="the newest sample to "
                                       "answer (Unix time); absent: up to now")] = None,
) -> models.MachineMetrics:
    """The machine's recent CPU, memory and disk samples, read inside its guest: one is
    taken now if it runs, and it is sampled every 5 s for the next 5 minutes; the node
    keeps the last 120. A machine that does not run is not woken: its kept samples
    (maybe none) are answered. docs/http-api.md has the fields."""
    return await machines.metrics(account, ref, start, end)


def _line(event: models.ExecEvent) -> bytes:
    return (event.model_dump_json(exclude_none=True) + "\n").encode()


@router.post(
    "/{ref}/exec/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "one ExecEvent per line (NDJSON): stdout/stderr as they arrive, "
            "then one 'exit' event (or one 'error' event if the stream fails midway)",
            "content": {NDJSON: {"schema": {"$ref": "#/components/schemas/ExecEvent"}}},
        }
    },
)
async def exec_stream(
    ref: str, body: models.ExecRequest, account: Account, machines: Machines
) -> StreamingResponse:
    """Run a command and stream its output as NDJSON."""
    events = aiter(machines.exec_stream(account, ref, body))
    # Pull the first event before answering, so an unknown machine or a dead VM still gets
    # its proper status instead of a 200 followed by an error line.
    try:
        first: models.ExecEvent | None = await anext(events)
    except StopAsyncIteration:
        first = None

    async def lines() -> AsyncIterator[bytes]:
        try:
            if first is None:
                return
            yield _line(first)
            async for event in events:
                yield _line(event)
        except BoxdError as exc:
            yield _line(models.ExecEvent(type="error", error=error_body(exc)))
        except Exception as exc:
            log.exception("exec stream failed", exc_info=exc)
            yield _line(models.ExecEvent(type="error", error=error_body(exc)))
        finally:
            # The client may be gone (this generator is closed or cancelled): closing the
            # events now kills the command in the guest, instead of whenever the
            # generator is collected.
            await cast("AsyncGenerator[models.ExecEvent, None]", events).aclose()

    return StreamingResponse(lines(), media_type=NDJSON)


# _check_path enforces the pattern (its 400 says "must be absolute"); the schema states it.
Path_ = Annotated[
    str, Query(min_length=1, max_length=4096, description="absolute path in the machine",
               json_schema_extra={"pattern": models.GUEST_PATH_PATTERN})
]
CheckpointName = Annotated[
    str, PathParam(description="checkpoint name", json_schema_extra=models.NAME_SCHEMA)
]


def _check_path(path: str) -> None:
    if not path.startswith("/") or "\x00" in path:
        raise InvalidRequest(
            f"path must be absolute: {path!r}", hint="e.g. /home/boxd/file.txt", field="path"
        )


@router.put("/{ref}/files", response_model=models.FileInfo, openapi_extra=BINARY_BODY)
async def upload_file(
    ref: str,
    request: Request,
    path: Path_,
    account: Account,
    machines: Machines,
    mode: Annotated[int, Query(ge=0, le=0o7777, description="permission bits, decimal "
                                                               "(420 = 0o644)")] = 0o644,
    user: Annotated[models.GuestUser | None, Query(
        description="the file's owner (and that of the parents the upload makes): "
        "NAME[:GROUP] or UID[:GID] from the machine's /etc/passwd and /etc/group; "
        "default: root")] = None,
) -> models.FileInfo:
    """Write the request body to a file in the machine (parents are created).

    The body is streamed to the guest as it arrives (at most BOXD_MAX_UPLOAD bytes)."""
    _check_path(path)
    return await machines.upload(account, ref, path, request.stream(), mode, user)


@router.get(
    "/{ref}/files", response_class=StreamingResponse, responses={200: BINARY_RESPONSE}
)
async def download_file(
    ref: str, path: Path_, account: Account, machines: Machines
) -> StreamingResponse:
    """Read a regular file from the machine, streamed as the client reads it.

    Devices and fifos are refused (400). A transfer that fails midway (the machine died,
    the data failed its digest) ends the connection before the body's end."""
    _check_path(path)
    chunks = aiter(machines.download(account, ref, path))
    # Pull the first chunk before answering, so a missing file, a directory or a device
    # gets its status instead of a 200 with an empty body.
    try:
        first: bytes | None = await anext(chunks)
    except StopAsyncIteration:
        first = None

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is None:
                return
            yield first
            async for chunk in chunks:
                yield chunk
        except Exception as exc:
            log.warning("download of %s from %s failed midway: %s", path, ref, exc)
            raise
        finally:
            await cast("AsyncGenerator[bytes, None]", chunks).aclose()

    return StreamingResponse(body(), media_type="application/octet-stream")


def _items(result: object) -> list[models.Machine | Exception]:
    # The stub's return annotation names ``list`` inside a class that defines ``list``.
    return cast("list[models.Machine | Exception]", result)


@router.post("/{ref}/fork", response_model=models.Machine, status_code=status.HTTP_201_CREATED)
async def fork(
    ref: str, account: Account, machines: Machines, body: models.ForkRequest | None = None,
    idempotency_key: IdempotencyKey = None,
) -> models.Machine:
    """Fork one running machine into one child."""
    name = body.name if body is not None else None
    check_name(name)
    node = body.node if body is not None else None
    body = body or models.ForkRequest.model_validate({})
    (item,) = _items(await machines.fork(account, ref, [name], node, body.labels,
                                         idempotency_key=idempotency_key,
                                         timeout=body.timeout,
                                         on_timeout=body.on_timeout or "delete",
                                         wait=body.wait))
    if isinstance(item, Exception):
        raise item
    return item


@router.post("/{ref}/warm", response_model=models.Standby)
async def warm(
    ref: str, body: models.WarmRequest, account: Account, machines: Machines
) -> models.Standby:
    """Prepare ``forks`` standby forks of the machine's current state and return once
    they are ready: the next that many forks of the unchanged machine are claims, not
    starts. A change to the machine (an exec, an upload, a restore) discards them;
    ``forks: 0`` releases them. They are not the account's machines (no quota) until a
    fork claims one, but an account holds no more than its quota would let it claim, and
    at most its share of the node's (507 otherwise, saying which bound and what to do)."""
    return await machines.warm(account, ref, body.forks)


@router.post("/{ref}/fork/batch", response_model=models.ForkResult)
async def fork_batch(
    ref: str, body: models.ForkBatchRequest, account: Account, machines: Machines,
    idempotency_key: IdempotencyKey = None,
) -> models.ForkResult:
    """Fork one machine into many children; each item is a child or its error."""
    names: list[str | None]
    if body.names is not None:
        if body.count is not None and body.count != len(body.names):
            raise InvalidRequest(
                f"count {body.count} does not match the {len(body.names)} names given",
                hint="give names or count, or make them agree", field="count",
            )
        if not 1 <= len(body.names) <= MAX_FORK_BATCH:
            raise InvalidRequest(
                f"a batch forks 1-{MAX_FORK_BATCH} children", hint="split the batch",
                field="names",
            )
        for n in body.names:
            check_name(n, "names")
        if len(set(body.names)) != len(body.names):
            raise InvalidRequest("names repeat", hint="give each child its own name",
                                 field="names")
        names = list(body.names)
    elif body.count is not None:
        names = [None] * body.count
    else:
        raise InvalidRequest("give count or names", hint='e.g. {"count": 8}', field="count")
    items = _items(await machines.fork(account, ref, names, body.node, body.labels,
                                      idempotency_key=idempotency_key, timeout=body.timeout,
                                      on_timeout=body.on_timeout or "delete",
                                      wait=body.wait))
    children = []
    for item in items:
        if isinstance(item, models.Machine):
            children.append(models.ForkItem(machine=item))
        else:
            if not isinstance(item, BoxdError):
                log.error("fork child failed", exc_info=item)
            children.append(models.ForkItem(error=error_body(item)))
    return models.ForkResult(children=children)


@router.post(
    "/{ref}/checkpoints", response_model=models.Checkpoint, status_code=status.HTTP_201_CREATED
)
async def save_checkpoint(
    ref: str, body: models.CheckpointCreate, account: Account, machines: Machines
) -> models.Checkpoint:
    """Save a checkpoint of the machine."""
    check_name(body.name)
    return await machines.checkpoint_save(account, ref, body.name)


@router.get("/{ref}/checkpoints", response_model=models.CheckpointList)
async def list_checkpoints(
    ref: str, account: Account, machines: Machines
) -> models.CheckpointList:
    """The machine's checkpoints."""
    return models.CheckpointList(checkpoints=await machines.checkpoint_list(account, ref))


@router.post("/{ref}/checkpoints/{name}/restore", response_model=models.Machine)
async def restore_checkpoint(
    ref: str, name: CheckpointName, account: Account, machines: Machines
) -> models.Machine:
    """Rewind the machine in place to a checkpoint."""
    return await machines.checkpoint_restore(account, ref, name)


@router.delete(
    "/{ref}/checkpoints/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response
)
async def delete_checkpoint(
    ref: str, name: CheckpointName, account: Account, machines: Machines
) -> Response:
    """Delete a checkpoint."""
    await machines.checkpoint_delete(account, ref, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
