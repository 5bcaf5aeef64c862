"""Wire schemas shared by the daemon and the SDKs (pydantic v2).

Every API request and response body is one of these; the OpenAPI schema and the
TypeScript types are generated from them.
"""

from __future__ import annotations

import operator
import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, SupportsIndex

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from boxd import config
from boxd.errors import InvalidRequest

#: The name rule (machines, checkpoints, snapshots, accounts), as the OpenAPI schema
#: states it (ECMA-262 syntax).
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
#: The same rule for Python: ``\Z``, because ``$`` would also match before a final "\n".
NAME_RE = re.compile(NAME_PATTERN.removesuffix("$") + r"\Z")
NAME_RULE = "1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
NAME_SCHEMA = {"type": "string", "pattern": NAME_PATTERN, "minLength": 1, "maxLength": 63}
#: A name checked by the routes (`check_name`, whose 400 names the rule); the schema
#: carries the rule so that clients and fuzzers know it.
Name = Annotated[str, WithJsonSchema(NAME_SCHEMA)]
#: The engines a machine can ask for (``boxd.engine.registry.ENGINES``, which a unit
#: test keeps equal); the plane answers 400 naming them for any other.
ENGINE_NAMES = ("qemu", "gvisor")
#: An absolute path inside a machine: what the file routes accept.
GUEST_PATH_PATTERN = r"^/[^\x00]*$"

#: Longest exec timeout, in seconds (7 days). Longer ones would overflow the host's
#: deadline arithmetic; a command that must run longer needs no timeout at all.
MAX_EXEC_TIMEOUT = 7 * 24 * 3600.0
# What a process's argv, environment and working directory can hold: C strings, and
# environment names without '='. Checked here so that a bad request is a 400 naming
# the field, never a guest agent left without an answer.
_NO_NUL = r"^[^\x00]*$"
NoNul = Annotated[str, StringConstraints(pattern=_NO_NUL)]
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=4096,
                                           pattern=r"^[^=\x00]+$")]
# pydantic states the key rule as patternProperties, which leaves any other name
# allowed in JSON Schema terms: state it as propertyNames.
_ENV_SCHEMA = {
    "type": "object",
    "propertyNames": {"minLength": 1, "maxLength": 4096, "pattern": r"^[^=\x00]+$"},
    "additionalProperties": {"type": "string", "pattern": _NO_NUL},
}
#: What one command may hold, below what Linux's execve takes (ARG_MAX, 2 MiB with the
#: default 8 MiB stack; MAX_ARG_STRLEN, 128 KiB per string, its NUL included): a bad
#: request is a 400 naming the limit, never an exec that fails with "File name too long"
#: or "Argument list too long" in the guest.
MAX_ARGV_ITEMS = 65536
#: Bytes (UTF-8) of one argv item or one ``NAME=value`` of the environment.
MAX_ARG_BYTES = 128 * 1024 - 1
#: Bytes of the argv and the environment together (each string with its NUL).
MAX_EXEC_BYTES = 1 << 20
#: A command's argv as a list (``exec``, ``spawn``).
Argv = Annotated[list[NoNul], Field(min_length=1, max_length=MAX_ARGV_ITEMS)]
#: A command's environment (``exec``, ``spawn``).
ExecEnv = Annotated[dict[EnvName, NoNul], WithJsonSchema(_ENV_SCHEMA)]
#: A command's working directory in the guest: an absolute path.
GuestCwd = Annotated[str, StringConstraints(min_length=1, max_length=4096,
                                            pattern=GUEST_PATH_PATTERN)]
#: Who a command runs as: ``NAME[:GROUP]`` or ``UID[:GID]`` (a Dockerfile's USER).
_USER_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}"
GuestUser = Annotated[str, StringConstraints(
    max_length=65, pattern=rf"^{_USER_PART}(?::{_USER_PART})?$")]
USER_DESCRIPTION = ("NAME[:GROUP] or UID[:GID] to run it as, from the machine's /etc/passwd "
                    "and /etc/group; default: the image's USER, else root")


def _arg_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_argv_items(argv: object) -> object:
    """Before the items are checked: `MAX_ARGV_ITEMS` (a ValueError names the limit)."""
    if isinstance(argv, list) and len(argv) > MAX_ARGV_ITEMS:
        raise ValueError(f"{len(argv)} argv items: the limit is {MAX_ARGV_ITEMS}")
    return argv


def check_argv(argv: str | list[str]) -> str | list[str]:
    """`MAX_ARG_BYTES` per item, `MAX_EXEC_BYTES` in all (a ValueError names the limit)."""
    total = 0
    for i, item in enumerate([argv] if isinstance(argv, str) else argv):
        n = _arg_bytes(item)
        if n > MAX_ARG_BYTES:
            what = "the command" if isinstance(argv, str) else f"argv item {i}"
            raise ValueError(f"{what} is {n} bytes: the limit is {MAX_ARG_BYTES} bytes per "
                             "string (Linux's MAX_ARG_STRLEN)")
        total += n + 1
        if total > MAX_EXEC_BYTES:
            raise ValueError(f"the command is over {MAX_EXEC_BYTES} bytes: the limit is "
                             f"{MAX_EXEC_BYTES} bytes for the argv and environment together")
    return argv


