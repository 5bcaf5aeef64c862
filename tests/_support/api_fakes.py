"""In-memory fakes of the machine and snapshot services, for the API tests (no VMs).

They respect accounts: another account's machines and snapshots are invisible.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from boxd import models
from boxd import process_models as pm
from boxd.api import create_app
from boxd.api.services.keys import KeyService
from boxd.errors import (
    AlreadyExists,
    CheckpointNotFound,
    ExecNotFound,
    ExecTimeout,
    GuestFileNotFound,
    InvalidRequest,
    MachineFailed,
    MachineNotFound,
    NotFound,
    SnapshotNotFound,
)
from boxd.net_policy import resolve_egress
from boxd.node._processes import OutputLog
from boxd.services import MachineService, SnapshotService
from boxd.state import Database, new_id


def labels_match(m: models.Machine, labels: Mapping[str, str] | None) -> bool:
    return all(m.labels.get(k) == v for k, v in (labels or {}).items())


class FakeMachines(MachineService):
    def __init__(self) -> None:
        self.machines: dict[str, tuple[str, models.Machine]] = {}  # id -> (account, machine)
        self.files: dict[tuple[str, str], bytes] = {}
        self.checkpoints: dict[tuple[str, str], models.Checkpoint] = {}
        self.closed = False
        self.hanging = threading.Event()  # an exec of "hang" is under way
        self.execs: dict[tuple[str, str], models.ExecStatus] = {}  # (machine id, exec id)
        self.commands: dict[tuple[str, str], str] = {}  # (machine id, exec id) -> command
        self.stderr_logs: dict[str, OutputLog] = {}  # process id -> its stderr
        self.procs: dict[str, tuple[str, pm.Process, Any]] = {}  # id -> (account, p, queue)
        # (account, snapshot ref) -> bare digest; FakeSnapshots installs its lookup
        self.snapshot_digest: Callable[[str, str], str] | None = None

    def queue(self, account: str) -> models.AdmissionQueue:
        return models.AdmissionQueue(waiting=0, per_account=256)

    async def nodes_list(self) -> list[models.NodeInfo]:
        return [models.NodeInfo(id="local", address="127.0.0.1", health="alive",
                                machines=len(self.machines), max_machines=8,
                                memory_total_mib=4096, memory_free_mib=2048)]

    def _find(self, account: str, ref: str) -> models.Machine:
        for owner, m in self.machines.values():
            if owner == account and ref in (m.id, m.name):
                return m
        raise MachineNotFound(f"no machine {ref!r}", hint="boxd machine list", machine=ref)

    def _add(
        self, account: str, name: str | None, parent: str | None = None,
        snapshot: str | None = None, labels: Mapping[str, str] | None = None,
    ) -> models.Machine:
        if name is not None and not models.NAME_RE.match(name):
            raise InvalidRequest(f"invalid name {name!r}", field="name")
        name = name or f"m-{len(self.machines) + 1}"
        if any(o == account and m.name == name for o, m in self.machines.values()):
            raise AlreadyExists(f"machine {name!r} exists", kind="machine", name=name)
        m = models.Machine(
            id=new_id("m"), name=name, state=models.MachineState.RUNNING, vcpus=1,
            memory_mib=1024, disk_gib=8, isolated=False, parent_id=parent,
            snapshot=snapshot, created_at=time.time(), labels=dict(labels or {}),
        )
        self.machines[m.id] = (account, m)
        return m

    async def create(
        self, account: str, req: models.MachineCreate, idempotency_key: str | None = None,
    ) -> models.Machine:
        # like the real service: a machine made from a snapshot records its bare digest
        digest = None
        if req.from_snapshot is not None and self.snapshot_digest is not None:
            digest = self.snapshot_digest(account, req.from_snapshot)
        m = self._add(account, req.name, snapshot=digest, labels=req.labels)
        if req.expose_host or req.egress is not None:  # the real service's normal form
            m = m.model_copy(update={
                "expose_host": sorted(set(req.expose_host)),
                "egress": None if req.egress is None else list(resolve_egress(req.egress))})
            self.machines[m.id] = (account, m)
        if req.timeout is None:
            return m
        return await self.set_timeout(account, m.id, req.timeout, req.on_timeout or "delete")

    async def get(self, account: str, ref: str) -> models.Machine:
        return self._find(account, ref)

    async def list(self, account: str) -> list[models.Machine]:  # type: ignore[valid-type]
        return [m for o, m in self.machines.values() if o == account]

    async def list_page(
        self, account: str, *, labels: Mapping[str, str] | None = None,
        state: models.MachineState | None = None, limit: int = models.DEFAULT_LIST_LIMIT,
        cursor: str | None = None,
    ) -> models.MachineList:
        found = [m for o, m in self.machines.values() if o == account
                 and labels_match(m, labels) and state in (None, m.state)]
        if cursor and not (cursor.isascii() and cursor.isdigit()):  # "²".isdigit()
            raise InvalidRequest(f"invalid cursor {cursor!r}", field="cursor")
        start = int(cursor) if cursor else 0
        more = len(found) > start + limit
        return models.MachineList(machines=found[start:start + limit],
                                  next_cursor=str(start + limit) if more else None)

    async def delete(self, account: str, ref: str) -> None:
        del self.machines[self._find(account, ref).id]

    async def delete_many(
        self, account: str, labels: Mapping[str, str],
        state: models.MachineState | None = None,
    ) -> list[tuple[models.MachineRef, Exception | None]]:  # type: ignore[valid-type]
        if not labels:
            raise InvalidRequest("needs a label", field="label")
        gone = [m for o, m in list(self.machines.values()) if o == account
                and labels_match(m, labels) and state in (None, m.state)]
        for m in gone:
            del self.machines[m.id]
        return [(models.MachineRef(id=m.id, name=m.name), None) for m in gone]

    async def wait_until_ready(self, account: str, ref: str, timeout: float) -> models.Machine:
        return self._find(account, ref)

    async def exec(self, account: str, ref: str, req: models.ExecRequest) -> models.ExecResult:
        self._find(account, ref)
        cmd = req.command if isinstance(req.command, str) else " ".join(req.command)
        if cmd == "sleep 100":
            raise ExecTimeout("timed out", timeout=req.timeout, stdout="partial", stderr="")
        if cmd == "crash":
            raise RuntimeError("a bug in the service")
        if cmd == "hang":  # until the request is cancelled (the daemon stops)
            self.hanging.set()
            await asyncio.Event().wait()
        exec_id = req.exec_id or f"x-{len(self.execs)}"
        m = self._find(account, ref)
        self.commands[(m.id, exec_id)] = cmd
        self.execs[(m.id, exec_id)] = models.ExecStatus(
            exec_id=exec_id, running=False, stdout=cmd + "\n", stderr="", exit_code=0,
            duration=0.01, started_at=0.0)
        return models.ExecResult(exec_id=exec_id, stdout=cmd + "\n", stderr="", exit_code=0,
                                 duration=0.01)

    async def exec_result(
        self, account: str, ref: str, exec_id: str, wait: float = 0.0
    ) -> models.ExecStatus:
        m = self._find(account, ref)
        if (m.id, exec_id) not in self.execs:
            raise ExecNotFound(f"no exec {exec_id!r} is kept for machine {m.name!r}",
                               exec_id=exec_id)
        return self.execs[(m.id, exec_id)]

    async def exec_list(
        self, account: str, ref: str, limit: int = models.DEFAULT_EXEC_LIST
    ) -> list[models.ExecSummary]:  # type: ignore[valid-type]
        m = self._find(account, ref)
        kept = [(eid, st) for (mid, eid), st in self.execs.items() if mid == m.id]
        return [models.ExecSummary(command=self.commands.get((m.id, eid), ""),
                                   **{k: v for k, v in st if k in models.ExecSummary.model_fields
                                      and k != "command"})
                for eid, st in kept[::-1][:limit]]

    async def exec_stream(  # type: ignore[override]
        self, account: str, ref: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        self._find(account, ref)
        cmd = req.command if isinstance(req.command, str) else " ".join(req.command)
        for i in range(3):
            yield models.ExecEvent(type="stdout", data=f"{cmd} {i}\n")
        if cmd == "die":
            raise MachineFailed("the VM died", machine=ref)
        yield models.ExecEvent(type="exit", exit_code=0, duration=0.01)

    async def exec_interactive(  # type: ignore[override]
        self, account: str, ref: str, req: models.ExecRequest,
        inputs: AsyncIterator[pm.ExecInput], pty: tuple[int, int] | None = None,
    ) -> AsyncIterator[pm.ExecBytes | models.ExecEvent]:
        """A ``cat``: each input's bytes come back (a size as ``size R C``) until EOF."""
        self._find(account, ref)
        if pty is not None:
            yield pm.ExecBytes("stdout", f"size {pty[0]} {pty[1]}\n".encode())
        async for item in inputs:
            if item.size is not None:
                yield pm.ExecBytes("stdout", f"size {item.size[0]} {item.size[1]}\n".encode())
            if item.data:
                yield pm.ExecBytes("stdout", item.data)
            if item.eof:
                break
        yield models.ExecEvent(type="exit", exit_code=0, duration=0.01)

    async def upload(
        self, account: str, ref: str, path: str, data: bytes | AsyncIterable[bytes],
        mode: int = 0o644, user: str | None = None,
    ) -> models.FileInfo:
        m = self._find(account, ref)
        if not isinstance(data, bytes):
            data = b"".join([chunk async for chunk in data])
        self.files[(m.id, path)] = data
        import hashlib

        return models.FileInfo(
            path=path, size=len(data), mode=mode, sha256=hashlib.sha256(data).hexdigest()
        )

    async def download(self, account: str, ref: str, path: str) -> AsyncIterator[bytes]:
        m = self._find(account, ref)
        try:
            data = self.files[(m.id, path)]
        except KeyError:
            raise GuestFileNotFound(f"no file {path}", path=path) from None
        for i in range(0, len(data), 1 << 16):
            yield data[i : i + (1 << 16)]

    async def fork(  # type: ignore[valid-type]
        self, account: str, ref: str, names: list[str | None], node_hint: str | None = None,
        labels: Mapping[str, str] | None = None, idempotency_key: str | None = None,
        timeout: int | None = None, on_timeout: str = "delete", wait: float | None = None,
    ) -> list[models.Machine | Exception]:
        src = self._find(account, ref)
        if node_hint not in (None, "local"):  # one node, as nodes_list says
            raise NotFound(f"no node {node_hint!r}", field="node")
        out: list[models.Machine | Exception] = []
        for n in names:
            try:
                out.append(self._add(account, n, parent=src.id, snapshot=src.snapshot,
                                     labels={**src.labels, **(labels or {})}))
            except Exception as exc:
                out.append(exc)
        return out

    async def logs(self, account: str, ref: str, after: int | None,
                   wait: float) -> models.ServiceLog:
        m = self._find(account, ref)
        if m.image is None:
            raise NotFound(f"machine {m.name!r} has no service", machine=m.name)
        return models.ServiceLog(start=0, end=0, data="", state="running")

    async def metrics(self, account: str, ref: str, start: float | None = None,
                      end: float | None = None) -> models.MachineMetrics:
        """One sample per call while the machine runs, none while it sleeps."""
        m = self._find(account, ref)
        if start is not None and end is not None and start > end:
            raise InvalidRequest(f"start ({start}) is after end ({end})", field="start")
        samples = []
        if m.state == models.MachineState.RUNNING:
            samples.append(models.MetricSample(
                timestamp=time.time(), cpu_count=m.vcpus, cpu_used_pct=12.5,
                mem_total=m.memory_mib << 20, mem_used=64 << 20, mem_cache=8 << 20,
                disk_total=m.disk_gib << 30, disk_used=1 << 28))
        return models.MachineMetrics(machine=m.name, state=m.state, samples=samples)

    async def warm(self, account: str, ref: str, forks: int) -> models.Standby:
        m = self._find(account, ref)
        return models.Standby(machine_id=m.id, forks=forks, memory_bytes=forks << 20,
                              engine=m.engine or "qemu")  # (a fake machine may name none)

    async def checkpoint_save(self, account: str, ref: str, name: str) -> models.Checkpoint:
        m = self._find(account, ref)
        if (m.id, name) in self.checkpoints:
            raise AlreadyExists(f"checkpoint {name!r} exists", kind="checkpoint", name=name)
        c = models.Checkpoint(id=new_id("c"), name=name, machine_id=m.id, created_at=time.time())
        self.checkpoints[(m.id, name)] = c
        return c

    async def checkpoint_restore(self, account: str, ref: str, name: str) -> models.Machine:
        m = self._find(account, ref)
        if (m.id, name) not in self.checkpoints:
            raise CheckpointNotFound(f"no checkpoint {name!r}", machine=ref, checkpoint=name)
        return m

    async def checkpoint_list(  # type: ignore[valid-type]
        self, account: str, ref: str
    ) -> list[models.Checkpoint]:
        m = self._find(account, ref)
        return [c for (mid, _), c in self.checkpoints.items() if mid == m.id]

    async def checkpoint_delete(self, account: str, ref: str, name: str) -> None:
        m = self._find(account, ref)
        if self.checkpoints.pop((m.id, name), None) is None:
            raise CheckpointNotFound(f"no checkpoint {name!r}", machine=ref, checkpoint=name)

    async def recover(self) -> None:
        return None

    def _set_state(self, account: str, ref: str, state: models.MachineState) -> models.Machine:
        m = self._find(account, ref).model_copy(update={"state": state})
        self.machines[m.id] = (account, m)
        return m

    async def suspend(self, account: str, ref: str) -> models.Machine:
        return self._set_state(account, ref, models.MachineState.SUSPENDED)

    async def hibernate(self, account: str, ref: str) -> models.Machine:
        return self._set_state(account, ref, models.MachineState.HIBERNATED)

    async def resume(self, account: str, ref: str) -> models.Machine:
        return self._set_state(account, ref, models.MachineState.RUNNING)

    async def set_timeout(
        self, account: str, ref: str, timeout: int | None, on_timeout: str | None = None,
    ) -> models.Machine:
        m = self._find(account, ref)
        end = (None if timeout is None else
               datetime.fromtimestamp(time.time() + models.check_timeout(timeout), UTC))
        action = None if end is None else models.check_on_timeout(
            on_timeout or m.on_timeout or "delete")
        m = m.model_copy(update={"end_at": end, "on_timeout": action})
        self.machines[m.id] = (account, m)
        return m

    async def close(self) -> None:
        self.closed = True

    # --- processes: an echo process (every frame comes back, and goes to its stderr;
    # b"exit" ends it) ------------------------------------------------------------------

    async def spawn(self, account: str, ref: str, req: pm.SpawnRequest) -> pm.Process:
        m = self._find(account, ref)
        p = pm.Process(id=new_id("p"), machine=m.id, argv=req.argv, state="running",
                       started_at=time.time())
        self.procs[p.id] = (account, p, asyncio.Queue())
        self.stderr_logs[p.id] = OutputLog()
        return p

    async def processes(self, account: str, ref: str) -> list[pm.Process]:  # type: ignore[valid-type]
        m = self._find(account, ref)
        return [p for o, p, _ in self.procs.values() if o == account and p.machine == m.id]

    def _proc(self, account: str, ref: str, process_id: str) -> tuple[str, pm.Process, Any]:
        m = self._find(account, ref)
        entry = self.procs.get(process_id)
        if entry is None or entry[0] != account or entry[1].machine != m.id:
            raise NotFound(f"no process {process_id!r}")
        return entry

    async def process_kill(
        self, account: str, ref: str, process_id: str, signal: int
    ) -> pm.Process:
        o, p, q = self._proc(account, ref, process_id)
        p = p.model_copy(update={"state": "exited", "exit_code": 128 + signal,
                                 "signal": signal})
        self.procs[process_id] = (o, p, q)
        q.put_nowait(None)
        self.stderr_logs[process_id].wake()
        return p

    async def process_output(
        self, account: str, ref: str, process_id: str, after: int | None = None,
        wait: float = 0.0,
    ) -> pm.ProcessOutput:
        _, p, _ = self._proc(account, ref, process_id)
        log = self.stderr_logs[process_id]
        if wait > 0 and p.state != "exited" and (after or 0) >= log.end:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(log.more(), wait)
        p = self.procs[process_id][1]
        start, data = log.read(after)
        return pm.ProcessOutput(start=start, end=start + len(data), data=data, state=p.state,
                                exit_code=p.exit_code)

    @contextlib.asynccontextmanager
    async def process_attach(
        self, account: str, ref: str, process_id: str
    ) -> AsyncIterator[_EchoStream]:
        self._proc(account, ref, process_id)
        yield _EchoStream(self, process_id)


