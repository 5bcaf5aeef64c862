"""The envd data plane: what the E2B SDKs send to a sandbox, served on the host.

A request carrying ``E2b-Sandbox-Id`` (and ``E2b-Sandbox-Port`` 49983, envd's) comes
here. It must carry the sandbox's ``X-Access-Token`` (returned by create). Served:
the Connect JSON ``process.Process`` service (``Start`` and ``Connect`` streams,
``List``, ``SendSignal``, ``SendInput``, ``StreamInput``, ``CloseStdin``, ``Update``),
the ``filesystem.Filesystem`` service (``Stat``, ``ListDir``, ``MakeDir``, ``Remove``,
``Move``, the ``WatchDir`` stream and the watcher calls), ``GET/POST /files`` and
``/health``. Any other path is a 404. A sandbox that is gone answers 502
"... was not found", as E2B's proxy does, so the SDK raises its
``SandboxNotRunningException``. Each call is for a user (`boxd.e2b._users`): the one it
names, else the sandbox's default (`Sandboxes.default_user`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hmac
import logging
import posixpath
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, cast

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from boxd import process_models as pm
from boxd.e2b import _signing as signing
from boxd.e2b._common import ENVD_PORT, boxd_error, e2b_error, state_of
from boxd.e2b._connect import (
    MAX_MESSAGE,
    ConnectError,
    decode_envelopes,
    encode_envelope,
    end_stream,
    parse_json,
    read_envelopes,
)
from boxd.e2b._fs import Watcher, absolute, fs_call
from boxd.e2b._processes import Item, Proc, connect_code
from boxd.e2b._sandboxes import HOME
from boxd.e2b._signing import operation_of
from boxd.e2b._store import SandboxRecord
from boxd.e2b._users import ROOT, files_user, invalid_user, is_unknown_user, rpc_user
from boxd.errors import BoxdError, InvalidRequest, MachineNotFound

__all__ = ["routes", "sandbox_of"]

log = logging.getLogger("boxd.e2b")

CONNECT_JSON = "application/connect+json"
#: Seconds between keepalive events on a quiet process stream (when the client names
#: none in ``Keepalive-Ping-Interval``).
KEEPALIVE = 50.0


class Gone(Exception):
    """The sandbox named by the request does not exist (any more)."""


def not_found_response(sandbox_id: str) -> JSONResponse:
    """What E2B's proxy answers for a sandbox that is gone (the SDK looks for "was not
    found")."""
    return JSONResponse({"sandboxId": sandbox_id, "code": 502,
                         "message": f"The sandbox {sandbox_id} was not found"},
                        status_code=502)


def sandbox_of(request: Request, *, signed: bool = False) -> SandboxRecord:
    """The record of the sandbox the request is for, its access token checked; with
    ``signed`` (``/files``) a request without the token may carry a signature instead
    (`boxd.e2b._signing`: E2B's ``download_url`` / ``upload_url``).

    Raises:
        Gone: no such sandbox.
        ConnectError: ``unauthenticated`` (a missing or wrong ``X-Access-Token``, or a
            missing, invalid or expired signature).
    """
    sandbox_id = request.headers.get("e2b-sandbox-id", "")
    rec = state_of(request).sandboxes.store.get(sandbox_id)
    if rec is None:
        raise Gone(sandbox_id)
    operation = operation_of(request.method) if signed else None
    if "x-access-token" not in request.headers and operation is not None:
        signing.check(request.query_params, operation, rec.token)
        return rec
    token = request.headers.get("x-access-token", "")
    if not hmac.compare_digest(token.encode(), rec.token.encode()):
        raise ConnectError("unauthenticated", "missing or wrong X-Access-Token: send the "
                           "envdAccessToken the sandbox was created with")
    return rec


Handler = Callable[[Request, SandboxRecord], Awaitable[Response]]


