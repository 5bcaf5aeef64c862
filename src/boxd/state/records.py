"""The records the state layer returns: frozen values, never ``sqlite3.Row``.

Every layer above ``state/`` sees these dataclasses only; a change is made by asking a
repository (`boxd.state.repos`) to write, which returns a new record where it matters.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from boxd.models import MachineState
from boxd.net_policy import DEFAULT as DEFAULT_POLICY
from boxd.net_policy import NetPolicy


@dataclass(frozen=True)
class RunImage:
    """The container image a machine runs (``machines.run_image``): its name as the
    account gave it, its manifest digest, the config exec defaults to, and its service
    (ENTRYPOINT + CMD, started unless ``service`` is false; HEALTHCHECK and EXPOSE
    decide when it is ready: `boxd.node._services`)."""

    name: str
    digest: str
    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    healthcheck: tuple[str, ...] = ()
    exposed_ports: tuple[str, ...] = ()
    service: bool = True

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "digest": self.digest, "env": list(self.env),
                "working_dir": self.working_dir, "user": self.user,
                "entrypoint": list(self.entrypoint), "cmd": list(self.cmd),
                "healthcheck": list(self.healthcheck),
                "exposed_ports": list(self.exposed_ports), "service": self.service}

    @classmethod
    def from_json(cls, data: object) -> RunImage | None:
        """The record's JSON (a record written before the service fields has none)."""
        if not isinstance(data, dict) or not data.get("digest"):
            return None

        def strs(key: str) -> tuple[str, ...]:
            return tuple(str(e) for e in data.get(key) or ())

        return cls(str(data.get("name", "")), str(data["digest"]), strs("env"),
                   str(data.get("working_dir") or ""), str(data.get("user") or ""),
                   strs("entrypoint"), strs("cmd"), strs("healthcheck"),
                   strs("exposed_ports"), bool(data.get("service", True)))

    def exec_env(self) -> dict[str, str]:
        """The image's ENV as exec's defaults (``K=V``; a bare ``K`` sets it empty)."""
        out = {}
        for item in self.env:
            key, _, value = item.partition("=")
            if key:
                out[key] = value
        return out


@dataclass(frozen=True)
class MachineRecord:
    """One machine: identity and sizing (control plane), runtime columns (its node)."""

    id: str
    account_id: str
    name: str
    state: MachineState
    vcpus: int
    memory_mib: int
    disk_gib: int
    isolated: bool
    port: int | None  # the URL's port, held by the daemon
    fwd_port: int | None  # the port QEMU forwards to the guest's 8080 (per VM process)
    image: str
    layer_id: str | None  # active (writable) disk layer
    template_id: str | None  # RAM mapped copy-on-write from this template
    ram_shared: bool  # owns its RAM file (cheap to capture) vs maps an image privately
    pid: int | None
    vm_id: str  # the engine's id of the VM process (run dir, process name)
    generation: int  # bumped by every request that may change the guest
    parent_id: str | None
    snapshot: str | None  # digest it was started from
    error: str | None
    accel: str | None
    created_at: float
    node_id: str
    engine: str
    last_active: float
    suspend_after: float | None  # None: the daemon's default
    hibernate_after: float | None
    url_token: str | None = None  # the URL's secret path segment (None: no URL is served)
    url_public: bool = False  # the URL needs no token (an explicit opt-out)
    labels: dict[str, str] = field(default_factory=dict, hash=False)  # checked by the plane
    end_at: float | None = None  # its lifetime's end (epoch seconds); None: none
    on_timeout: str | None = None  # what the end does: "delete" or "hibernate"
    run_image: RunImage | None = None  # None: the default guest image
    net: NetPolicy = DEFAULT_POLICY  # host ports it reaches, its egress allow-list

    @classmethod
    def of(cls, row: sqlite3.Row) -> MachineRecord:
        return cls(
            id=row["id"], account_id=row["account_id"], name=row["name"],
            state=MachineState(row["state"]), vcpus=row["vcpus"], memory_mib=row["memory_mib"],
            disk_gib=row["disk_gib"], isolated=bool(row["isolated"]), port=row["port"],
            fwd_port=row["fwd_port"],
            image=row["image"], layer_id=row["layer_id"], template_id=row["template_id"],
            ram_shared=bool(row["ram_shared"]), pid=row["pid"], vm_id=row["vm_id"] or row["id"],
            generation=row["generation"], parent_id=row["parent_id"], snapshot=row["snapshot"],
            error=row["error"], accel=row["accel"], created_at=row["created_at"],
            node_id=row["node_id"], engine=row["engine"],
            last_active=row["last_active"] or row["created_at"],
            suspend_after=row["suspend_after"], hibernate_after=row["hibernate_after"],
            url_token=row["url_token"], url_public=bool(row["url_public"]),
            labels=json.loads(row["labels"] or "{}"),
            end_at=row["end_at"], on_timeout=row["on_timeout"],
            run_image=RunImage.from_json(json.loads(row["run_image"] or "null")),
            net=NetPolicy.from_json(json.loads(row["net_policy"] or "null")),
        )