def check_env(env: dict[str, str], argv: str | list[str] | None) -> dict[str, str]:
    """`MAX_ARG_BYTES` per ``NAME=value``, `MAX_EXEC_BYTES` with the argv ``argv``."""
    items = [] if argv is None else [argv] if isinstance(argv, str) else argv
    total = sum(_arg_bytes(a) + 1 for a in items)
    for name, value in env.items():
        n = _arg_bytes(name) + 1 + _arg_bytes(value)
        if n > MAX_ARG_BYTES:
            raise ValueError(f"variable {name[:64]!r} is {n} bytes as NAME=value: the limit "
                             f"is {MAX_ARG_BYTES} bytes per string (Linux's MAX_ARG_STRLEN)")
        total += n + 1
        if total > MAX_EXEC_BYTES:
            raise ValueError(f"the command and its environment are over {MAX_EXEC_BYTES} "
                             f"bytes: the limit is {MAX_EXEC_BYTES} bytes for the argv and "
                             "environment together")
    return env


#: An ``Idempotency-Key`` (create, fork): 1-255 printable ASCII characters, no spaces.
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"


#: A machine label's key: 1-128 letters, digits, '.', '_', '/' or '-', starting and
#: ending with a letter or digit (``boxd.rl/run``, ``team``, ``exp_7``).
LABEL_KEY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,126}[A-Za-z0-9])?$"
_LABEL_KEY_RE = re.compile(LABEL_KEY_PATTERN.removesuffix("$") + r"\Z")
#: A label's value: 0-256 characters, no control characters.
LABEL_VALUE_PATTERN = r"^[^\x00-\x1f\x7f]{0,256}$"
_LABEL_VALUE_RE = re.compile(LABEL_VALUE_PATTERN.removesuffix("$") + r"\Z")
#: Labels one machine may carry (its own and those it inherits from its source).
MAX_LABELS = 32
LABEL_RULE = (f"at most {MAX_LABELS} labels; a key is 1-128 letters, digits, '.', '_', '/' "
              "or '-', starting and ending with a letter or digit; a value is 0-256 "
              "characters without control characters")
_LABELS_SCHEMA = {
    "type": "object", "maxProperties": MAX_LABELS,
    "propertyNames": {"minLength": 1, "maxLength": 128, "pattern": LABEL_KEY_PATTERN},
    "additionalProperties": {"type": "string", "maxLength": 256,
                             "pattern": LABEL_VALUE_PATTERN},
}


def check_labels(labels: object, field: str = "labels") -> dict[str, str]:
    """A copy of ``labels`` if it is a mapping of label keys to values within the bounds
    (`LABEL_RULE`).

    Raises:
        InvalidRequest: it is not, saying which key or value breaks which rule.
    """
    if not isinstance(labels, dict):
        from collections.abc import Mapping

        if not isinstance(labels, Mapping):
            raise InvalidRequest(f"labels must be a mapping of strings to strings, not "
                                 f"{type(labels).__name__}", field=field, hint=LABEL_RULE)
    out = dict(labels)
    if len(out) > MAX_LABELS:
        raise InvalidRequest(f"{len(out)} labels: the limit is {MAX_LABELS} per machine "
                             "(inherited labels included)", field=field, hint=LABEL_RULE)
    for key, value in out.items():
        if not isinstance(key, str) or not _LABEL_KEY_RE.match(key):
            raise InvalidRequest(f"invalid label key {str(key)[:140]!r}", field=field,
                                 hint=LABEL_RULE)
        if not isinstance(value, str) or not _LABEL_VALUE_RE.match(value):
            raise InvalidRequest(f"invalid value for label {key!r}: {str(value)[:60]!r}",
                                 field=field, hint=LABEL_RULE)
    return out


def _labels_field(labels: object) -> dict[str, str]:
    """`check_labels` for a pydantic validator (its ValueError becomes a 400)."""
    try:
        return check_labels(labels)
    except InvalidRequest as exc:
        raise ValueError(f"{exc.message} ({exc.hint})") from None


#: The longest lifetime a machine may be given (``timeout=``, ``set_timeout``): 30 days.
MAX_TIMEOUT = 30 * 24 * 3600
#: What a machine's end does: delete it (the default) or hibernate it.
OnTimeout = Literal["delete", "hibernate"]
ON_TIMEOUT = ("delete", "hibernate")
TIMEOUT_RULE = (f"a whole number of seconds, 1-{MAX_TIMEOUT} (30 days), counted from "
                "the request")