async def user_of(request: Request, rec: SandboxRecord, named: str | None) -> str | None:
    """Who a call is for: ``named`` (what it sent), else the sandbox's default user
    (None: root, or a container image's USER)."""
    if named is not None:
        return named
    return await state_of(request).sandboxes.default_user(rec)


def _guarded(handler: Handler, *, rpc: bool,
             signed: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """The route around ``handler``: the sandbox looked up, errors in the right shape
    (Connect's for RPC, E2B's ``{code, message}`` for ``/files``, which may be signed)."""

    async def route(request: Request) -> Response:
        sandbox_id = request.headers.get("e2b-sandbox-id", "")
        try:
            return await handler(request, sandbox_of(request, signed=signed))
        except Gone:
            return not_found_response(sandbox_id)
        except MachineNotFound:
            return not_found_response(sandbox_id)
        except ConnectError as exc:
            if rpc:
                return JSONResponse(exc.body(), status_code=exc.status)
            return e2b_error(exc.status, exc.message)
        except BoxdError as exc:
            if rpc:
                err = ConnectError(connect_code(exc), exc.message)
                return JSONResponse(err.body(), status_code=err.status)
            return boxd_error(exc)

    return route


async def _read_body(request: Request) -> bytes:
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_MESSAGE + 5:
            raise ConnectError("resource_exhausted", f"the request is over {MAX_MESSAGE} "
                               "bytes")
    return data


async def _unary_body(request: Request) -> dict[str, Any]:
    return parse_json(await _read_body(request))


async def _stream_body(request: Request) -> dict[str, Any]:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != CONNECT_JSON:
        raise ConnectError("invalid_argument", f"a streaming call is sent as {CONNECT_JSON}, "
                           f"not {kind or 'nothing'}")
    messages = decode_envelopes(await _read_body(request))
    if len(messages) != 1:
        raise ConnectError("invalid_argument", f"a server-streaming call takes one message, "
                           f"not {len(messages)}")
    return messages[0]


# -- process.Process ---------------------------------------------------------------------


def _keepalive(request: Request) -> float:
    try:
        return max(1.0, float(request.headers.get("keepalive-ping-interval", KEEPALIVE)))
    except ValueError:
        return KEEPALIVE


async def _events(proc: Proc, queue: asyncio.Queue[Item], interval: float
                  ) -> AsyncIterator[bytes]:
    """The stream's envelopes: start, then data and keepalives, then end."""
    yield encode_envelope({"event": {"start": {"pid": proc.pid}}})
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), timeout=interval)
        except TimeoutError:
            yield encode_envelope({"event": {"keepalive": {}}})
            continue
        if item is None:
            yield end_stream()
            return
        if isinstance(item, ConnectError):
            yield end_stream(item)
            return
        yield encode_envelope({"event": item})


def _stream(request: Request, proc: Proc) -> StreamingResponse:
    """The process's events as a response stream. Attached now, before the command's
    task first runs (no await in between): no output is missed."""
    interval = _keepalive(request)
    queue = proc.attach()

    async def body() -> AsyncIterator[bytes]:
        events = _events(proc, queue, interval)
        try:
            async for envelope in events:
                yield envelope
        finally:
            await cast("AsyncGenerator[bytes, None]", events).aclose()
            proc.detach(queue)

    return StreamingResponse(body(), media_type=CONNECT_JSON)


def _stream_error(exc: ConnectError) -> Response:
    return Response(end_stream(exc), media_type=CONNECT_JSON)


