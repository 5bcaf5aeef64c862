"""I/O-free logic shared by the sync and async clients.

Everything here is pure: where to connect and with which key (from arguments and the
environment), which HTTP request each SDK call makes, and how a response becomes a model
or a typed :class:`~boxd.errors.BoxdError`. The clients in ``_sync`` and ``_async`` only
send what this module builds, so both stay thin mirrors of each other.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import tarfile
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Final, TypeVar
from urllib.parse import quote, urlsplit

import httpx
from pydantic import ValidationError

from boxd import errors
from boxd._lazy import LazyModule
from boxd.config import ClientSettings, Paths

if TYPE_CHECKING:
    from pydantic import BaseModel

    from boxd import models
else:  # built on first use: see boxd._lazy
    models = LazyModule("boxd.models")

__all__ = [
    "DEFAULT_TIMEOUT",
    "LOCAL_BASE_URL",
    "Req",
    "Target",
    "TransferProgress",
    "content_length",
    "fork_items",
    "local_key_path",
    "map_transport_error",
    "parse",
    "parse_event",
    "raise_for_status",
    "resolve_target",
]

#: Seconds for ordinary requests. Exec and exec_stream have no read timeout (the command's
#: own ``timeout`` is enforced by the daemon); wait_until_ready extends it by its timeout.
DEFAULT_TIMEOUT: Final = 300.0
#: Seconds to establish a connection.
CONNECT_TIMEOUT: Final = 10.0
#: Base URL used for the local daemon on its unix socket (the host part is ignored).
LOCAL_BASE_URL: Final = "http://boxd"
#: The spec's ThreadPoolExecutor runs 8 workers; leave head room for exec + stream pairs.
MAX_CONNECTIONS: Final = 64
MAX_KEEPALIVE: Final = 32
#: Seconds an idle pooled connection is kept; the daemon keeps its end open longer
#: (``boxd.api.server.KEEP_ALIVE_SECONDS``), so it never closes one under a request.
KEEPALIVE_EXPIRY: Final = 5.0

#: Sentinel for "use the client's default timeout".
DEFAULT: Final = "default"
#: Sentinel for "no read timeout" (long-running exec).
NO_READ_TIMEOUT: Final = "no-read-timeout"

M = TypeVar("M", bound="BaseModel")

#: ``progress(done, total)`` of a snapshot export or import: bytes moved so far and the
#: total (None when the daemon did not say). Called after every chunk, from the caller's
#: thread (sync) or task (async).
TransferProgress = Callable[[int, int | None], None]
#: ``progress(step, fraction)`` of an image import: what it is fetching and the fraction
#: of the image's bytes done (None when unknown).
StepProgress = Callable[[str, float | None], None]


def content_length(headers: Mapping[str, str]) -> int | None:
    """The ``Content-Length`` of a response, or None (absent, chunked or malformed)."""
    try:
        value = int(headers.get("content-length", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


#: Inside a (non-isolated) machine: the daemon's API, relayed by the guest agent, and the
#: machine's own credential, rotated on fork, restore and wake (docs/lifecycle.md).
GUEST_SOCKET = Path("/run/boxd/boxd.sock")
GUEST_KEY = Path("/run/boxd/key")


class GuestKeyAuth(httpx.Auth):
    """The machine's credential, read from `GUEST_KEY` for every request: a fork child or
    a restored machine has a new one, and a client made before still works."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        try:
            key = self.path.read_text().strip()
        except OSError:
            key = ""
        if key:
            request.headers["Authorization"] = f"Bearer {key}"
        yield request


def local_key_path(paths: Paths) -> Path:
    """The key file the local daemon writes for its OS user (mode 0600)."""
    return paths.home / "local.key"