def check_timeout(seconds: object, field: str = "timeout") -> int:
    """``seconds`` as a machine lifetime: an int (not a bool, not a float) in
    1-`MAX_TIMEOUT`.

    Raises:
        InvalidRequest: it is not.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, SupportsIndex) \
            or isinstance(seconds, float):
        raise InvalidRequest(f"{field} must be an int of seconds, not "
                             f"{type(seconds).__name__} {seconds!r}", field=field,
                             hint=TIMEOUT_RULE)
    number = operator.index(seconds)
    if not 1 <= number <= MAX_TIMEOUT:
        raise InvalidRequest(f"{field} {number} is out of range", field=field,
                             hint=TIMEOUT_RULE + "; set_timeout(ref, None) clears a lifetime")
    return number


def check_on_timeout(action: object) -> OnTimeout:
    """Raises: InvalidRequest: ``action`` is neither "delete" nor "hibernate"."""
    if action == "delete":
        return "delete"
    if action == "hibernate":
        return "hibernate"
    raise InvalidRequest(f"on_timeout must be 'delete' or 'hibernate', not {action!r}",
                         field="on_timeout", hint="the default is 'delete'")


def _timeout_field(seconds: object) -> int | None:
    """`check_timeout` for a pydantic validator (its ValueError becomes a 400). On the
    wire a JSON number without a fraction (``3.0``) is an integer, as JSON Schema (and
    the API's schema) says; the SDKs still refuse a Python float."""
    if seconds is None:
        return None
    if isinstance(seconds, float) and seconds.is_integer():
        seconds = int(seconds)
    try:
        return check_timeout(seconds)
    except InvalidRequest as exc:
        raise ValueError(f"{exc.message} ({exc.hint})") from None


#: A lifetime in a request: checked by `check_timeout`; the schema states it.
Timeout = Annotated[int | None, WithJsonSchema(
    {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_TIMEOUT}, {"type": "null"}]})]
TIMEOUT_DOC = (f"lifetime in seconds (1-{MAX_TIMEOUT}): at its end the machine is deleted, "
               "or hibernated with on_timeout='hibernate'; default none")
ON_TIMEOUT_DOC = "what its end does: 'delete' (default) or 'hibernate'"

#: Longest admission wait a request may ask for (seconds).
MAX_WAIT = 3600
WAIT_DOC = (f"seconds (0-{MAX_WAIT}) to wait in the account's queue for room when the "
            "account's quota or the nodes' room is used up, instead of a 429/507 at once; "
            "at the end a 429 quota_exceeded with retry_after (and a Retry-After header); "
            "absent or 0: no wait")
Wait = Annotated[float | None, Field(ge=0, le=MAX_WAIT, description=WAIT_DOC)]


#: A machine's labels in a request: checked by `check_labels`; the schema states it.
Labels = Annotated[dict[str, str], WithJsonSchema(_LABELS_SCHEMA)]


#: An API key's label: 1-64 printable characters (no control characters).
KEY_NAME_RE = r"^[^\x00-\x1f\x7f]{1,64}$"


class MachineState(StrEnum):
    """Lifecycle of a machine. Transitions are checked in one place (`boxd.node.lifecycle`).

    ``suspended`` machines have their vCPUs stopped (memory resident); ``hibernated``
    ones have memory and device state on disk and no VM process. ``hibernating``,
    ``waking``, ``swapping`` and ``restoring`` are transient: requests that need the
    machine wait for them to finish (and wake a suspended or hibernated machine).
    """

    STARTING = "starting"
    RUNNING = "running"
    SUSPENDED = "suspended"
    HIBERNATING = "hibernating"
    HIBERNATED = "hibernated"
    WAKING = "waking"
    SWAPPING = "swapping"
    RESTORING = "restoring"
    FAILED = "failed"
    LOST = "lost"
    DELETING = "deleting"


#: What an image name looks like (``NAME[:TAG]``; `boxd.images.oci.parse_name` is the rule).
IMAGE_NAME_PATTERN = r"^[a-z0-9]+(?:[._/-][a-z0-9]+)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$"
#: An imported image a machine runs: ``NAME[:TAG]``, or its manifest digest.
IMAGE_REF_PATTERN = r"^(?:sha256:[0-9a-f]{64}|" + IMAGE_NAME_PATTERN[1:-1] + r")$"


class MachineImage(BaseModel):
    """The container image a machine runs (`MachineCreate.image`)."""

    name: str = Field(description="the image's name as given (NAME:TAG or its digest)")
    digest: str = Field(description="its manifest's digest")
    service: list[str] = Field(
        default_factory=list, description="its ENTRYPOINT + CMD, started as the machine's "
        "service (`GET /v1/machines/{ref}/logs`); empty: none, or not started")