async def process_start(request: Request, rec: SandboxRecord) -> Response:
    try:
        msg = await _stream_body(request)
        config = msg.get("process")
        if not isinstance(config, dict) or not isinstance(config.get("cmd"), str):
            raise ConnectError("invalid_argument", "process.cmd is required")
        args = config.get("args") or []
        envs = config.get("envs") or {}
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConnectError("invalid_argument", "process.args must be strings")
        if not isinstance(envs, dict):
            raise ConnectError("invalid_argument", "process.envs must be an object")
        pty = _pty_size(msg["pty"]) if msg.get("pty") is not None else None
        cwd = config.get("cwd")
        tag = msg.get("tag")
        user = await user_of(request, rec, rpc_user(request))
        proc = state_of(request).processes.start(
            rec.account, rec.sandbox_id, [config["cmd"], *args],
            {**rec.env_vars, **{str(k): str(v) for k, v in envs.items()}},
            absolute(cwd, "cwd") if cwd else HOME, tag if isinstance(tag, str) else None,
            # An absent ``stdin`` is E2B's old default (open); boxd keeps stdin open only
            # when asked (the SDKs since 2.x send it): docs/e2b.md, "Differs".
            stdin=msg.get("stdin") is True, pty=pty, user=user)
    except ConnectError as exc:
        return _stream_error(exc)
    return _stream(request, proc)


async def process_connect(request: Request, rec: SandboxRecord) -> Response:
    try:
        msg = await _stream_body(request)
        proc = state_of(request).processes.find(rec.sandbox_id, msg.get("process"))
    except ConnectError as exc:
        return _stream_error(exc)
    return _stream(request, proc)


async def process_list(request: Request, rec: SandboxRecord) -> Response:
    await _unary_body(request)
    procs = state_of(request).processes.list(rec.sandbox_id)
    return JSONResponse({"processes": [p.info() for p in procs]})


async def process_signal(request: Request, rec: SandboxRecord) -> Response:
    msg = await _unary_body(request)
    signal = msg.get("signal")
    if signal not in ("SIGNAL_SIGKILL", "SIGNAL_SIGTERM", 9, 15):
        raise ConnectError("invalid_argument", "signal must be SIGNAL_SIGKILL or "
                           "SIGNAL_SIGTERM")
    await state_of(request).processes.kill(rec.sandbox_id, msg.get("process"))
    return JSONResponse({})


def _pty_size(pty: object) -> tuple[int, int]:
    """A ``PTY`` message's ``size`` as (rows, cols).

    Raises:
        ConnectError: ``invalid_argument`` for a missing size or one outside 1-65535.
    """
    size = pty.get("size") if isinstance(pty, dict) else None
    dims = (size.get("rows"), size.get("cols")) if isinstance(size, dict) else (None, None)
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 65536
               for n in dims):
        raise ConnectError("invalid_argument", "pty.size needs rows and cols of 1-65535")
    return cast("tuple[int, int]", dims)


def _input(msg: dict[str, Any]) -> tuple[str, bytes]:
    """A ``ProcessInput``'s kind (``stdin`` or ``pty``) and bytes.

    Raises:
        ConnectError: ``invalid_argument`` unless it is one of them, in base64.
    """
    given = msg.get("input")
    kinds = [k for k in ("stdin", "pty") if isinstance(given, dict) and k in given]
    if len(kinds) != 1 or not isinstance(cast("dict[str, Any]", given)[kinds[0]], str):
        raise ConnectError("invalid_argument", "input must be {\"stdin\": <base64>} or "
                           "{\"pty\": <base64>}")
    try:
        data = base64.b64decode(cast("dict[str, str]", given)[kinds[0]], validate=True)
    except ValueError as exc:
        raise ConnectError("invalid_argument", "input is not base64") from exc
    return kinds[0], data


async def process_send_input(request: Request, rec: SandboxRecord) -> Response:
    msg = await _unary_body(request)
    kind, data = _input(msg)
    await state_of(request).processes.send(rec.sandbox_id, msg.get("process"),
                                           pm.ExecInput(data=data), kind)
    return JSONResponse({})


async def process_close_stdin(request: Request, rec: SandboxRecord) -> Response:
    msg = await _unary_body(request)
    await state_of(request).processes.send(rec.sandbox_id, msg.get("process"),
                                           pm.ExecInput(eof=True))
    return JSONResponse({})