@dataclass(frozen=True)
class Target:
    """Where a client connects and how it authenticates.

    Attributes:
        base_url: URL prefix of every request.
        uds: the local daemon's unix socket, or None for a TCP URL.
        api_key: explicit key (argument or ``BOXD_API_KEY``), or None to use the local key
            file once the daemon is known to run.
        paths: the local data directory (socket, key file, log, spawn lock).
        guest: True inside a machine: ``uds`` is its API socket (`GUEST_SOCKET`) and,
            without ``api_key``, every request carries the machine's credential.
    """

    base_url: str
    uds: Path | None
    api_key: str | None
    paths: Paths
    guest: bool = False

    @property
    def local(self) -> bool:
        """True when the client talks to (and may start) the local daemon."""
        return self.uds is not None and not self.guest

    @property
    def where(self) -> str:
        """Human description of the endpoint, for error messages."""
        if self.guest:
            return f"this machine's API socket {self.uds}"
        return f"unix socket {self.uds}" if self.uds is not None else self.base_url

    def auth(self) -> httpx.Auth | None:
        """Inside a machine without an explicit key: its credential, read per request."""
        return GuestKeyAuth(GUEST_KEY) if self.guest and not self.api_key else None


def resolve_target(
    api_key: str | None = None,
    base_url: str | None = None,
    environ: Mapping[str, str] | None = None,
    paths: Paths | None = None,
) -> Target:
    """Decide the endpoint and key from arguments, then the environment.

    Order: ``base_url`` argument, ``BOXD_URL``, else inside a machine its API socket
    (`GUEST_SOCKET`, when it exists), else the local daemon's unix socket. ``api_key``
    argument, ``BOXD_API_KEY``, else inside a machine its credential (`GUEST_KEY`, read
    per request), else (resolved later, after the daemon runs) the local key file.

    Raises:
        InvalidRequest: the base URL is not an ``http(s)://host[:port]`` URL.
    """
    env = os.environ if environ is None else environ
    paths = paths or Paths.default()
    client = ClientSettings.from_env(env)
    key = api_key or client.api_key
    url = base_url or client.url
    if url is None:
        # Inside a machine (its client's files are there) even without the socket: an
        # isolated machine has none, and the host's daemon is not one to start here.
        if GUEST_SOCKET.exists() or (GUEST_SOCKET.parent / "py").is_dir():
            return Target(LOCAL_BASE_URL, GUEST_SOCKET, key, paths, guest=True)
        return Target(LOCAL_BASE_URL, paths.socket, key, paths)
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise errors.InvalidRequest(
            f"invalid boxd URL {url!r}",
            hint="use http://HOST:PORT, e.g. BOXD_URL=http://127.0.0.1:7070",
            field="base_url",
        )
    return Target(url, None, key, paths)


def timeout_for(default: float | None, spec: float | str | None) -> httpx.Timeout:
    """The httpx timeout for one request, given the client default and the request's spec."""
    if spec == DEFAULT:
        return httpx.Timeout(default, connect=CONNECT_TIMEOUT)
    if spec == NO_READ_TIMEOUT or spec is None:
        return httpx.Timeout(default, connect=CONNECT_TIMEOUT, read=None)
    assert isinstance(spec, float | int)
    return httpx.Timeout(max(float(spec), default or 0.0), connect=CONNECT_TIMEOUT)


def seg(ref: str) -> str:
    """Quote one path segment (machine and snapshot refs may hold ``@`` or ``:``)."""
    return quote(str(ref), safe="")


@dataclass(frozen=True)
class Req:
    """One HTTP request, built without I/O."""

    method: str
    path: str
    params: Mapping[str, str | list[str]] = field(default_factory=dict)  # a list repeats
    json: Any = None
    content: bytes | None = None
    timeout: float | str | None = DEFAULT
    headers: Mapping[str, str] = field(default_factory=dict)


# --- request builders -----------------------------------------------------------------


def health() -> Req:
    return Req("GET", "/v1/health", timeout=5.0)


def info() -> Req:
    return Req("GET", "/v1/info")


