"""E2B's control API: sandboxes created, listed, timed, paused, woken, forked, killed.

Routes parse E2B's camelCase JSON and call `Sandboxes`; every answer is E2B's shape
and every error ``{"code": <status>, "message"}``. The key comes in ``X-API-KEY`` (an
``e2b_<hex>`` spelling of a boxd key, or the boxd key itself).
"""

from __future__ import annotations

import datetime
import json
import urllib.parse
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from boxd import models
from boxd.e2b._common import iso, sandbox_json, state_of
from boxd.e2b._sandboxes import BASE_TEMPLATE, MAX_FORKS, check_timeout
from boxd.e2b.env import from_e2b_key
from boxd.errors import BoxdError, InvalidRequest, NotFound
from boxd.services import SnapshotService

__all__ = ["DEFAULT_TIMEOUT", "routes"]

#: A sandbox's lifetime when the create request gives none: E2B's documented default of
#: 5 minutes (SDK 2.63 sends no timeout unless the caller gives one; older ones send 300).
DEFAULT_TIMEOUT = 300
#: Sandboxes one list page holds at most (E2B's limit).
MAX_PAGE = 100
_MAX_BODY = 1 << 20


def account_of(request: Request) -> str:
    """The account whose key the request carries.

    Raises:
        AuthError: no key, or an unknown or revoked one.
    """
    key = request.headers.get("x-api-key")
    if key is None:
        scheme, _, rest = request.headers.get("authorization", "").partition(" ")
        key = rest.strip() if scheme.lower() == "bearer" else None
    secret = (from_e2b_key(key) or key) if key else None
    return state_of(request).authenticate(secret)


async def body_of(request: Request) -> dict[str, Any]:
    """The JSON object of the request (``{}`` when empty).

    Raises:
        InvalidRequest: not a JSON object, or over 1 MiB.
    """
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > _MAX_BODY:
            raise InvalidRequest("the request body is over 1 MiB", field="body")
    if not data.strip():
        return {}
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise InvalidRequest(f"the body is not JSON: {exc}", field="body") from exc
    if not isinstance(value, dict):
        raise InvalidRequest("the body must be a JSON object", field="body")
    return value