class _EchoStream:
    def __init__(self, fake: FakeMachines, process_id: str) -> None:
        self.fake = fake
        self.id = process_id

    @property
    def process(self) -> pm.Process:
        return self.fake.procs[self.id][1]

    async def send(self, data: bytes) -> None:
        o, p, q = self.fake.procs[self.id]
        if data == b"exit":
            self.fake.procs[self.id] = (o, p.model_copy(update={"state": "exited",
                                                                "exit_code": 0}), q)
            q.put_nowait(None)
            self.fake.stderr_logs[self.id].wake()
        else:
            q.put_nowait(data)
            self.fake.stderr_logs[self.id].add(data)

    async def recv(self) -> bytes | None:
        data: bytes | None = await self.fake.procs[self.id][2].get()
        return data


class FakeSnapshots(SnapshotService):
    def __init__(self, machines: FakeMachines, tmp: Path) -> None:
        self.m = machines
        self.tmp = tmp
        self.snaps: dict[str, tuple[str, models.Snapshot]] = {}
        self.imported: list[bytes] = []
        machines.snapshot_digest = lambda account, ref: self._find(account, ref).digest[7:]

    def _find(self, account: str, ref: str) -> models.Snapshot:
        for o, s in self.snaps.values():
            if o == account and ref in (s.name, f"{s.name}@{s.version}", s.digest):
                return s
        raise SnapshotNotFound(f"no snapshot {ref!r}", snapshot=ref)

    async def save(
        self, account: str, machine_ref: str, name: str, *, new_version: bool = False
    ) -> models.Snapshot:
        m = self.m._find(account, machine_ref)
        versions = [s.version for o, s in self.snaps.values() if o == account and s.name == name]
        if versions and not new_version:
            raise AlreadyExists(f"snapshot {name!r} exists", kind="snapshot", name=name)
        snap_id = new_id("s")
        s = models.Snapshot(
            id=snap_id, name=name, version=max(versions, default=0) + 1,
            digest="sha256:" + hashlib.sha256(snap_id.encode()).hexdigest(),
            source_machine=m.name, created_at=time.time(),
        )
        self.snaps[s.id] = (account, s)
        return s

    async def list(self, account: str) -> list[models.Snapshot]:  # type: ignore[valid-type]
        return [s for o, s in self.snaps.values() if o == account]

    async def get(self, account: str, ref: str) -> models.Snapshot:
        return self._find(account, ref)

    async def delete(self, account: str, ref: str) -> None:
        del self.snaps[self._find(account, ref).id]

    async def export(self, account: str, ref: str) -> Path:
        s = self._find(account, ref)
        path = self.tmp / f"export-{s.id}.boxd"
        path.write_bytes(b"SNAPSHOT:" + s.name.encode() * 10000)
        return path

    async def import_(
        self, account: str, path: Path, name: str | None = None
    ) -> models.Snapshot:
        data = path.read_bytes()
        if not data.startswith(b"SNAPSHOT:"):
            raise InvalidRequest("not a snapshot file", field="body")
        self.imported.append(data)
        s = models.Snapshot(
            id=new_id("s"), name=name or "imported", version=1, digest="sha256:" + "1" * 64,
            created_at=time.time(),
        )
        self.snaps[s.id] = (account, s)
        return s


def host_info() -> models.HostInfo:
    return models.HostInfo(
        version="0.1.0", engine="fake", qemu="", qemu_version="", accelerator="none",
        accelerator_reason="fake", cpu_model="", data_dir="/nonexistent",
    )


__all__ = ["FakeMachines", "FakeSnapshots", "KeyService", "host_info"]


class Env:
    """The API app over these fakes, a real key database and a keyed TestClient."""

    def __init__(self, tmp: Path) -> None:
        self.db = Database(tmp / "state.db")
        self.keys = KeyService(self.db)
        self.machines = FakeMachines()
        self.snapshots = FakeSnapshots(self.machines, tmp)
        self.app = create_app(
            machines=self.machines, snapshots=self.snapshots, keys=self.keys,
            host_info=host_info, upload_dir=tmp / "uploads",
        )
        self.local = self.keys.ensure_local_account()
        self.secret = self.keys.create(self.local, "test").secret
        self.client = TestClient(self.app, raise_server_exceptions=False)
        self.client.headers["Authorization"] = f"Bearer {self.secret}"