async def process_update(request: Request, rec: SandboxRecord) -> Response:
    msg = await _unary_body(request)
    if msg.get("pty") is None:
        return JSONResponse({})  # nothing to change
    size = _pty_size(msg["pty"])
    await state_of(request).processes.send(rec.sandbox_id, msg.get("process"),
                                           pm.ExecInput(size=size))
    return JSONResponse({})


async def process_stream_input(request: Request, rec: SandboxRecord) -> Response:
    """Client streaming: a ``start`` naming the process, then ``data`` and ``keepalive``
    messages, each handed on as it arrives (a slow command holds the upload)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != CONNECT_JSON:
        return _stream_error(ConnectError("invalid_argument", "a streaming call is sent "
                                          f"as {CONNECT_JSON}"))
    processes = state_of(request).processes
    selector: dict[str, Any] | None = None
    try:
        async for msg in read_envelopes(request.stream()):
            if isinstance(msg.get("start"), dict):
                selector = msg["start"].get("process")
                processes.find(rec.sandbox_id, selector)
            elif isinstance(msg.get("data"), dict):
                if selector is None:
                    raise ConnectError("invalid_argument", "the first message must be "
                                       "start {process}")
                kind, data = _input(msg["data"])
                await processes.send(rec.sandbox_id, selector, pm.ExecInput(data=data),
                                     kind)
    except ConnectError as exc:
        return _stream_error(exc)
    return Response(encode_envelope({}) + end_stream(), media_type=CONNECT_JSON)


# -- filesystem.Filesystem ---------------------------------------------------------------


# As envd, which runs as root: stat, list and remove act as root and only check a user
# the call names; mkdir and move make directories the call's user owns.


async def fs_stat(request: Request, rec: SandboxRecord) -> Response:
    path = absolute((await _unary_body(request)).get("path"))
    machines = state_of(request).sandboxes.machines
    return JSONResponse(await fs_call(machines, rec.account, rec.sandbox_id, "stat", path,
                                      user=rpc_user(request)))


async def fs_list(request: Request, rec: SandboxRecord) -> Response:
    msg = await _unary_body(request)
    depth = msg.get("depth", 1) or 1
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 64:
        raise ConnectError("invalid_argument", "depth must be 1-64")
    machines = state_of(request).sandboxes.machines
    return JSONResponse(await fs_call(machines, rec.account, rec.sandbox_id, "list",
                                      absolute(msg.get("path")), str(depth),
                                      user=rpc_user(request)))


async def fs_make_dir(request: Request, rec: SandboxRecord) -> Response:
    path = absolute((await _unary_body(request)).get("path"))
    machines = state_of(request).sandboxes.machines
    user = await user_of(request, rec, rpc_user(request))
    return JSONResponse(await fs_call(machines, rec.account, rec.sandbox_id, "mkdir", path,
                                      user=user))


async def fs_remove(request: Request, rec: SandboxRecord) -> Response:
    path = absolute((await _unary_body(request)).get("path"))
    machines = state_of(request).sandboxes.machines
    return JSONResponse(await fs_call(machines, rec.account, rec.sandbox_id, "remove", path,
                                      user=rpc_user(request)))


async def fs_move(request: Request, rec: SandboxRecord) -> Response:
    msg = await _unary_body(request)
    src = absolute(msg.get("source"), "source")
    dst = absolute(msg.get("destination"), "destination")
    machines = state_of(request).sandboxes.machines
    user = await user_of(request, rec, rpc_user(request))
    return JSONResponse(await fs_call(machines, rec.account, rec.sandbox_id, "move", src,
                                      dst, user=user))


# -- /files, /health ---------------------------------------------------------------------


async def files_get(request: Request, rec: SandboxRecord) -> Response:
    """The file, read as root whoever the call is for, as envd reads it; a user the
    call names must exist (an exec to find out, unless it is root or the default)."""
    path = absolute(request.query_params.get("path"))
    sandboxes = state_of(request).sandboxes
    named = files_user(request)
    if named is not None and named not in (ROOT, await sandboxes.default_user(rec)) and \
            not await sandboxes.has_user(rec, named):
        raise invalid_user(named)
    machines = sandboxes.machines
    chunks = aiter(machines.download(rec.account, rec.sandbox_id, path))
    # The first chunk before the answer: a missing file gets its 404, not a 200.
    try:
        first: bytes | None = await anext(chunks)
    except StopAsyncIteration:
        first = None

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield first
                async for chunk in chunks:
                    yield chunk
        finally:
            await cast("AsyncGenerator[bytes, None]", chunks).aclose()

    return StreamingResponse(body(), media_type="application/octet-stream")


async def _gunzip(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    async for chunk in stream:
        # Bounded output per step: a small compressed body cannot balloon in memory.
        data = inflate.decompress(chunk, 1 << 20)
        while data:
            yield data
            data = inflate.decompress(inflate.unconsumed_tail, 1 << 20)
    if not inflate.eof:
        raise ConnectError("invalid_argument", "the gzip body is truncated")


async def _upload_chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    await upload.seek(0)  # from the start again when an upload is retried
    while chunk := await upload.read(1 << 20):
        yield chunk


async def _upload(request: Request, rec: SandboxRecord, path: str,
                  body: Callable[[], AsyncIterator[bytes]], named: str | None,
                  replayable: Callable[[], bool]) -> None:
    """Write one uploaded file (``body()``'s chunks) owned by the call's user, as envd
    leaves it. A guest that cannot give the default user a file (an agent older than
    protocol 1.8 in a sandbox restored from an older snapshot) gets it as root's, as
    before boxd knew users, when the body can be sent again.

    Raises:
        ConnectError: ``unauthenticated`` for a named user the guest lacks.
    """
    machines = state_of(request).sandboxes.machines
    user = await user_of(request, rec, named)
    if user == ROOT:
        user = None  # the agent writes as root: no owner to give (any agent can)
    try:
        await machines.upload(rec.account, rec.sandbox_id, path, body(), user=user)
    except InvalidRequest as exc:
        if not is_unknown_user(exc) or user is None:
            raise
        if named is not None:
            raise invalid_user(named, exc.message) from None
        if not replayable():
            raise
        log.warning("sandbox %s: upload of %s as root: %s", rec.sandbox_id, path,
                    exc.message)
        await machines.upload(rec.account, rec.sandbox_id, path, body())


async def files_post(request: Request, rec: SandboxRecord) -> Response:
    query_path = request.query_params.get("path")
    named = files_user(request)
    written: list[dict[str, str]] = []
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        async with request.form(max_files=1000) as form:
            uploads = [v for k, v in form.multi_items()
                       if k == "file" and isinstance(v, UploadFile)]
            if not uploads:
                raise ConnectError("invalid_argument", "no multipart field 'file'")
            for upload in uploads:
                name = query_path if len(uploads) == 1 and query_path else upload.filename
                path = absolute(name)
                await _upload(request, rec, path, functools.partial(_upload_chunks, upload),
                              named, lambda: True)
                written.append({"name": posixpath.basename(path), "type": "file",
                                "path": path})
    else:
        path = absolute(query_path)
        stream: AsyncIterator[bytes] = request.stream()
        if request.headers.get("content-encoding", "").lower() == "gzip":
            stream = _gunzip(stream)
        started = False

        async def body() -> AsyncIterator[bytes]:
            nonlocal started
            async for chunk in stream:
                started = True
                yield chunk

        await _upload(request, rec, path, body, named, lambda: not started)
        written.append({"name": posixpath.basename(path), "type": "file", "path": path})
    return JSONResponse(written)


async def health(request: Request, rec: SandboxRecord) -> Response:
    return Response(status_code=204)


def _rpc(name: str, handler: Handler) -> Route:
    return Route(f"/{name}", _guarded(handler, rpc=True), methods=["POST"])


async def _watch(request: Request, rec: SandboxRecord, msg: dict[str, Any]) -> Watcher:
    recursive = msg.get("recursive", False)
    if not isinstance(recursive, bool):
        raise ConnectError("invalid_argument", "recursive must be true or false")
    return await state_of(request).watchers.create(
        state_of(request).sandboxes.machines, rec.account, rec.sandbox_id,
        absolute(msg.get("path")), recursive, rpc_user(request))


async def fs_watch_dir(request: Request, rec: SandboxRecord) -> Response:
    """A stream of the directory's changes: start, then each event as it is seen."""
    try:
        watcher = await _watch(request, rec, await _stream_body(request))
    except ConnectError as exc:
        return _stream_error(exc)
    except BoxdError as exc:
        return _stream_error(ConnectError(connect_code(exc), exc.message))
    watchers, interval = state_of(request).watchers, _keepalive(request)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield encode_envelope({"start": {}})
            while not watcher.ended:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(watcher.changed.wait(), interval)
                events = watcher.take()
                for event in events:
                    yield encode_envelope({"filesystem": event})
                if not events and not watcher.ended:
                    yield encode_envelope({"keepalive": {}})
            yield end_stream(ConnectError("unavailable", "watching stopped (the sandbox "
                                          "is gone or stopped answering)"))
        finally:
            with contextlib.suppress(ConnectError):
                await watchers.remove(rec.sandbox_id, watcher.id)

    return StreamingResponse(body(), media_type=CONNECT_JSON)


async def fs_create_watcher(request: Request, rec: SandboxRecord) -> Response:
    watcher = await _watch(request, rec, await _unary_body(request))
    return JSONResponse({"watcherId": watcher.id})


async def fs_watcher_events(request: Request, rec: SandboxRecord) -> Response:
    msg = await _unary_body(request)
    watcher = state_of(request).watchers.get(rec.sandbox_id, msg.get("watcherId"))
    return JSONResponse({"events": watcher.take()})


async def fs_remove_watcher(request: Request, rec: SandboxRecord) -> Response:
    msg = await _unary_body(request)
    await state_of(request).watchers.remove(rec.sandbox_id, msg.get("watcherId"))
    return JSONResponse({})

routes = [
    _rpc("process.Process/Start", process_start),
    _rpc("process.Process/Connect", process_connect),
    _rpc("process.Process/List", process_list),
    _rpc("process.Process/SendSignal", process_signal),
    _rpc("process.Process/SendInput", process_send_input),
    _rpc("process.Process/CloseStdin", process_close_stdin),
    _rpc("process.Process/Update", process_update),
    _rpc("process.Process/StreamInput", process_stream_input),
    _rpc("filesystem.Filesystem/Stat", fs_stat),
    _rpc("filesystem.Filesystem/ListDir", fs_list),
    _rpc("filesystem.Filesystem/MakeDir", fs_make_dir),
    _rpc("filesystem.Filesystem/Remove", fs_remove),
    _rpc("filesystem.Filesystem/Move", fs_move),
    _rpc("filesystem.Filesystem/WatchDir", fs_watch_dir),
    _rpc("filesystem.Filesystem/CreateWatcher", fs_create_watcher),
    _rpc("filesystem.Filesystem/GetWatcherEvents", fs_watcher_events),
    _rpc("filesystem.Filesystem/RemoveWatcher", fs_remove_watcher),
    Route("/files", _guarded(files_get, rpc=False, signed=True), methods=["GET"]),
    Route("/files", _guarded(files_post, rpc=False, signed=True), methods=["POST"]),
    Route("/health", _guarded(health, rpc=False), methods=["GET"]),
]


def port_of(request: Request) -> int | None:
    """The ``E2b-Sandbox-Port`` of a data-plane request (None if absent or malformed)."""
    with contextlib.suppress(ValueError):
        return int(request.headers.get("e2b-sandbox-port", ENVD_PORT))
    return None