def machine_create(
    name: str | None,
    vcpus: int | None,
    memory_mib: int | None,
    disk_gib: int | None,
    isolated: bool,
    from_snapshot: str | None,
    engine: str | None = None,
    suspend_after: float | None = None,
    hibernate_after: float | None = None,
    node: str | None = None,
    public: bool = False,
    labels: Mapping[str, str] | None = None,
    idempotency_key: str | None = None,
    timeout: int | None = None,
    on_timeout: str = "delete",
    image: str | None = None,
    wait: float = 0.0,
    service: bool = True,
    expose_host: Sequence[int] = (),
    egress: Sequence[str] | None = None,
) -> Req:
    body: dict[str, Any] = {"isolated": bool(isolated)}
    if public:
        body["public"] = True
    if not service:
        body["service"] = False
    body.update(net_policy(expose_host, egress))
    if labels:
        body["labels"] = models.check_labels(labels)
    body.update(lifetime(timeout, on_timeout))
    body.update(admission(wait))
    for k, v in (
        ("name", name),
        ("vcpus", vcpus),
        ("memory_mib", memory_mib),
        ("disk_gib", disk_gib),
        ("from_snapshot", from_snapshot),
        ("engine", engine),
        ("suspend_after", suspend_after),
        ("hibernate_after", hibernate_after),
        ("node", node),
        ("image", image),
    ):
        if v is not None:  # absent fields take the daemon's defaults
            body[k] = v
    return Req("POST", "/v1/machines", json=body, headers=idempotency(idempotency_key),
               timeout=NO_READ_TIMEOUT if wait else DEFAULT)


def net_policy(expose_host: Sequence[int], egress: Sequence[str] | None) -> dict[str, Any]:
    """The ``expose_host`` and ``egress`` body fields of new ({} for the defaults).

    Raises:
        InvalidRequest: ``expose_host`` is not a sequence of TCP port ints, or ``egress``
            a str instead of a list of them (the daemon checks the entries).
    """
    body: dict[str, Any] = {}
    if isinstance(expose_host, str | bytes) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in expose_host):
        raise errors.InvalidRequest(
            f"expose_host must be a list of TCP port ints, not {expose_host!r}",
            field="expose_host", hint="e.g. expose_host=[8000]")
    if expose_host:
        body["expose_host"] = [int(p) for p in expose_host]
    if egress is not None:
        if isinstance(egress, str | bytes) or not all(isinstance(e, str) for e in egress):
            raise errors.InvalidRequest(
                f"egress must be a list of strings, not {egress!r}", field="egress",
                hint='e.g. egress=["pypi.org:443", "203.0.113.0/24"]')
        body["egress"] = list(egress)
    return body


def idempotency(key: str | None) -> dict[str, str]:
    """The ``Idempotency-Key`` header of a create or fork ({} without a key).

    Raises:
        InvalidRequest: not 1-255 printable ASCII characters without spaces.
    """
    if key is None:
        return {}
    pattern = models.IDEMPOTENCY_KEY_PATTERN.removesuffix("$") + r"\Z"
    if not isinstance(key, str) or not re.match(pattern, key):
        raise errors.InvalidRequest(
            f"invalid idempotency key {str(key)[:80]!r}: use 1-255 printable ASCII "
            "characters without spaces", field="idempotency_key",
            hint="e.g. str(uuid.uuid4()) per logical request, the same on its retries")
    return {"Idempotency-Key": key}


def admission(wait: float) -> dict[str, Any]:
    """The ``wait`` body field of new and fork ({} for 0: no wait).

    Raises:
        InvalidRequest: ``wait`` is not a number of 0-`models.MAX_WAIT` seconds.
    """
    if isinstance(wait, bool) or not isinstance(wait, int | float) \
            or not 0 <= wait <= models.MAX_WAIT:
        raise errors.InvalidRequest(
            f"wait must be 0-{models.MAX_WAIT} seconds, not {wait!r}", field="wait",
            hint="how long a create or fork may wait for room (0: not at all)")
    return {"wait": float(wait)} if wait else {}


def lifetime(timeout: int | None, on_timeout: str = "delete") -> dict[str, Any]:
    """The body fields of a lifetime on new and fork (none without ``timeout``).

    Raises:
        InvalidRequest: ``timeout`` is not an int of 1-`models.MAX_TIMEOUT` seconds, or
            ``on_timeout`` is neither "delete" nor "hibernate".
    """
    action = models.check_on_timeout(on_timeout)
    if timeout is None:
        return {}
    out: dict[str, Any] = {"timeout": models.check_timeout(timeout)}
    if action != "delete":
        out["on_timeout"] = action
    return out