class MachineCreate(BaseModel):
    # A machine starts from an image or from a snapshot, not both (the route answers 400).
    model_config = ConfigDict(json_schema_extra={"not": {
        "required": ["image", "from_snapshot"],
        "properties": {"image": {"type": "string"}, "from_snapshot": {"type": "string"}},
    }})

    name: Name | None = Field(
        None, description=f"unique per account; generated if absent. {NAME_RULE}")
    vcpus: int = Field(config.DEFAULT_VCPUS, ge=1, le=config.MAX_VCPUS)
    memory_mib: int = Field(config.DEFAULT_MEMORY_MIB, ge=128, le=config.MAX_MEMORY_MIB)
    disk_gib: int = Field(config.DEFAULT_DISK_GIB, ge=1, le=config.MAX_DISK_GIB)
    isolated: bool = Field(False, description="no network device at all")
    public: bool = Field(
        False, description="its URL needs no token: any local user and any client reaches "
        "the guest's port 8080 (raw TCP too); default: the URL carries a per-machine token")
    from_snapshot: str | None = Field(None, description="NAME, NAME@VERSION or sha256:DIGEST")
    engine: Annotated[str, WithJsonSchema({"type": "string", "enum": list(ENGINE_NAMES)})] \
        | None = Field(
        None, pattern=r"^[a-z][a-z0-9-]{0,31}$",
        description="engine to run it on (qemu or gvisor); default: the daemon's "
        "(BOXD_ENGINE)",
    )
    suspend_after: float | None = Field(
        None, ge=0, le=10**9,
        description="idle seconds before its vCPUs stop; 0 never; default BOXD_SUSPEND_AFTER",
    )
    hibernate_after: float | None = Field(
        None, ge=0, le=10**9,
        description="idle seconds before it goes to disk; 0 never; default BOXD_HIBERNATE_AFTER",
    )
    node: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$",
        description="id of the cluster node to place it on (`boxd nodes list`); default: "
        "the node with the most free memory",
    )
    labels: Labels = Field(
        default_factory=dict,
        description=f"labels to find it by (list and delete by selector). {LABEL_RULE}")
    timeout: Timeout = Field(None, description=TIMEOUT_DOC)
    on_timeout: OnTimeout | None = Field(None, description=ON_TIMEOUT_DOC)
    wait: Wait = None
    image: str | None = Field(
        None, max_length=330, pattern=IMAGE_REF_PATTERN,
        description="an image imported for the account (`boxd image import`): NAME[:TAG] "
        "or sha256:DIGEST; the machine's root is that image's files, and its ENV and "
        "WORKDIR are exec's defaults (either engine); not with from_snapshot")
    service: bool = Field(
        True, description="with image: start the image's ENTRYPOINT + CMD as the "
        "machine's service once it boots (its HEALTHCHECK, else its first EXPOSEd port, "
        "then decides when it is ready); false: do not start it")
    expose_host: list[Annotated[StrictInt, Field(ge=1, le=65535)]] = Field(
        default_factory=list, max_length=16,
        description="TCP ports of the host's loopback (127.0.0.1) the machine reaches at "
        "host.boxd.internal:PORT, and nothing else of the host; inherited by forks. Not "
        "the daemon's own ports (its listeners, the bands of machines' URL ports)")
    egress: list[Annotated[str, Field(min_length=1, max_length=260)]] | None = Field(
        None, max_length=64,
        description="allow-list of the machine's outbound connections: CIDRs, IPv4 "
        "addresses, host names, each with an optional :PORT (names are resolved once, "
        "when the machine is created); [] allows none. DNS to the host's resolvers and "
        "expose_host's ports stay; private, loopback and link-local ranges stay blocked. "
        "Default (null): every public address. Inherited by forks")

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, labels: object) -> object:
        return _labels_field(labels)

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, seconds: object) -> object:
        return _timeout_field(seconds)

    @field_validator("expose_host", mode="before")
    @classmethod
    def _ports(cls, ports: object) -> object:
        # A JSON number without a fraction (8000.0) is an integer, as the schema says.
        if isinstance(ports, list):
            return [int(p) if isinstance(p, float) and p.is_integer() else p for p in ports]
        return ports


class Machine(BaseModel):
    id: str
    name: str
    state: MachineState
    vcpus: int
    memory_mib: int
    disk_gib: int
    isolated: bool
    port: int | None = Field(None, description="host port forwarded to the guest's port 8080")
    url: str | None = Field(
        None, description="http://127.0.0.1:PORT/TOKEN: use it as given (a path under it "
        "reaches the guest's port 8080 at that path); a public machine's has no token")
    public: bool = Field(False, description="its URL needs no token (see MachineCreate)")
    parent_id: str | None = Field(None, description="machine this one was forked from")
    snapshot: str | None = Field(None, description="snapshot digest this machine started from")
    accelerator: str | None = None
    error: str | None = None
    created_at: float
    node: str | None = Field(None, description="id of the node that runs the machine")
    engine: str | None = Field(None, description="engine that runs it (qemu or gvisor)")
    suspend_after: float | None = Field(None, description="its idle timer (None: default)")
    hibernate_after: float | None = Field(None, description="its idle timer (None: default)")
    idle_seconds: float | None = Field(None, description="seconds since a request needed it")
    labels: dict[str, str] = Field(
        default_factory=dict, description="its labels (a fork's: its source's merged with "
        "its own)")
    end_at: datetime | None = Field(
        None, description="when its lifetime ends (UTC; None: it has none): it is then "
        "deleted, or hibernated (see on_timeout)")
    on_timeout: OnTimeout | None = Field(
        None, description="what its end does: 'delete' or 'hibernate' (None: no lifetime)")
    image: MachineImage | None = Field(
        None, description="the container image it runs (None: boxd's default guest image)")
    expose_host: list[int] = Field(
        default_factory=list,
        description="host loopback ports it reaches at host.boxd.internal:PORT")
    egress: list[str] | None = Field(
        None, description="its egress allow-list as enforced: A.B.C.D/N or A.B.C.D/N:PORT "
        "(names resolved when it was created); null: the default (public addresses)")

    def url_for(self, port: int = config.GUEST_HTTP_PORT) -> str:
        """Its URL for a guest TCP port: ``url`` for 8080, ``http://127.0.0.1:PORT/TOKEN.N``
        for port N (the proxy relays it to the guest's port N, WebSockets included; the
        same token, wake and keep-awake rules).

        Raises:
            InvalidRequest: a port that is not an int (a bool, a float, a str of digits
                included: see `tcp_port`) or is outside 1-65535, a machine without a URL
                (isolated), or another port than 8080 of a public machine (its bare URL
                is a raw TCP relay to port 8080: there is no path to name a port in).
        """
        port = tcp_port(port)
        if self.url is None:
            raise InvalidRequest(f"machine {self.name!r} has no URL (isolated)", field="port")
        if port == config.GUEST_HTTP_PORT:
            return self.url
        if self.public:
            raise InvalidRequest(
                f"machine {self.name!r} is public: its URL relays raw TCP to port "
                f"{config.GUEST_HTTP_PORT} only", field="port",
                hint="create it without public=True for a URL per guest port")
        return f"{self.url.rstrip('/')}.{port}"