@dataclass(frozen=True)
class LayerRecord:
    id: str
    parent_id: str | None
    base: str  # base image file when parent_id is None
    frozen: bool

    @classmethod
    def of(cls, row: sqlite3.Row) -> LayerRecord:
        return cls(row["id"], row["parent_id"], row["base"], bool(row["frozen"]))


@dataclass(frozen=True)
class TemplateRecord:
    """Frozen memory + device state that fork children of one source map."""

    id: str
    source_id: str | None
    layer_id: str
    mem_path: Path
    state_path: Path
    generation: int
    created_at: float

    @classmethod
    def of(cls, row: sqlite3.Row) -> TemplateRecord:
        return cls(
            row["id"], row["source_id"], row["layer_id"], Path(row["mem_path"]),
            Path(row["state_path"]), row["generation"], row["created_at"],
        )


@dataclass(frozen=True)
class CheckpointRecord:
    id: str
    machine_id: str
    name: str
    layer_id: str
    mem_path: Path | None  # None: the RAM is inside the state stream
    state_path: Path
    created_at: float

    @classmethod
    def of(cls, row: sqlite3.Row) -> CheckpointRecord:
        return cls(
            row["id"], row["machine_id"], row["name"], row["layer_id"],
            Path(row["mem_path"]) if row["mem_path"] else None, Path(row["state_path"]),
            row["created_at"],
        )


@dataclass(frozen=True)
class SnapshotRecord:
    id: str
    account_id: str
    name: str
    version: int
    digest: str  # hex sha256 of the manifest
    created_at: float

    @classmethod
    def of(cls, row: sqlite3.Row) -> SnapshotRecord:
        return cls(
            row["id"], row["account_id"], row["name"], row["version"], row["digest"],
            row["created_at"],
        )


@dataclass(frozen=True)
class AccountRecord:
    id: str
    name: str
    max_machines: int
    used: int  # machines counting against the quota now
    created_at: float

    @classmethod
    def of(cls, row: sqlite3.Row) -> AccountRecord:
        return cls(row["id"], row["name"], row["machine_quota"], row["used"], row["created_at"])


@dataclass(frozen=True)
class KeyRecord:
    id: str
    account_id: str
    name: str
    prefix: str
    created_at: float
    revoked_at: float | None

    @classmethod
    def of(cls, row: sqlite3.Row) -> KeyRecord:
        return cls(row["id"], row["account_id"], row["name"], row["prefix"], row["created_at"],
                   row["revoked_at"])


@dataclass(frozen=True)
class IdempotencyRecord:
    """A request's ``Idempotency-Key``: what it asked (``fingerprint``) and, once it is
    done, what it returned (``response``, JSON; None while it runs)."""

    account_id: str
    key: str
    fingerprint: str
    response: str | None
    created_at: float
    expires_at: float

    @classmethod
    def of(cls, row: sqlite3.Row) -> IdempotencyRecord:
        return cls(row["account_id"], row["key"], row["fingerprint"], row["response"],
                   row["created_at"], row["expires_at"])


@dataclass(frozen=True)
class Garbage:
    """What `Layers.collect` removed from the records: the caller removes the files."""

    template_dirs: tuple[Path, ...]
    layer_ids: tuple[str, ...]


__all__ = [
    "AccountRecord",
    "CheckpointRecord",
    "Garbage",
    "KeyRecord",
    "LayerRecord",
    "MachineRecord",
    "SnapshotRecord",
    "TemplateRecord",
]