def machine_set_timeout(ref: str, timeout: int | None, on_timeout: str | None = None) -> Req:
    """Raises: InvalidRequest: a bad ``timeout`` or ``on_timeout``."""
    body: dict[str, Any] = {
        "timeout": None if timeout is None else models.check_timeout(timeout)}
    if on_timeout is not None:
        body["on_timeout"] = models.check_on_timeout(on_timeout)
    return Req("POST", f"/v1/machines/{seg(ref)}/timeout", json=body)


def machine_get(ref: str) -> Req:
    return Req("GET", f"/v1/machines/{seg(ref)}")


def label_params(labels: Mapping[str, str] | None, state: str | None) -> dict[str, Any]:
    """Query parameters of a label selector: ``label=K=V`` once per label.

    Raises:
        InvalidRequest: a label breaks `models.LABEL_RULE`.
    """
    params: dict[str, Any] = {}
    if labels:
        params["label"] = [f"{k}={v}" for k, v in models.check_labels(labels).items()]
    if state is not None:
        params["state"] = str(state)
    return params


def machine_list(
    labels: Mapping[str, str] | None = None, state: str | None = None,
    limit: int | None = None, cursor: str | None = None,
) -> Req:
    params = label_params(labels, state)
    if limit is not None:
        params["limit"] = str(int(limit))
    if cursor is not None:
        params["cursor"] = cursor
    return Req("GET", "/v1/machines", params=params)


def machine_delete_many(labels: Mapping[str, str], state: str | None = None) -> Req:
    """Raises: InvalidRequest: no label (an empty selector would take every machine)."""
    if not labels:
        raise errors.InvalidRequest(
            "delete_many needs at least one label: an empty selector would delete every "
            "machine", field="labels", hint="e.g. delete_many(labels={'run': 'r-7'})")
    return Req("DELETE", "/v1/machines", params=label_params(labels, state),
               timeout=NO_READ_TIMEOUT)


def machine_delete(ref: str) -> Req:
    return Req("DELETE", f"/v1/machines/{seg(ref)}")


def machine_lifecycle(ref: str, action: str) -> Req:
    """``suspend``, ``hibernate`` or ``resume``; a wake from disk may take seconds."""
    return Req("POST", f"/v1/machines/{seg(ref)}/{action}", timeout=300.0)


def machine_wait(ref: str, timeout: float) -> Req:
    # The daemon holds the request up to `timeout`; give the HTTP read some slack on top.
    return Req(
        "POST",
        f"/v1/machines/{seg(ref)}/wait",
        params={"timeout": _num(timeout)},
        timeout=float(timeout) + 30.0,
    )


def exec_body(
    command: str | list[str] | tuple[str, ...],
    env: Mapping[str, str] | None,
    cwd: str | None,
    timeout: float | None,
    stdin: str | None,
    user: str | None = None,
) -> dict[str, Any]:
    if isinstance(command, tuple):
        command = list(command)
    if not isinstance(command, str | list) or not command:
        raise errors.InvalidRequest(
            "command must be a non-empty shell string or argv list", field="command"
        )
    body: dict[str, Any] = {"command": command, "env": dict(env or {})}
    if cwd is not None:
        body["cwd"] = cwd
    if timeout is not None:
        body["timeout"] = timeout
    if stdin is not None:
        body["stdin"] = stdin
    if user is not None:
        body["user"] = user
    return body


def machine_exec(
    ref: str,
    command: str | list[str],
    env: Mapping[str, str] | None,
    cwd: str | None,
    timeout: float | None,
    stdin: str | None,
    user: str | None = None,
    exec_id: str | None = None,
) -> Req:
    body = exec_body(command, env, cwd, timeout, stdin, user)
    if exec_id is not None:
        body["exec_id"] = exec_id
    return Req(
        "POST",
        f"/v1/machines/{seg(ref)}/exec",
        json=body,
        timeout=NO_READ_TIMEOUT,
    )


def machine_exec_list(ref: str, limit: int) -> Req:
    return Req("GET", f"/v1/machines/{seg(ref)}/execs", params={"limit": str(limit)})