def tcp_port(port: object) -> int:
    """``port`` as a guest TCP port: an int (or any integer type, such as numpy's) in
    1-65535. A bool, a float (even ``8000.0``) or a str (even ``"80"``) is refused, not
    converted: the URL would name what was given (``.8000.0``, ``.True``), which the
    proxy rejects, and a str port is most often a parsing step the caller forgot.

    Raises:
        InvalidRequest: not an integer, or outside 1-65535.
    """
    if isinstance(port, bool) or not isinstance(port, SupportsIndex):
        hint = (f"convert it first: int({port!r})" if isinstance(port, str)
                and port.strip().isdecimal() else "give the port as an int, e.g. 8000")
        raise InvalidRequest(f"port must be an int, not {type(port).__name__} {port!r}",
                             field="port", hint=hint)
    number = operator.index(port)
    if not 1 <= number <= 65535:
        raise InvalidRequest(f"port {number} is not a TCP port (1-65535)", field="port")
    return number


class MachineList(BaseModel):
    machines: list[Machine]
    next_cursor: str | None = Field(
        None, description="pass as ``cursor`` for the next page; None: this was the last")


#: Machines one list page holds at most (``limit``), and its default.
MAX_LIST_LIMIT = 1000
DEFAULT_LIST_LIMIT = 1000


FORK_NODE = ("id of the cluster node to put the children on (`boxd nodes list`); default: "
             "the source's node while it has room, then the others. Only a QEMU machine's "
             "forks can go to another node")


FORK_LABELS = ("labels of the children, merged over the source's (which they inherit). "
               + LABEL_RULE)


FORK_TIMEOUT = ("each child's lifetime in seconds, counted from the fork (1-"
                f"{MAX_TIMEOUT}); a child does not inherit its source's; default none")


class SetTimeout(BaseModel):
    """A machine's new lifetime, counted from the request."""

    timeout: Timeout = Field(
        ..., description=f"seconds from now (1-{MAX_TIMEOUT}); null clears the lifetime")
    on_timeout: OnTimeout | None = Field(
        None, description="'delete' or 'hibernate'; default: what it was ('delete' if none)")

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, seconds: object) -> object:
        return _timeout_field(seconds)


class ForkRequest(BaseModel):
    name: Name | None = Field(None, description="name of the child; generated if absent")
    node: str | None = Field(None, description=FORK_NODE)
    labels: Labels = Field(default_factory=dict, description=FORK_LABELS)
    timeout: Timeout = Field(None, description=FORK_TIMEOUT)
    on_timeout: OnTimeout | None = Field(None, description=ON_TIMEOUT_DOC)
    wait: Wait = None

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, labels: object) -> object:
        return _labels_field(labels)

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, seconds: object) -> object:
        return _timeout_field(seconds)


MAX_STANDBY_FORKS = 64  # standby forks one warm request may ask for (a fork batch's max)


class WarmRequest(BaseModel):
    forks: int = Field(
        ..., ge=0, le=MAX_STANDBY_FORKS,
        description="standby forks of the machine's current state to keep ready; 0 "
        "releases them")


class Standby(BaseModel):
    """A machine's standby forks: prepared children the next forks claim."""

    machine_id: str
    forks: int = Field(description="standby forks ready now")
    memory_bytes: int = Field(description="host memory they hold (proportional set size)")
    engine: str


class ForkBatchRequest(BaseModel):
    # One of the two is needed (the route answers 400 otherwise); when both are given,
    # count must equal len(names), which JSON Schema cannot state.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["count"], "properties": {"count": {"type": "integer"}}},
        {"required": ["names"], "properties": {"names": {"type": "array"}}},
    ]})

    count: int | None = Field(None, ge=1, le=64, description="number of children")
    # The route checks the list (its 400 says what is wrong); the schema states it.
    names: list[Name] | None = Field(
        None, description="names of the children, each once (count may be omitted)",
        json_schema_extra={"minItems": 1, "maxItems": 64, "uniqueItems": True},
    )
    node: str | None = Field(None, description=FORK_NODE)
    labels: Labels = Field(default_factory=dict, description=FORK_LABELS)
    timeout: Timeout = Field(None, description=FORK_TIMEOUT)
    on_timeout: OnTimeout | None = Field(None, description=ON_TIMEOUT_DOC)
    wait: Wait = None

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, labels: object) -> object:
        return _labels_field(labels)

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, seconds: object) -> object:
        return _timeout_field(seconds)


class ErrorBody(BaseModel):
    code: str
    message: str
    hint: str = ""
    details: dict[str, object] = Field(default_factory=dict)