def _strings(value: object, field: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidRequest(f"{field} must be an object of strings", field=field)
    return dict(value)


def _bool(value: object, field: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{field} must be true or false", field=field)
    return value


#: E2B's "all traffic" CIDR (``e2b.ALL_TRAFFIC``): in ``denyOut``, deny what is not allowed.
ALL_TRAFFIC = "0.0.0.0/0"
#: Fields of E2B's ``network`` that boxd's egress policy has no counterpart for.
_NETWORK_UNSUPPORTED = ("rules", "egressProxy", "dnsServers", "maskRequestHost",
                        "httpsPorts")


def network_egress(network: object) -> list[str] | None:
    """A create's ``network`` ({allowOut, denyOut}) as boxd's egress allow-list (None:
    every public address, boxd's default).

    E2B allows what ``allowOut`` lists even where ``denyOut`` denies it, and everything
    when nothing is denied; boxd's policy is an allow-list. So ``denyOut: [0.0.0.0/0]``
    with ``allowOut: [...]`` is that allow-list (without ``allowOut``: nothing), no
    ``denyOut`` is the default, and a ``denyOut`` of particular addresses (a deny-list)
    has no counterpart. ``allowPublicTraffic`` is not served (docs/e2b.md).

    Raises:
        InvalidRequest: a deny-list, a field boxd has no counterpart for, a bad shape.
    """
    if network is None:
        return None
    if not isinstance(network, dict):
        raise InvalidRequest("network must be an object", field="network")
    for name in _NETWORK_UNSUPPORTED:
        if network.get(name):
            raise InvalidRequest(f"network.{name} is not supported by boxd",
                                 field=f"network.{name}", hint="docs/e2b.md lists what is")
    allow, deny = network.get("allowOut"), network.get("denyOut")
    for name, value in (("allowOut", allow), ("denyOut", deny)):
        if value is not None and (not isinstance(value, list)
                                  or not all(isinstance(v, str) for v in value)):
            raise InvalidRequest(f"network.{name} must be a list of addresses",
                                 field=f"network.{name}")
    if not deny:
        return None
    if ALL_TRAFFIC not in deny:
        raise InvalidRequest(
            "network.denyOut of particular addresses is not supported: boxd's egress "
            "policy is an allow-list", field="network.denyOut",
            hint=f"deny {ALL_TRAFFIC} and list what may be reached in allowOut")
    return list(allow or [])


async def create(request: Request) -> Response:
    """``POST /sandboxes`` and ``/v2/sandboxes``."""
    account = account_of(request)
    body = await body_of(request)
    template = body.get("templateID", BASE_TEMPLATE)
    if not isinstance(template, str) or not template:
        raise InvalidRequest("templateID must be a template name", field="templateID")
    timeout = check_timeout(body.get("timeout", DEFAULT_TIMEOUT))
    key = request.headers.get("idempotency-key")
    if key is not None and not 1 <= len(key) <= 256:
        raise InvalidRequest("Idempotency-Key must have 1-256 characters",
                             field="Idempotency-Key")
    sandbox = await state_of(request).sandboxes.create(
        account, template, timeout,
        metadata=_strings(body.get("metadata"), "metadata"),
        env_vars=_strings(body.get("envVars"), "envVars"),
        auto_pause=_bool(body.get("autoPause"), "autoPause", False),
        isolated=not _bool(body.get("allow_internet_access"), "allow_internet_access", True),
        egress=network_egress(body.get("network")), idempotency_key=key,
    )
    return JSONResponse(sandbox_json(sandbox, domain=state_of(request).domain),
                        status_code=201)


async def get_one(request: Request) -> Response:
    """``GET /sandboxes/{id}``."""
    sandbox = await state_of(request).sandboxes.get(account_of(request),
                                                    request.path_params["id"])
    return JSONResponse(sandbox_json(sandbox, detail=True, domain=state_of(request).domain))


def _metadata_filter(text: str | None) -> dict[str, str]:
    # The SDK sends metadata=urlencode({quote(k): quote(v)}): unquote twice.
    if not text:
        return {}
    return {urllib.parse.unquote(k): urllib.parse.unquote(v)
            for k, v in urllib.parse.parse_qsl(text, keep_blank_values=True)}


def _states(text: str | None, default: tuple[str, ...]) -> set[str]:
    if not text:
        return set(default)
    states = {s.strip() for s in text.split(",") if s.strip()}
    if not states <= {"running", "paused"}:
        raise InvalidRequest(f"state must be running and/or paused, not {text!r}",
                             field="state")
    return states


def _limit(text: str | None) -> int:
    if text is None:
        return MAX_PAGE
    if not text.isdigit() or not 1 <= int(text) <= MAX_PAGE:
        raise InvalidRequest(f"limit must be 1-{MAX_PAGE}", field="limit")
    return int(text)


def _started_after(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(f"startedAfter must be an RFC 3339 time, not {text!r}",
                             field="startedAfter") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)


def _started_at_or_after(started_at: float, when: datetime.datetime | None) -> bool:
    # Compared as datetimes (microseconds, rounded as iso() rounds startedAt), so the
    # startedAt a list gave is "at" that sandbox's start.
    return when is None or datetime.datetime.fromtimestamp(started_at, datetime.UTC) >= when


def _newest_first(text: str | None) -> bool:
    if text not in (None, "asc", "desc"):
        raise InvalidRequest(f"order must be asc or desc, not {text!r}", field="order")
    return text != "asc"  # E2B's default: newest first


async def _listed(request: Request, default_states: tuple[str, ...]) -> list[dict[str, Any]]:
    q = request.query_params
    wanted = _metadata_filter(q.get("metadata"))
    states = _states(q.get("state"), default_states)
    after = _started_after(q.get("startedAfter"))
    template = q.get("template")
    newest_first = _newest_first(q.get("order"))
    found = await state_of(request).sandboxes.list(account_of(request))  # oldest first
    if newest_first:
        found.reverse()
    return [sandbox_json(s, detail=True, token=False) for s in found
            if s.state in states and _started_at_or_after(s.record.started_at, after)
            and template in (None, s.record.template)
            and all(s.record.metadata.get(k) == v for k, v in wanted.items())]


async def list_v1(request: Request) -> Response:
    """``GET /sandboxes``: the running sandboxes."""
    return JSONResponse(await _listed(request, ("running",)))


async def list_v2(request: Request) -> Response:
    """``GET /v2/sandboxes``: one page; the next page's token in ``x-next-token``."""
    items = await _listed(request, ("running", "paused"))
    limit = _limit(request.query_params.get("limit"))
    start = 0
    token = request.query_params.get("nextToken")
    if token:
        ids = [i["sandboxID"] for i in items]
        if token not in ids:
            raise InvalidRequest("nextToken is not a token of this list (its sandbox is "
                                 "gone): list again from the start", field="nextToken")
        start = ids.index(token)
    page = items[start:start + limit]
    headers = {}
    if start + limit < len(items):
        headers["x-next-token"] = items[start + limit]["sandboxID"]
    return JSONResponse(page, headers=headers)


async def kill(request: Request) -> Response:
    """``DELETE /sandboxes/{id}``: 204, or 404."""
    state = state_of(request)
    sandbox_id = request.path_params["id"]
    await state.sandboxes.kill(account_of(request), sandbox_id)
    state.processes.forget(sandbox_id)
    return Response(status_code=204)


async def set_timeout(request: Request) -> Response:
    """``POST /sandboxes/{id}/timeout {timeout}``: it now ends that many seconds on."""
    account = account_of(request)
    timeout = check_timeout((await body_of(request)).get("timeout"))
    await state_of(request).sandboxes.set_timeout(account, request.path_params["id"], timeout)
    return Response(status_code=204)


async def pause(request: Request) -> Response:
    """``POST /sandboxes/{id}/pause``: 204, 409 when already paused."""
    await state_of(request).sandboxes.pause(account_of(request), request.path_params["id"])
    return Response(status_code=204)


async def connect(request: Request) -> Response:
    """``POST /sandboxes/{id}/connect`` (v1, v2) and ``/resume``: 200 running, 201 woken."""
    account = account_of(request)
    body = await body_of(request)
    timeout = body.get("timeout")
    sandbox, woken = await state_of(request).sandboxes.connect(
        account, request.path_params["id"],
        None if timeout is None else check_timeout(timeout))
    return JSONResponse(sandbox_json(sandbox, domain=state_of(request).domain),
                        status_code=201 if woken else 200)


async def fork(request: Request) -> Response:
    """``POST /sandboxes/{id}/fork {count, timeout}`` -> 201 ``[{sandbox} | {error}]``."""
    account = account_of(request)
    body = await body_of(request)
    count = body.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
        raise InvalidRequest(f"count must be 1-{MAX_FORKS}", field="count")
    timeout = body.get("timeout")
    results = await state_of(request).sandboxes.fork(
        account, request.path_params["id"], count,
        None if timeout is None else check_timeout(timeout))
    items: list[dict[str, Any]] = []
    for item in results:
        if isinstance(item, BoxdError):
            items.append({"error": {"code": item.status, "message": item.message}})
        else:
            items.append({"sandbox": sandbox_json(item, domain=state_of(request).domain)})
    return JSONResponse(items, status_code=201)


def _unix(text: str | None, field: str) -> int | None:
    """A ``start``/``end`` query value: whole Unix seconds (None: absent)."""
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidRequest(f"{field} must be Unix seconds, not {text!r}",
                             field=field) from None


def _metric_json(s: models.MetricSample) -> dict[str, Any]:
    """E2B's ``SandboxMetric`` of one boxd sample."""
    return {"timestamp": iso(s.timestamp), "timestampUnix": int(s.timestamp),
            "cpuCount": s.cpu_count, "cpuUsedPct": s.cpu_used_pct, "memUsed": s.mem_used,
            "memTotal": s.mem_total, "memCache": s.mem_cache, "diskUsed": s.disk_used,
            "diskTotal": s.disk_total}


async def metrics(request: Request) -> Response:
    """``GET /sandboxes/{id}/metrics?start=&end=`` -> ``[SandboxMetric]``, oldest first:
    the machine's samples (`MachineService.metrics`) whose second is in [start, end]. A
    paused sandbox answers what was kept (maybe ``[]``), as E2B answers no new ones."""
    account = account_of(request)
    sandbox_id = request.path_params["id"]
    start = _unix(request.query_params.get("start"), "start")
    end = _unix(request.query_params.get("end"), "end")
    got = await state_of(request).sandboxes.metrics(account, sandbox_id)
    return JSONResponse([_metric_json(s) for s in got.samples
                         if (start is None or int(s.timestamp) >= start)
                         and (end is None or int(s.timestamp) <= end)])


async def metrics_batch(request: Request) -> Response:
    """``GET /sandboxes/metrics?sandbox_ids=a,b`` -> ``{"sandboxes": {id: SandboxMetric}}``:
    each running sandbox's newest sample (one taken now); unknown ids are left out."""
    account = account_of(request)
    ids = [i for i in request.query_params.get("sandbox_ids", "").split(",") if i]
    if not ids or len(ids) > MAX_PAGE:
        raise InvalidRequest(f"sandbox_ids must name 1-{MAX_PAGE} sandboxes",
                             field="sandbox_ids")
    out: dict[str, Any] = {}
    for sandbox_id in dict.fromkeys(ids):
        try:
            got = await state_of(request).sandboxes.metrics(account, sandbox_id)
        except NotFound:
            continue
        if got.samples:
            out[sandbox_id] = _metric_json(got.samples[-1])
    return JSONResponse({"sandboxes": out})


def _snapshot_service(request: Request) -> SnapshotService:
    service = state_of(request).snapshots
    if service is None:
        raise NotFound("this daemon serves no snapshots through E2B's API")
    return service


def _snapshot_json(snap: models.Snapshot) -> dict[str, Any]:
    # The id is a version: creating from it (templateID) starts from exactly that one.
    return {"snapshotID": f"{snap.name}@{snap.version}", "names": [snap.name]}


async def create_snapshot(request: Request) -> Response:
    """``POST /sandboxes/{id}/snapshots {name?}`` -> 201 ``{snapshotID, names}``: a boxd
    snapshot (a new version when the name exists); create from it by its id or name."""
    account = account_of(request)
    sandbox_id = request.path_params["id"]
    name = (await body_of(request)).get("name") or f"snapshot-{sandbox_id}"
    if not isinstance(name, str) or not models.NAME_RE.match(name):
        raise InvalidRequest(f"invalid snapshot name {name!r}", hint=models.NAME_RULE,
                             field="name")
    await state_of(request).sandboxes.get(account, sandbox_id)
    snap = await _snapshot_service(request).save(account, sandbox_id, name, new_version=True)
    return JSONResponse(_snapshot_json(snap), status_code=201)


async def list_snapshots(request: Request) -> Response:
    """``GET /snapshots?sandboxID=&name=``: the account's snapshots, newest first."""
    account = account_of(request)
    q = request.query_params
    snaps = await _snapshot_service(request).list(account)
    if sandbox_id := q.get("sandboxID"):
        snaps = [s for s in snaps if s.source_machine == sandbox_id]
    if name := q.get("name"):
        snaps = [s for s in snaps if s.name == name]
    snaps.sort(key=lambda s: s.created_at, reverse=True)
    return JSONResponse([_snapshot_json(s) for s in snaps[:_limit(q.get("limit"))]])


async def delete_snapshot(request: Request) -> Response:
    """``DELETE /templates/{id}``: a snapshot (by id or name): 204, or 404."""
    account = account_of(request)
    await _snapshot_service(request).delete(account, request.path_params["id"])
    return Response(status_code=204)


async def update_network(request: Request) -> Response:
    """``PUT /sandboxes/{id}/network`` (``update_network``): refused. boxd's engines fix a
    machine's egress policy when it starts (docs/security.md), so it cannot change on a
    running sandbox; give ``network`` on create."""
    state_of(request).sandboxes.record(account_of(request), request.path_params["id"])
    raise InvalidRequest(
        "a sandbox's network cannot be changed once it runs: boxd fixes a machine's "
        "egress policy when it is created", field="network",
        hint="create the sandbox with network={allow_out, deny_out} (docs/e2b.md)")


async def health(request: Request) -> Response:
    return Response(status_code=200)


routes = [
    Route("/health", health, methods=["GET"]),
    Route("/sandboxes", create, methods=["POST"]),
    Route("/v2/sandboxes", create, methods=["POST"]),
    Route("/sandboxes", list_v1, methods=["GET"]),
    Route("/v2/sandboxes", list_v2, methods=["GET"]),
    Route("/sandboxes/metrics", metrics_batch, methods=["GET"]),
    Route("/sandboxes/{id}", get_one, methods=["GET"]),
    Route("/sandboxes/{id}/metrics", metrics, methods=["GET"]),
    Route("/sandboxes/{id}/network", update_network, methods=["PUT"]),
    Route("/sandboxes/{id}", kill, methods=["DELETE"]),
    Route("/sandboxes/{id}/timeout", set_timeout, methods=["POST"]),
    Route("/sandboxes/{id}/pause", pause, methods=["POST"]),
    Route("/sandboxes/{id}/connect", connect, methods=["POST"]),
    Route("/v2/sandboxes/{id}/connect", connect, methods=["POST"]),
    Route("/sandboxes/{id}/resume", connect, methods=["POST"]),
    Route("/sandboxes/{id}/fork", fork, methods=["POST"]),
    Route("/sandboxes/{id}/snapshots", create_snapshot, methods=["POST"]),
    Route("/snapshots", list_snapshots, methods=["GET"]),
    Route("/templates/{id}", delete_snapshot, methods=["DELETE"]),
]