def machine_logs(ref: str, after: int | None, wait: float) -> Req:
    params = {"wait": _num(wait)}
    if after is not None:
        params["after"] = str(int(after))
    return Req("GET", f"/v1/machines/{seg(ref)}/logs", params=params,
               timeout=float(wait) + 30.0)


def machine_metrics(ref: str, start: float | None, end: float | None) -> Req:
    params = {k: _num(v) for k, v in (("start", start), ("end", end)) if v is not None}
    return Req("GET", f"/v1/machines/{seg(ref)}/metrics", params=params)


def machine_exec_result(ref: str, exec_id: str, wait: float) -> Req:
    # The daemon holds the request up to `wait`; give the HTTP read some slack on top.
    return Req(
        "GET",
        f"/v1/machines/{seg(ref)}/execs/{seg(exec_id)}",
        params={"wait": _num(wait)},
        timeout=float(wait) + 30.0,
    )


def machine_exec_stream(
    ref: str,
    command: str | list[str],
    env: Mapping[str, str] | None,
    cwd: str | None,
    timeout: float | None,
    stdin: str | None,
    user: str | None = None,
) -> Req:
    return Req(
        "POST",
        f"/v1/machines/{seg(ref)}/exec/stream",
        json=exec_body(command, env, cwd, timeout, stdin, user),
        timeout=NO_READ_TIMEOUT,
    )


def machine_warm(ref: str, forks: int) -> Req:
    return Req("POST", f"/v1/machines/{seg(ref)}/warm", json={"forks": forks})


def machine_fork(src: str, name: str | None, node: str | None = None,
                 labels: Mapping[str, str] | None = None,
                 idempotency_key: str | None = None, timeout: int | None = None,
                 on_timeout: str = "delete", wait: float = 0.0) -> Req:
    body: dict[str, Any] = {k: v for k, v in (("name", name), ("node", node))
                            if v is not None}
    if labels:
        body["labels"] = models.check_labels(labels)
    body.update(lifetime(timeout, on_timeout))
    body.update(admission(wait))
    return Req("POST", f"/v1/machines/{seg(src)}/fork", json=body,
               headers=idempotency(idempotency_key),
               timeout=NO_READ_TIMEOUT if wait else DEFAULT)


def machine_fork_batch(src: str, count: int | None, names: list[str] | None,
                       node: str | None = None,
                       labels: Mapping[str, str] | None = None,
                       idempotency_key: str | None = None, timeout: int | None = None,
                       on_timeout: str = "delete", wait: float = 0.0) -> Req:
    body: dict[str, Any] = {} if node is None else {"node": node}
    if labels:
        body["labels"] = models.check_labels(labels)
    body.update(lifetime(timeout, on_timeout))
    body.update(admission(wait))
    if count is not None:
        body["count"] = count
    if names is not None:
        body["names"] = list(names)
    return Req("POST", f"/v1/machines/{seg(src)}/fork/batch", json=body, timeout=NO_READ_TIMEOUT,
               headers=idempotency(idempotency_key))


def file_upload(ref: str, path: str, data: str | bytes, mode: int,
                user: str | None = None) -> Req:
    content = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    params = {"path": path, "mode": str(int(mode))}
    if user is not None:
        params["user"] = user
    return Req("PUT", f"/v1/machines/{seg(ref)}/files", params=params, content=content)


def file_download(ref: str, path: str) -> Req:
    return Req("GET", f"/v1/machines/{seg(ref)}/files", params={"path": path})


def checkpoint_save(ref: str, name: str) -> Req:
    return Req("POST", f"/v1/machines/{seg(ref)}/checkpoints", json={"name": name})


def checkpoint_restore(ref: str, name: str) -> Req:
    return Req("POST", f"/v1/machines/{seg(ref)}/checkpoints/{seg(name)}/restore")


def checkpoint_list(ref: str) -> Req:
    return Req("GET", f"/v1/machines/{seg(ref)}/checkpoints")


def checkpoint_delete(ref: str, name: str) -> Req:
    return Req("DELETE", f"/v1/machines/{seg(ref)}/checkpoints/{seg(name)}")