class ForkItem(BaseModel):
    """One child of a batch fork: the machine, or the error that stopped it."""

    machine: Machine | None = None
    error: ErrorBody | None = None


class ForkResult(BaseModel):
    children: list[ForkItem]


class MachineRef(BaseModel):
    id: str
    name: str


class DeleteItemError(BaseModel):
    machine: MachineRef
    error: ErrorBody


class MachinesDeleted(BaseModel):
    """What a delete by labels removed, and the machines it could not remove."""

    deleted: list[MachineRef]
    errors: list[DeleteItemError] = Field(default_factory=list)


#: An exec id: what `ExecRequest.exec_id` and the execs route accept.
EXEC_ID_PATTERN = r"^[A-Za-z0-9_.-]+$"
EXEC_ID_MAX = 128


class ExecRequest(BaseModel):
    command: NoNul | Argv = Field(
        ..., description="shell string (run by /bin/sh -c) or argv; no NUL bytes; at most "
        f"{MAX_ARGV_ITEMS} items of {MAX_ARG_BYTES} bytes each, {MAX_EXEC_BYTES} bytes "
        "with env"
    )
    env: ExecEnv = Field(
        default_factory=dict,
        description="variables set for the command; names without '=', no NUL bytes",
    )
    cwd: GuestCwd | None = Field(default=None,
                                 description="absolute path of its working directory")
    user: GuestUser | None = Field(default=None, description=USER_DESCRIPTION)
    timeout: float | None = Field(
        None, gt=0, le=MAX_EXEC_TIMEOUT, allow_inf_nan=False,
        description=f"seconds (at most {MAX_EXEC_TIMEOUT:.0f}); the command is killed after",
    )
    stdin: str | None = None
    exec_id: str | None = Field(
        default=None, min_length=1, max_length=EXEC_ID_MAX, pattern=EXEC_ID_PATTERN,
        description="the exec's id on its machine (letters, digits, '_', '.', '-'; "
        "generated when absent): read its result with GET /v1/machines/{id}/execs/"
        "{exec_id}, also after this request's connection is lost. An id whose exec is "
        "still kept (running or finished) is not run again: the request waits for that "
        "exec and returns its result (409 exec_id_conflict if the command differs)",
    )

    @field_validator("command", mode="before")
    @classmethod
    def _command_items(cls, command: object) -> object:
        return check_argv_items(command)

    @field_validator("command")
    @classmethod
    def _command(cls, command: str | list[str]) -> str | list[str]:
        return check_argv(command)

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        return check_env(env, info.data.get("command"))


class ExecResult(BaseModel):
    exec_id: str | None = Field(
        None, description="the exec's id (read it again with GET .../execs/{exec_id})")
    stdout: str
    stderr: str
    exit_code: int = Field(..., description="exit status; 128+N when killed by signal N")
    signal: int | None = Field(None, description="signal that killed the command, if any")
    timed_out: bool = False
    duration: float
    stdout_truncated: bool = Field(
        False, description="stdout was cut at the daemon's limit (BOXD_MAX_EXEC_OUTPUT, "
        "16 MiB by default); the command ran to its end. Stream the exec for all of it")
    stderr_truncated: bool = Field(False, description="stderr was cut, as stdout_truncated")


class ExecStatus(BaseModel):
    """A durable exec's state (``GET /v1/machines/{id}/execs/{exec_id}``): running, or
    its exit, with the last MiB of each stream (docs/lifecycle.md#durable-exec)."""

    exec_id: str
    running: bool = Field(..., description="true: it still runs (exit fields are null)")
    stdout: str = Field(..., description="the last bytes of its stdout (so far)")
    stderr: str
    stdout_truncated: bool = Field(
        False, description="earlier stdout was dropped: only its last bytes are kept")
    stderr_truncated: bool = False
    exit_code: int | None = Field(None, description="exit status; 128+N when killed by "
                                  "signal N; null while running or when it failed")
    signal: int | None = None
    timed_out: bool = False
    duration: float | None = Field(None, description="seconds it ran (null while running)")
    started_at: float = Field(..., description="when it started (Unix time)")
    error: ErrorBody | None = Field(
        None, description="it ended without an exit status (its machine failed, was "
        "deleted or stopped answering): what happened")


#: Execs ``GET /v1/machines/{id}/execs`` lists by default, and at most (a node keeps
#: the last 64 per machine: `boxd.node._exec_records.KEEP_PER_MACHINE`).
DEFAULT_EXEC_LIST = 20
MAX_EXEC_LIST = 64
#: Characters of an exec's command a listing shows (the rest is cut, with "…").
EXEC_COMMAND_SHOWN = 500


class ServiceLog(BaseModel):
    """A machine's service output (stdout and stderr as it wrote them) after an offset
    (``GET /v1/machines/{ref}/logs``). Offsets count bytes since the service started;
    the node keeps the last 64 KiB."""

    start: int = Field(..., description="the offset of data's first byte: past the one "
                       "asked for when the bytes between were dropped")
    end: int = Field(..., description="the offset after data: ask with after=end next")
    data: str = Field(..., description="the bytes as UTF-8 (invalid bytes replaced)")
    state: str = Field(..., description="running, detached or exited (no more will come)")
    exit_code: int | None = None
    argv: list[str] = Field(default_factory=list, description="what the service runs")


class ExecSummary(BaseModel):
    """One kept exec of a machine, without its output (``GET /v1/machines/{id}/execs``):
    read the output with ``GET /v1/machines/{id}/execs/{exec_id}``."""

    exec_id: str
    command: str = Field(..., description="the command as a shell reads it (an argv "
                         f"joined with shell quoting), its first {EXEC_COMMAND_SHOWN} "
                         "characters")
    running: bool
    exit_code: int | None = Field(None, description="null while running or when it failed")
    signal: int | None = None
    timed_out: bool = False
    duration: float | None = Field(None, description="seconds it ran (null while running)")
    started_at: float = Field(..., description="when it started (Unix time)")
    error: ErrorBody | None = Field(None, description="it ended without an exit status")


class ExecList(BaseModel):
    execs: list[ExecSummary] = Field(..., description="newest first")


class ExecEvent(BaseModel):
    """One line of a streaming exec (NDJSON): output as it arrives, then the exit."""

    type: str = Field(..., description="'stdout', 'stderr', 'exit' or 'error' (stream failed)")
    data: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool | None = None
    duration: float | None = None
    error: ErrorBody | None = Field(
        None, description="set on a final 'error' event when the stream fails midway"
    )


#: Seconds between the samples a node takes of a machine someone asked for recently.
METRICS_INTERVAL = 5.0
#: Samples a node keeps per machine (10 minutes at `METRICS_INTERVAL`).
METRICS_KEPT = 120


class MetricSample(BaseModel):
    """One reading of a running machine's resources, from inside its guest."""

    timestamp: float = Field(..., description="when it was taken (Unix time, the host's)")
    cpu_count: int = Field(..., description="CPUs the guest sees")
    cpu_used_pct: float = Field(..., description="percent of all the guest's CPU time "
                                "spent busy since the sample before (0-100; the first "
                                "sample: since the guest booted)")
    mem_total: int = Field(..., description="bytes of memory the guest has")
    mem_used: int = Field(..., description="bytes in use (total minus available)")
    mem_cache: int = Field(..., description="bytes of page cache")
    disk_total: int = Field(..., description="bytes of the root file system")
    disk_used: int = Field(..., description="bytes used on it")


class MachineMetrics(BaseModel):
    """A machine's recent resource samples (``GET /v1/machines/{ref}/metrics``).

    Asking samples a running machine now and keeps sampling it every
    `METRICS_INTERVAL` seconds for the next 5 minutes; the node keeps its last
    `METRICS_KEPT` samples. A machine that is not running is not woken: its kept
    samples are answered as they are."""

    machine: str = Field(..., description="the machine's name")
    state: MachineState
    interval: float = Field(default=METRICS_INTERVAL, description="seconds between samples")
    samples: list[MetricSample] = Field(..., description="oldest first")


class FileInfo(BaseModel):
    path: str
    size: int
    mode: int
    sha256: str


class CheckpointCreate(BaseModel):
    name: Name


class Checkpoint(BaseModel):
    id: str
    name: str
    machine_id: str
    created_at: float


class CheckpointList(BaseModel):
    checkpoints: list[Checkpoint]


class SnapshotCreate(BaseModel):
    machine: str = Field(..., description="machine name or id")
    name: Name
    new_version: bool = Field(False, description="add a version to an existing name")


class Snapshot(BaseModel):
    id: str
    name: str
    version: int
    digest: str
    created_at: float
    source_machine: str | None = None
    memory_bytes: int = 0
    disk_bytes: int = 0
    stored_bytes: int = 0
    engine: str | None = None
    cpu_model: str | None = None
    image: str | None = None


class SnapshotList(BaseModel):
    snapshots: list[Snapshot]


class ApiKey(BaseModel):
    id: str
    name: str
    prefix: str
    created_at: float
    revoked_at: float | None = None


class ApiKeyCreated(ApiKey):
    secret: str = Field(..., description="shown once; send as 'Authorization: Bearer <secret>'")


class ApiKeyCreate(BaseModel):
    name: str = Field("default", pattern=KEY_NAME_RE,
                      description="a label: 1-64 printable characters")
    account: Name | None = Field(
        None,
        description="account name to create the key for (created if new); only the local "
        "account's keys may name another account",
    )


class ApiKeyList(BaseModel):
    keys: list[ApiKey]


#: The fields a saved reproducibility report must have, with their types.
REPORT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "env": str, "identical": bool, "seeds": int, "diverged": int, "steps": int,
    "runs": int, "pairs": list,
}


_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", list: "array"}
#: What the API's schema says of a saved report: the fields `ReportSave` checks.
_REPORT_SCHEMA = {
    "type": "object", "required": list(REPORT_FIELDS),
    "properties": {k: {"type": _JSON_TYPES[v]} for k, v in REPORT_FIELDS.items()
                   if isinstance(v, type)},
}


class ReportSave(BaseModel):
    name: Name = Field(..., description=f"the report's name; saving it again replaces it. "
                       f"{NAME_RULE}")
    report: Annotated[dict[str, Any], WithJsonSchema(_REPORT_SCHEMA)] = Field(
        ..., description="a `boxd rl verify --json` sweep report (its JSON Schema: "
        "`boxd rl verify --schema`), with its ``causes`` as [cause, seeds] pairs")

    @field_validator("report")
    @classmethod
    def _report(cls, report: dict[str, Any]) -> dict[str, Any]:
        report = dict(report)
        for key, kind in REPORT_FIELDS.items():
            value = report.get(key)
            if kind is int and isinstance(value, float) and value.is_integer():
                report[key] = value = int(value)  # JSON's 3.0 is an integer (JSON Schema)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"report.{key} must be a {getattr(kind, '__name__', kind)}")
        return report