def snapshot_save(machine: str, name: str, new_version: bool) -> Req:
    return Req(
        "POST",
        "/v1/snapshots",
        json={"machine": machine, "name": name, "new_version": bool(new_version)},
        timeout=NO_READ_TIMEOUT,
    )


def snapshot_get(ref: str) -> Req:
    return Req("GET", f"/v1/snapshots/{seg(ref)}")


def snapshot_list() -> Req:
    return Req("GET", "/v1/snapshots")


def snapshot_delete(ref: str) -> Req:
    return Req("DELETE", f"/v1/snapshots/{seg(ref)}")


def image_import(source: str, name: str, creds: str | None, insecure: bool,
                 progress: bool = False) -> Req:
    body: dict[str, Any] = {"source": source, "name": name, "insecure": bool(insecure)}
    if creds is not None:
        body["creds"] = creds
    params = {"progress": "true"} if progress else {}
    return Req("POST", "/v1/images", params=params, json=body, timeout=NO_READ_TIMEOUT)


def parse_progress_line(line: str, progress: StepProgress,
                        ) -> Any | None:
    """One NDJSON line of an import with progress: reports a progress line and returns
    None, returns the image's JSON, or raises the error a line carries."""
    obj = _ndjson(line, "progress line")
    if obj is None:
        return None
    if isinstance(obj, dict) and obj.get("type") == "progress":
        fraction = obj.get("fraction")
        progress(str(obj.get("step", "")),
                 float(fraction) if isinstance(fraction, int | float) else None)
        return None
    if isinstance(obj, dict) and obj.get("type") == "image":
        return obj.get("image")
    raise errors.InternalError(f"unexpected progress line: {line[:200]!r}")


def image_build(name: str, dockerfile: str, build_args: dict[str, str] | None,
                target: str | None) -> Req:
    params: dict[str, Any] = {"name": name, "dockerfile": dockerfile}
    if build_args:
        params["build_arg"] = [f"{k}={v}" for k, v in build_args.items()]
    if target is not None:
        params["target"] = target
    return Req("POST", "/v1/images/build", params=params, timeout=NO_READ_TIMEOUT)


def tar_context(context: Path, out: BinaryIO) -> None:
    """Write the build context ``context`` (a directory) to ``out`` as a tar: files,
    directories and symlinks as they are, owners not kept. Names listed in its
    ``.dockerignore`` (plain names and ``*`` patterns, one per line) are left out."""
    ignore = set()
    di = context / ".dockerignore"
    if di.is_file():
        ignore = {ln.strip().strip("/") for ln in di.read_text().splitlines()
                  if ln.strip() and not ln.startswith("#")}

    def skip(rel: str) -> bool:
        return any(fnmatch.fnmatch(rel, pat) or rel.startswith(pat + "/") for pat in ignore)

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if info.name != "." and skip(info.name.removeprefix("./")):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.add(context, arcname=".", filter=clean)


def image_path(name: str) -> str:
    """``/v1/images/NAME:TAG`` (a name's ``/`` and ``:`` stay as they are)."""
    return "/v1/images/" + quote(str(name), safe="/:")


def image_get(name: str) -> Req:
    return Req("GET", image_path(name))


def image_list() -> Req:
    return Req("GET", "/v1/images")


def image_remove(name: str) -> Req:
    return Req("DELETE", image_path(name))


def snapshot_export(ref: str) -> Req:
    return Req("GET", f"/v1/snapshots/{seg(ref)}/export", timeout=NO_READ_TIMEOUT)


def snapshot_import(name: str | None) -> Req:
    params = {"name": name} if name is not None else {}
    return Req("POST", "/v1/snapshots/import", params=params, timeout=NO_READ_TIMEOUT)


def key_create(name: str, account: str | None) -> Req:
    body: dict[str, Any] = {"name": name}
    if account is not None:
        body["account"] = account
    return Req("POST", "/v1/keys", json=body)


def node_list() -> Req:
    return Req("GET", "/v1/nodes")


def account_list() -> Req:
    return Req("GET", "/v1/accounts")


def account_get(name: str) -> Req:
    return Req("GET", f"/v1/accounts/{seg(name)}")