class Report(BaseModel):
    """A saved reproducibility report: its name and verdict (the whole report: GET
    /v1/reports/NAME)."""

    name: str
    created_at: float
    env: str
    identical: bool
    seeds: int
    diverged: int


class ReportList(BaseModel):
    reports: list[Report]


class ReportData(Report):
    report: dict[str, Any] = Field(..., description="the report as it was saved")


class Account(BaseModel):
    name: str
    id: str
    max_machines: int = Field(..., description="concurrent machines (hibernated ones free)")
    machines: int = Field(..., description="machines that count against max_machines now")
    created_at: float


class AccountList(BaseModel):
    accounts: list[Account]


class AccountUpdate(BaseModel):
    max_machines: int = Field(..., ge=0, le=1_000_000)


class Health(BaseModel):
    """Answer of ``GET /v1/health``: tells a client that a daemon answers."""

    ok: bool
    version: str
    pid: int


class EngineInfo(BaseModel):
    """One engine on the host: whether it can run machines here, and why."""

    name: str
    status: str = Field(description="ok or unavailable")
    reason: str
    accelerator: str | None = Field(None, description="kvm, tcg (qemu) or systrap (gvisor)")
    default: bool = Field(False, description="new machines get it unless they ask")


class NodeInfo(BaseModel):
    """One node that runs machines: this host, or a Ray node (``boxd serve --ray``)."""

    id: str
    address: str = Field(description="the node's address (Ray's node IP; 127.0.0.1 locally)")
    health: str = Field(description="alive, or dead (its machines are lost)")
    machines: int = Field(description="machines placed on it (every state)")
    max_machines: int = Field(description="cap on its machines (BOXD_NODE_MAX_MACHINES)")
    memory_total_mib: int
    memory_free_mib: int = Field(description="host memory available for more guests")
    engine: str | None = None
    error: str | None = Field(None, description="why it is dead")


class NodeList(BaseModel):
    nodes: list[NodeInfo]


class AccountQueue(BaseModel):
    """One account's requests waiting for room (`wait=` on create and fork)."""

    account: str
    waiting: int
    oldest_seconds: float = Field(description="how long its first request has waited")


class AdmissionQueue(BaseModel):
    """The admission queues: creates and forks waiting for room."""

    waiting: int = Field(description="requests waiting, every account shown")
    accounts: list[AccountQueue] = Field(default_factory=list)
    per_account: int = Field(description="requests one account may have waiting")


class HostInfo(BaseModel):
    version: str
    engine: str
    qemu: str
    qemu_version: str
    accelerator: str
    accelerator_reason: str
    cpu_model: str
    data_dir: str
    image: str | None = None
    engines: list[EngineInfo] = Field(default_factory=list)
    engine_reason: str | None = None  # why BOXD_ENGINE=auto chose the default engine
    limits: str | None = None  # per-machine resource limits (cgroups), or why there are none
    standby_forks: int = 0  # standby fork children ready on this node (not the user's machines)
    standby_memory_bytes: int = 0  # the host memory they hold (proportional set size)
    queue: AdmissionQueue | None = None  # the caller's creates and forks waiting for room


# --- container images (boxd image import / list / inspect / rm) ----------------------


#: The transports an import takes (the rest of a source is checked when it is read).
IMAGE_SOURCE_PATTERN = r"^(?:(?:oci|oci-archive|docker-archive):.|docker://.)"


class ImageImport(BaseModel):
    source: str = Field(
        description="oci:DIR[:REF], oci-archive:FILE[:REF], docker-archive:FILE[:REPO:TAG] "
        "or docker://HOST[:PORT]/REPO[:TAG|@DIGEST]; paths are on the daemon's host",
        pattern=IMAGE_SOURCE_PATTERN, max_length=4096)
    name: str = Field(description="NAME[:TAG] to store it under (tag latest when absent)",
                      max_length=330, pattern=IMAGE_NAME_PATTERN)
    creds: str | None = Field(None, description="USER:PASSWORD for the registry (default: "
                              "the daemon user's ~/.docker/config.json)")
    insecure: bool = Field(False, description="allow a registry on plain HTTP")


class ImageLayer(BaseModel):
    digest: str
    size: int
    media_type: str


class ImageRunConfig(BaseModel):
    """What the image's config says about running it."""

    env: list[str] = Field(default_factory=list)
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    working_dir: str = ""
    user: str = ""
    exposed_ports: list[str] = Field(default_factory=list)
    healthcheck: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)


class Image(BaseModel):
    name: str = Field(description="NAME:TAG")
    digest: str = Field(description="the manifest's digest: the image's identity")
    config_digest: str
    layers: list[ImageLayer]
    size: int = Field(description="bytes of its config and layers as stored (compressed)")
    architecture: str
    os: str
    created: str
    config: ImageRunConfig


class ImageList(BaseModel):
    images: list[Image]