def account_update(name: str, max_machines: int) -> Req:
    return Req("PATCH", f"/v1/accounts/{seg(name)}", json={"max_machines": int(max_machines)})


def report_save(name: str, report: Mapping[str, Any]) -> Req:
    if not isinstance(report, Mapping):
        raise errors.InvalidRequest(f"a report is a mapping (SweepReport.to_json()), not "
                                    f"{type(report).__name__}", field="report")
    return Req("POST", "/v1/reports", json={"name": name, "report": dict(report)})


def report_list() -> Req:
    return Req("GET", "/v1/reports")


def report_get(name: str) -> Req:
    return Req("GET", f"/v1/reports/{seg(name)}")


def report_delete(name: str) -> Req:
    return Req("DELETE", f"/v1/reports/{seg(name)}")


def key_list() -> Req:
    return Req("GET", "/v1/keys")


def key_revoke(key_id: str) -> Req:
    return Req("DELETE", f"/v1/keys/{seg(key_id)}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(float(x))


# --- responses ------------------------------------------------------------------------


def error_from_response(status: int, content: bytes) -> errors.BoxdError:
    """The typed error for a non-2xx response."""
    try:
        body = json.loads(content) if content else None
    except ValueError:
        text = content.decode("utf-8", "replace").strip()[:300]
        return errors.InternalError(
            f"unexpected HTTP {status} from boxd: {text or '(empty body)'}",
            hint="is BOXD_URL pointing at a boxd daemon?",
        )
    if body is None:
        return errors.InternalError(f"unexpected HTTP {status} from boxd (empty body)")
    return errors.error_from_body(body, status)


def raise_for_status(status: int, content: bytes) -> None:
    """Raise the typed error if ``status`` is not 2xx.

    Raises:
        BoxdError: the subclass named by the body's ``code``.
    """
    if not 200 <= status < 300:
        raise error_from_response(status, content)


def parse(model: type[M], status: int, content: bytes) -> M:
    """Check the status, then validate the JSON body as ``model``.

    Raises:
        BoxdError: for a non-2xx status; InternalError for a body that doesn't fit.
    """
    raise_for_status(status, content)
    try:
        return model.model_validate_json(content)
    except ValidationError as exc:
        raise errors.InternalError(
            f"boxd sent a {model.__name__} this client cannot read: {exc.errors()[:1]}",
            hint="are the client and daemon versions compatible?",
        ) from exc


def _ndjson(line: str | bytes, what: str) -> Any | None:
    """One NDJSON line of a stream, decoded (None for a blank line).

    Raises:
        InternalError: not JSON.
        BoxdError: the line carries an error body.
    """
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise errors.InternalError(f"malformed {what}: {line[:200]!r}") from exc
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        raise errors.error_from_body(obj)
    return obj


def parse_event(line: str | bytes) -> models.ExecEvent | None:
    """One NDJSON line of an exec stream as an event (None for blank lines).

    Raises:
        BoxdError: the line carries an error body instead of an event.
    """
    obj = _ndjson(line, "exec stream line")
    if obj is None:
        return None
    try:
        return models.ExecEvent.model_validate(obj)
    except ValidationError as exc:
        raise errors.InternalError(f"malformed exec event: {obj!r}"[:300]) from exc


def stream_cut(ref: str) -> errors.InfrastructureError:
    """An exec stream that ended without its exit event: the command's outcome is
    unknown (the daemon or the connection went away between two events)."""
    return errors.InfrastructureError(
        f"the exec stream of machine {ref!r} ended without an exit status", machine=ref,
        hint="the daemon or the connection went away; check `boxd machine info` and run "
        "the command again")


def fork_items(result: models.ForkResult) -> list[models.Machine | errors.BoxdError]:
    """Per-child outcome of a batch fork: each child's Machine or its typed error."""
    out: list[models.Machine | errors.BoxdError] = []
    for item in result.children:
        if item.machine is not None:
            out.append(item.machine)
        elif item.error is not None:
            out.append(errors.error_from_body({"error": item.error.model_dump()}))
        else:
            out.append(errors.InternalError("batch fork returned an empty item"))
    return out


def map_transport_error(exc: Exception, target: Target) -> errors.ConnectionError:
    """Translate an httpx transport failure into boxd's ConnectionError."""
    if isinstance(exc, httpx.TimeoutException):
        what = f"request to boxd at {target.where} timed out ({type(exc).__name__})"
        hint = "the daemon may be overloaded; raise Boxd(timeout=...)"
    else:
        what = f"cannot reach boxd at {target.where}: {exc or type(exc).__name__}"
        if target.guest and target.uds is not None and not target.uds.exists():
            what = f"this machine has no route to the boxd API ({target.uds} does not exist)"
            hint = ("an isolated machine has none: create it without isolated=True to call "
                    "boxd from inside it, or set BOXD_URL")
        elif target.guest:
            hint = ("the machine may have been forked or restored during this call (the "
                    "new copy's calls in flight are cut), or the daemon is not running")
        elif target.local:
            hint = f"is the daemon running? its log is {target.paths.log}"
        else:
            hint = "check BOXD_URL and that the daemon is running"
    return errors.ConnectionError(what, hint=hint)


def headers(api_key: str | None) -> dict[str, str]:
    from boxd import __version__  # late: boxd/__init__ imports this module

    h = {"User-Agent": f"boxd-python/{__version__}", "Accept": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def limits() -> httpx.Limits:
    return httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_KEEPALIVE,
                        keepalive_expiry=KEEPALIVE_EXPIRY)


# --- processes with a framed stream (machines.spawn; boxd.rl) ---------------------------

#: The largest message a process stream carries (a frame on the process's side).
MAX_MESSAGE: Final = 256 << 20
#: Seconds to open a process stream and get the daemon's "attached" answer.
STREAM_OPEN_TIMEOUT: Final = 60.0


def machine_spawn(
    ref: str, argv: list[str], env: Mapping[str, str] | None, cwd: str | None,
    user: str | None = None,
) -> Req:
    if isinstance(argv, str) or not argv:
        raise errors.InvalidRequest("argv must be a non-empty list of strings", field="argv")
    body: dict[str, Any] = {"argv": list(argv), "env": dict(env or {})}
    if cwd is not None:
        body["cwd"] = cwd
    if user is not None:
        body["user"] = user
    return Req("POST", f"/v1/machines/{seg(ref)}/processes", json=body)


def machine_processes(ref: str) -> Req:
    return Req("GET", f"/v1/machines/{seg(ref)}/processes")


def process_kill(ref: str, process_id: str, signal: int) -> Req:
    return Req("POST", f"/v1/machines/{seg(ref)}/processes/{seg(process_id)}/kill",
               json={"signal": signal})


def stream_url(target: Target, ref: str, process_id: str) -> str:
    """The WebSocket URL of a process's stream (ws://boxd/... on the local socket)."""
    path = f"/v1/machines/{seg(ref)}/processes/{seg(process_id)}/stream"
    base = target.base_url.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://"):] + path
    return "ws://" + base.split("://", 1)[-1] + path


def stream_control(text: str | bytes) -> dict[str, Any]:
    """A control message of a process stream (JSON text)."""
    try:
        msg = json.loads(text)
    except ValueError as exc:
        raise errors.InternalError(f"malformed process stream message: {exc}") from exc
    if not isinstance(msg, dict):
        raise errors.InternalError(f"malformed process stream message: {msg!r}"[:200])
    return msg


def stream_error(msg: Mapping[str, Any]) -> errors.BoxdError:
    """The typed error of an ``error`` control message."""
    return errors.error_from_body({"error": msg.get("error")})


def process_exited(process_id: str, msg: Mapping[str, Any]) -> errors.Conflict:
    """What `recv` raises once the process has exited (``exit_code`` in the details)."""
    code, signal = msg.get("exit_code"), msg.get("signal")
    status = f"killed by signal {signal}" if signal else f"exit status {code}"
    tail = str(msg.get("stderr_tail") or "").strip()[-600:]
    return errors.Conflict(
        f"process {process_id} has exited ({status})"
        + (f"; its stderr ends with: {tail}" if tail else ""),
        hint="spawn it again", exit_code=code, signal=signal, process=process_id)
