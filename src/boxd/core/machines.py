"""The machine runtime: records in SQLite, live QEMU machines, fork, checkpoints.

Lifecycle (checked in `_require`): ``starting`` → ``running`` (the agent answered) →
``deleting``; any state → ``failed`` when the VM process dies. A failed machine can
only be inspected or deleted.

Fork (VM templating): the source is paused once, its writable disk layer is frozen
(it gets a fresh overlay on top), its device state is written and its RAM file copied
sparsely into a *template*; the source resumes. Children map the template's RAM
privately (copy-on-write) and get their own overlay on the frozen layer. Forks asked
for while a template is being made share it; a later fork of an unchanged source
(same generation: no exec, upload or restore since) reuses it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import secrets
import socket
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from boxd import models
from boxd.api.services.machines import MachineService
from boxd.config import DEFAULT_MACHINE_QUOTA, Paths
from boxd.core._host import Host
from boxd.core._spares import SparePool
from boxd.engine.agent import ExecOutput
from boxd.engine.base import BootDisk, MachineConfig, MemoryImage
from boxd.engine.qemu import QemuMachine
from boxd.engine.qemu import attach as attach_machine
from boxd.errors import (
    AlreadyExists,
    BoxdError,
    CheckpointNotFound,
    ExecTimeout,
    InvalidRequest,
    MachineFailed,
    MachineNotFound,
    QuotaExceeded,
)
from boxd.models import NAME_RE, NAME_RULE, MachineState
from boxd.state import Database, new_id
from boxd.storage import disks
from boxd.storage.memory import remove_tree

if TYPE_CHECKING:
    from boxd.core.snapshots import Snapshots

log = logging.getLogger("boxd.core")

# Backing chains longer than this are collapsed in the background (see `_collapse`).
MAX_CHAIN = 8
# Seconds past an exec's own timeout before the host gives up on a silent guest.
HOST_GRACE = 30.0

S = MachineState


def validate_name(name: str, kind: str = "machine") -> str:
    """Check a DNS-label name.

    Raises:
        InvalidRequest: the name breaks the rule.
    """
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidRequest(
            f"invalid {kind} name {name!r}: use {NAME_RULE}", field="name",
            hint="e.g. rl-base or rollout-3",
        )
    return name


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class Template:
    id: str
    layer_id: str
    image: MemoryImage
    generation: int


class Machines(MachineService):
    """The engine-backed MachineService."""

    def __init__(self, paths: Paths, db: Database, host: Host) -> None:
        self.paths = paths
        self.db = db
        self.host = host
        self.live: dict[str, QemuMachine] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._preparing: dict[str, asyncio.Future[Template]] = {}
        self._attached = False
        self._background: set[asyncio.Task[None]] = set()
        self.snapshots: Snapshots | None = None
        self.spares = SparePool(self)

    # ---------------------------------------------------------------- records

    def _lock(self, machine_id: str) -> asyncio.Lock:
        return self._locks.setdefault(machine_id, asyncio.Lock())

    def _row(self, account: str, ref: str) -> sqlite3.Row:
        row = self.db.one(
            "SELECT * FROM machines WHERE account_id=? AND (id=? OR name=?)", (account, ref, ref)
        )
        if row is None or row["state"] == S.DELETING.value:
            raise MachineNotFound(
                f"no machine named {ref!r}", machine=ref,
                hint="`boxd machine list` shows your machines",
            )
        return row

    def _model(self, row: sqlite3.Row) -> models.Machine:
        port = row["port"]
        return models.Machine(
            id=row["id"], name=row["name"], state=MachineState(row["state"]),
            vcpus=row["vcpus"], memory_mib=row["memory_mib"], disk_gib=row["disk_gib"],
            isolated=bool(row["isolated"]), port=port,
            url=f"http://127.0.0.1:{port}" if port else None,
            parent_id=row["parent_id"], snapshot=row["snapshot"], accelerator=row["accel"],
            error=row["error"], created_at=row["created_at"],
        )

    def _config(self, row: sqlite3.Row) -> MachineConfig:
        """The engine's view of a machine. Before the host is ready (re-attaching after a
        restart) the boot files are unknown; they only matter to start a QEMU process,
        which always happens after `Host.ready`."""
        return self._config_for(
            row["id"], row["name"], vcpus=row["vcpus"], memory_mib=row["memory_mib"],
            isolated=bool(row["isolated"]), port=row["port"],
        )

    def _config_for(
        self, machine_id: str, hostname: str, *, vcpus: int, memory_mib: int, isolated: bool,
        port: int | None,
    ) -> MachineConfig:
        image = self.host.image
        return MachineConfig(
            id=machine_id, hostname=hostname, vcpus=vcpus, memory_mib=memory_mib,
            isolated=isolated, port=port,
            kernel=image.kernel if image else Path(), initrd=image.initrd if image else Path(),
            cmdline=image.cmdline_hint if image else "",
        )

    def _owner(self) -> tuple[int, int] | None:
        """(uid, gid) for files QEMU reopens after dropping privileges, if it does."""
        run_as = self.host.run_as()
        return (run_as.uid, run_as.gid) if run_as else None

    def _layer_path(self, layer_id: str) -> Path:
        return disks.layer_path(self.paths.disks, layer_id)

    def _set_state(self, machine_id: str, state: MachineState, error: str | None = None) -> None:
        self.db.execute(
            "UPDATE machines SET state=?, error=? WHERE id=?", (state.value, error, machine_id)
        )

    def _bump(self, machine_id: str) -> None:
        self.db.execute("UPDATE machines SET generation=generation+1 WHERE id=?", (machine_id,))
        self.spares.prune()  # a changed source's standby children are stale

    def _insert(
        self, account: str, name: str | None, *, vcpus: int, memory_mib: int, disk_gib: int,
        isolated: bool, parent_id: str | None = None, snapshot: str | None = None,
        extra_quota: int = 0, spare: tuple[str, int | None] | None = None,
    ) -> sqlite3.Row:
        """Claim a name and a machine id atomically (duplicate and quota checked).

        ``spare`` is the (machine id, port) a standby child was prepared with.
        """
        machine_id = spare[0] if spare else new_id("m")
        if name is None:
            name = f"machine-{secrets.token_hex(3)}"
        validate_name(name)
        image = self.host.image
        assert image is not None
        with self.db.transaction() as conn:
            quota_row = conn.execute(
                "SELECT machine_quota FROM accounts WHERE id=?", (account,)
            ).fetchone()
            quota = quota_row[0] if quota_row else DEFAULT_MACHINE_QUOTA
            used = conn.execute(
                "SELECT COUNT(*) FROM machines WHERE account_id=? AND state!='deleting'",
                (account,),
            ).fetchone()[0]
            if used + 1 + extra_quota > quota:
                raise QuotaExceeded(
                    f"machine quota reached: {used} of {quota} concurrent machines in use",
                    limit=quota, used=used,
                    hint="delete machines you no longer need, or ask for a higher limit",
                )
            if conn.execute(
                "SELECT 1 FROM machines WHERE account_id=? AND name=?", (account, name)
            ).fetchone():
                raise AlreadyExists(
                    f"a machine named {name!r} already exists", kind="machine", name=name,
                    hint="pick another name or delete the existing machine",
                )
            conn.execute(
                "INSERT INTO machines (id, account_id, name, state, vcpus, memory_mib, disk_gib,"
                " isolated, port, image, parent_id, snapshot, created_at, accel)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (machine_id, account, name, S.STARTING.value, vcpus, memory_mib, disk_gib,
                 int(isolated), spare[1] if spare else None if isolated else free_port(),
                 image.key, parent_id,
                 snapshot, time.time(), self.host.engine.accelerator if self.host.engine else None),
            )
        row = self.db.one("SELECT * FROM machines WHERE id=?", (machine_id,))
        assert row is not None
        return row

    def _new_layer(self, parent_id: str | None, base: str, layer_id: str | None = None) -> str:
        layer_id = layer_id or new_id("l")
        self.db.execute(
            "INSERT INTO layers (id, parent_id, base, frozen, created_at) VALUES (?,?,?,0,?)",
            (layer_id, parent_id, base, time.time()),
        )
        return layer_id

    def _run_dir(self, machine_id: str) -> Path:
        return self.paths.run_dir(machine_id)

    def _log_path(self, machine_id: str) -> Path:
        return self.paths.machines / machine_id / "qemu.log"

    # ------------------------------------------------------------- live handle

    @staticmethod
    def _failed(row: sqlite3.Row, reason: str) -> MachineFailed:
        return MachineFailed(
            f"machine {row['name']!r} failed: {reason}", machine=row["name"],
            hint=f"delete it (`boxd machine delete {row['name']}`) and create it again",
        )

    async def _live(self, row: sqlite3.Row) -> QemuMachine:
        """The running VM of a machine record, or a MachineFailed (and the record says so)."""
        if row["state"] == S.FAILED.value:
            raise self._failed(row, row["error"])
        handle = self.live.get(row["id"])
        if handle is None or not handle.alive():
            reason = handle.exit_reason() if handle else "its VM process is not running"
            self._set_state(row["id"], S.FAILED, reason)
            if handle is not None:
                await handle.detach()
            raise self._failed(row, reason)
        return handle

    async def _agent_call(self, row: sqlite3.Row, timeout: float = 120.0) -> Any:
        handle = await self._live(row)
        try:
            agent = await handle.agent(timeout=timeout)
        except MachineFailed as exc:
            if not handle.alive():
                self._set_state(row["id"], S.FAILED, handle.exit_reason())
                raise self._failed(row, handle.exit_reason()) from exc
            raise
        if row["state"] == S.STARTING.value:
            # First answer after a cold boot: give the machine its own machine-id, a
            # reseeded RNG and the host's wall clock (the RTC only has seconds).
            await agent.identity(
                hostname=row["name"], machine_id=secrets.token_hex(16), seed=os.urandom(64),
                now=time.time(),
            )
            self._set_state(row["id"], S.RUNNING)
        return agent

    # ------------------------------------------------------------------ create

    async def create(self, account: str, req: models.MachineCreate) -> models.Machine:
        if req.name is not None:
            validate_name(req.name)
        image, engine = await self.host.ready()
        if req.from_snapshot:
            from boxd.core.snapshots import start_from_snapshot

            return await start_from_snapshot(self, account, req)
        row = self._insert(
            account, req.name, vcpus=req.vcpus, memory_mib=req.memory_mib,
            disk_gib=req.disk_gib, isolated=req.isolated,
        )
        machine_id = row["id"]
        layer_id: str | None = None
        try:
            layer_id = self._new_layer(None, str(image.rootfs))
            await disks.create_overlay(
                self._layer_path(layer_id), image.rootfs, "raw", req.disk_gib,
                owner=self._owner(),
            )
            self.db.execute("UPDATE machines SET layer_id=? WHERE id=?", (layer_id, machine_id))
            handle = await engine.boot(
                self._config(row), BootDisk(self._layer_path(layer_id)),
                self._run_dir(machine_id), self._log_path(machine_id),
            )
        except BaseException:
            await self._purge(machine_id)
            raise
        self.live[machine_id] = handle
        self.db.execute("UPDATE machines SET pid=?, ram_shared=1 WHERE id=?",
                        (handle.pid, machine_id))
        log.info("machine=%s event=created name=%s pid=%s", machine_id, row["name"], handle.pid)
        return await self.get(account, machine_id)

    # ------------------------------------------------------------- inspection

    async def get(self, account: str, ref: str) -> models.Machine:
        row = self._row(account, ref)
        handle = self.live.get(row["id"])
        if row["state"] in (S.RUNNING.value, S.STARTING.value) and (
            handle is None or not handle.alive()
        ):
            reason = handle.exit_reason() if handle else "its VM process is not running"
            self._set_state(row["id"], S.FAILED, reason)
            row = self._row(account, ref)
        return self._model(row)

    async def list(self, account: str) -> list[models.Machine]:
        rows = self.db.all(
            "SELECT id FROM machines WHERE account_id=? AND state!='deleting' ORDER BY created_at",
            (account,),
        )
        out = []
        for r in rows:
            with contextlib.suppress(MachineNotFound):
                out.append(await self.get(account, r["id"]))
        return out

    async def wait_until_ready(self, account: str, ref: str, timeout: float) -> models.Machine:
        row = self._row(account, ref)
        await self._agent_call(row, timeout=timeout)
        return await self.get(account, row["id"])

    # -------------------------------------------------------------------- exec

    def _exec_kwargs(self, req: models.ExecRequest) -> dict[str, Any]:
        return {
            "env": req.env or None, "cwd": req.cwd, "timeout": req.timeout,
            "stdin": req.stdin.encode() if req.stdin is not None else None,
        }

    async def exec(self, account: str, ref: str, req: models.ExecRequest) -> models.ExecResult:
        row = self._row(account, ref)
        agent = await self._agent_call(row)
        self._bump(row["id"])
        # The guest enforces the timeout; the host deadline only catches a guest that
        # stopped answering altogether (a VM left paused, a hung kernel).
        deadline = req.timeout + HOST_GRACE if req.timeout else None
        try:
            out = await asyncio.wait_for(
                agent.run(req.command, **self._exec_kwargs(req)), timeout=deadline
            )
        except TimeoutError as exc:
            raise MachineFailed(
                f"machine {row['name']!r} stopped answering: the command's {req.timeout}s "
                f"timeout passed {HOST_GRACE:.0f}s ago with no word from the guest",
                machine=row["name"], hint="check `boxd machine info`; delete and recreate it",
            ) from exc
        except MachineFailed:
            await self._live(row)  # reports a dead VM as failed
            raise
        result = models.ExecResult(
            stdout=out.stdout.decode(errors="replace"), stderr=out.stderr.decode(errors="replace"),
            exit_code=out.exit_code, signal=out.signal, timed_out=out.timed_out,
            duration=out.duration,
        )
        if result.timed_out:
            raise ExecTimeout(
                f"command timed out after {req.timeout}s and was killed",
                timeout=req.timeout, stdout=result.stdout, stderr=result.stderr,
                hint="raise the timeout or make the command finish sooner",
            )
        return result

    async def exec_stream(
        self, account: str, ref: str, req: models.ExecRequest
    ) -> AsyncIterator[models.ExecEvent]:
        row = self._row(account, ref)
        agent = await self._agent_call(row)
        self._bump(row["id"])
        async for item in agent.exec(req.command, **self._exec_kwargs(req)):
            if isinstance(item, ExecOutput):
                yield models.ExecEvent(
                    type=item.stream, data=item.data.decode(errors="replace"), error=None
                )
            else:
                yield models.ExecEvent(
                    type="exit", exit_code=item.exit_code, signal=item.signal,
                    timed_out=item.timed_out, duration=item.duration, error=None,
                )

    # ------------------------------------------------------------------- files

    async def upload(
        self, account: str, ref: str, path: str, data: bytes, mode: int = 0o644
    ) -> models.FileInfo:
        if not path.startswith("/"):
            raise InvalidRequest(f"guest path must be absolute: {path!r}", field="path")
        row = self._row(account, ref)
        agent = await self._agent_call(row)
        self._bump(row["id"])
        st = await agent.write_file(path, data, mode)
        return models.FileInfo(path=path, size=st.size, mode=st.mode, sha256=st.sha256)

    async def download(self, account: str, ref: str, path: str) -> bytes:
        if not path.startswith("/"):
            raise InvalidRequest(f"guest path must be absolute: {path!r}", field="path")
        row = self._row(account, ref)
        agent = await self._agent_call(row)
        data: bytes = await agent.read_file(path)
        return data

    # ------------------------------------------------------------------ delete

    async def delete(self, account: str, ref: str) -> None:
        row = self._row(account, ref)
        async with self._lock(row["id"]):
            self._set_state(row["id"], S.DELETING)
            await self._purge(row["id"])
        log.info("machine=%s event=deleted", row["id"])

    async def _purge(self, machine_id: str) -> None:
        """Stop the VM and remove every file and record of a machine."""
        handle = self.live.pop(machine_id, None)
        if handle is not None:
            await handle.destroy()
        else:
            row = self.db.one("SELECT pid FROM machines WHERE id=?", (machine_id,))
            if row and row["pid"]:
                _kill_qemu(row["pid"], machine_id)
        for ck in self.db.all("SELECT id FROM checkpoints WHERE machine_id=?", (machine_id,)):
            remove_tree(self.paths.checkpoints / ck["id"])
        self.db.execute("DELETE FROM checkpoints WHERE machine_id=?", (machine_id,))
        self.db.execute("DELETE FROM machines WHERE id=?", (machine_id,))
        remove_tree(self._run_dir(machine_id))
        remove_tree(self.paths.machines / machine_id)
        self._locks.pop(machine_id, None)
        self.gc()

    def gc(self) -> None:
        """Remove templates and disk layers nothing refers to any more.

        A template lives while a child maps it, or while its source is alive and
        unchanged (so the next fork reuses it). A layer lives while a machine writes
        it, a template or checkpoint froze it, or a living layer is backed by it.
        """
        with self.db.transaction() as conn:
            dead_templates = conn.execute(
                "SELECT t.id, t.mem_path FROM templates t WHERE"
                " NOT EXISTS (SELECT 1 FROM machines m WHERE m.template_id=t.id)"
                " AND NOT EXISTS (SELECT 1 FROM machines s WHERE s.id=t.source_id"
                "   AND s.generation=t.generation AND s.state IN ('running','starting')"
                "   AND t.created_at=(SELECT MAX(created_at) FROM templates WHERE source_id=s.id))"
            ).fetchall()
            for t in dead_templates:
                conn.execute("DELETE FROM templates WHERE id=?", (t["id"],))
            live: set[str] = set()
            roots = conn.execute(
                "SELECT layer_id FROM machines WHERE layer_id IS NOT NULL"
                " UNION SELECT layer_id FROM templates UNION SELECT layer_id FROM checkpoints"
            ).fetchall()
            parents = dict(conn.execute("SELECT id, parent_id FROM layers").fetchall())
            for (lid,) in roots:
                while lid is not None and lid not in live:
                    live.add(lid)
                    lid = parents.get(lid)
            dead_layers = [lid for lid in parents if lid not in live]
            # children before parents so the foreign key holds at every step
            for lid in sorted(dead_layers, key=lambda x: -self._depth(x, parents)):
                conn.execute("DELETE FROM layers WHERE id=?", (lid,))
        for t in dead_templates:
            remove_tree(Path(t["mem_path"]).parent)
        for lid in dead_layers:
            disks.remove(self._layer_path(lid))
        self.spares.prune()

    @staticmethod
    def _depth(lid: str, parents: dict[str, str | None]) -> int:
        d = 0
        cur: str | None = lid
        while cur is not None and d < 10_000:
            cur = parents.get(cur)
            d += 1
        return d

    # -------------------------------------------------------------------- fork

    async def _freeze_and_capture(
        self, row: sqlite3.Row, handle: QemuMachine, dest: Path
    ) -> tuple[str, MemoryImage]:
        """Pause, freeze the disk, capture memory + device state into ``dest``, resume.

        Returns the frozen layer id and the memory image. The source is resumed
        whatever happens.
        """
        new_layer = self._new_layer(row["layer_id"], "")
        frozen_id = row["layer_id"]
        t0 = time.monotonic()
        await handle.pause()
        try:
            await handle.freeze_disk(self._layer_path(new_layer))
            with self.db.transaction() as conn:
                conn.execute("UPDATE layers SET frozen=1 WHERE id=?", (frozen_id,))
                conn.execute("UPDATE machines SET layer_id=? WHERE id=?", (new_layer, row["id"]))
            image = await handle.capture(dest)
        finally:
            if handle.alive():
                await handle.resume()
        log.info("machine=%s event=captured downtime=%.3f", row["id"], time.monotonic() - t0)
        if len(self._chain(new_layer)) > MAX_CHAIN:
            task = asyncio.create_task(self._collapse(row["id"]), name=f"collapse {row['id']}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return frozen_id, image

    def _chain(self, layer_id: str | None) -> builtins.list[sqlite3.Row]:
        """The layers from ``layer_id`` down to the one on the base image."""
        out: builtins.list[sqlite3.Row] = []
        while layer_id is not None and len(out) < 10_000:
            layer = self.db.one("SELECT * FROM layers WHERE id=?", (layer_id,))
            if layer is None:
                break
            out.append(layer)
            layer_id = layer["parent_id"]
        return out

    async def _collapse(self, machine_id: str) -> None:
        """Shorten a machine's backing chain to active layer → base (in the background).

        Each fork of a changed source and each checkpoint adds a frozen layer under the
        machine's active one; long chains slow every disk read. The layers stay as long
        as children, templates or checkpoints use them, and are collected after.
        """
        try:
            async with self._lock(machine_id):
                row = self.db.one("SELECT * FROM machines WHERE id=?", (machine_id,))
                handle = self.live.get(machine_id)
                if row is None or handle is None or not handle.alive():
                    return
                chain = self._chain(row["layer_id"])
                if len(chain) <= MAX_CHAIN:
                    return
                base = chain[-1]["base"]
                t0 = time.monotonic()
                await handle.collapse_disk(Path(base))
                self.db.execute(
                    "UPDATE layers SET parent_id=NULL, base=? WHERE id=?",
                    (base, row["layer_id"]),
                )
                self.gc()
                log.info(
                    "machine=%s event=collapsed layers=%d seconds=%.2f",
                    machine_id, len(chain), time.monotonic() - t0,
                )
        except BoxdError as exc:
            log.warning("machine=%s event=collapse_failed error=%s", machine_id, exc)

    async def _own_ram(self, row: sqlite3.Row) -> QemuMachine:
        """Give a machine that maps an image privately a RAM file of its own.

        Needed once before such a machine is forked: its whole RAM is streamed to a
        file and a new QEMU process (same id, name, port and disk) loads it.
        """
        handle = await self._live(row)
        if handle.ram_shared:
            return handle
        _, engine = await self.host.ready()
        tmp = self.paths.shm / "tmp" / new_id("p")
        try:
            await handle.pause()
            image = await handle.capture(tmp)
            await handle.destroy()
            new = await engine.start_from(
                self._config(row), BootDisk(handle.disk), image, self._run_dir(row["id"]),
                self._log_path(row["id"]), copy_memory=True,
            )
        except BaseException as exc:
            self.live.pop(row["id"], None)
            self._set_state(row["id"], S.FAILED, f"could not take over its memory: {exc}")
            raise
        finally:
            remove_tree(tmp)
        self.live[row["id"]] = new
        self.db.execute(
            "UPDATE machines SET pid=?, ram_shared=1, template_id=NULL WHERE id=?",
            (new.pid, row["id"]),
        )
        self.gc()
        return new

    async def _template(self, row: sqlite3.Row) -> Template:
        """The template children of this source start from: reused or made once."""
        source_id = row["id"]
        existing = self.db.one(
            "SELECT * FROM templates WHERE source_id=? AND generation=? "
            "ORDER BY created_at DESC LIMIT 1",
            (source_id, row["generation"]),
        )
        if existing is not None and Path(existing["mem_path"]).exists():
            return self._template_of(existing)
        pending = self._preparing.get(source_id)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Template] = asyncio.get_running_loop().create_future()
        self._preparing[source_id] = fut
        try:
            async with self._lock(source_id):
                fresh = self.db.one("SELECT * FROM machines WHERE id=?", (source_id,))
                assert fresh is not None
                handle = await self._own_ram(fresh)
                fresh = self.db.one("SELECT * FROM machines WHERE id=?", (source_id,))
                assert fresh is not None
                await self._flush_page_cache(handle)
                template_id = new_id("t")
                dest = self.paths.templates / template_id
                frozen_id, image = await self._freeze_and_capture(fresh, handle, dest)
                assert image.mem_path is not None
                self.db.execute(
                    "INSERT INTO templates (id, source_id, layer_id, mem_path, state_path,"
                    " generation, created_at) VALUES (?,?,?,?,?,?,?)",
                    (template_id, source_id, frozen_id, str(image.mem_path),
                     str(image.state_path), fresh["generation"], time.time()),
                )
                tpl = Template(template_id, frozen_id, image, fresh["generation"])
            fut.set_result(tpl)
            return tpl
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            self._preparing.pop(source_id, None)

    async def _flush_page_cache(self, handle: QemuMachine) -> None:
        """Write the source's dirty page cache to its disk before it is frozen.

        Otherwise every child inherits the same dirty pages and writes each of them
        into its own overlay (a source that just installed packages would cost every
        child megabytes). Only kernel state changes; best effort.
        """
        try:
            agent = await handle.agent(timeout=30)
            await agent.sync(timeout=60)
        except BoxdError as exc:
            log.warning("machine=%s event=sync_failed error=%s", handle.config.id, exc)

    def _template_of(self, t: sqlite3.Row) -> Template:
        row = self.db.one("SELECT memory_mib FROM machines WHERE id=?", (t["source_id"],))
        mib = row["memory_mib"] if row else 0
        return Template(
            t["id"], t["layer_id"],
            MemoryImage(Path(t["mem_path"]), Path(t["state_path"]), mib), t["generation"],
        )

    async def fork(
        self, account: str, ref: str, names: builtins.list[str | None]
    ) -> builtins.list[models.Machine | Exception]:
        src = self._row(account, ref)
        for n in names:
            if n is not None:
                validate_name(n)
        await self._live(src)
        tpl = await self._template(src)
        results = await asyncio.gather(
            *(self._start_child(account, src, tpl, n) for n in names), return_exceptions=True
        )
        self.spares.want(src["id"], tpl, len(names))
        out: builtins.list[models.Machine | Exception] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            out.append(r)
        return out

    async def _start_child(
        self, account: str, src: sqlite3.Row, tpl: Template, name: str | None
    ) -> models.Machine:
        _, engine = await self.host.ready()
        if name is None:
            name = f"{src['name'][:48]}-{secrets.token_hex(3)}"
        spare = self.spares.take(tpl.id)
        try:
            row = self._insert(
                account, name, vcpus=src["vcpus"], memory_mib=src["memory_mib"],
                disk_gib=src["disk_gib"], isolated=bool(src["isolated"]), parent_id=src["id"],
                snapshot=src["snapshot"],
                spare=(spare.machine_id, spare.port) if spare else None,
            )
        except BaseException:
            if spare is not None:
                self.spares.give_back(tpl.id, spare)
            raise
        t0 = time.monotonic()
        try:
            if spare is not None:
                # A standby child: overlay, QEMU and loaded state are ready; the guest has
                # not run yet. Record it and let it run.
                layer_id = self._new_layer(tpl.layer_id, "", layer_id=spare.layer_id)
                handle = spare.handle
            else:
                layer_id = self._new_layer(tpl.layer_id, "")
                await disks.create_overlay(
                    self._layer_path(layer_id), self._layer_path(tpl.layer_id), "qcow2",
                    src["disk_gib"], owner=self._owner(),
                )
            t1 = time.monotonic()
            self.db.execute(
                "UPDATE machines SET layer_id=?, template_id=?, ram_shared=0 WHERE id=?",
                (layer_id, tpl.id, row["id"]),
            )
            if spare is None:
                handle = await engine.start_from(
                    self._config(row), BootDisk(self._layer_path(layer_id)), tpl.image,
                    self._run_dir(row["id"]), self._log_path(row["id"]), copy_memory=False,
                )
            self.live[row["id"]] = handle
            self.db.execute("UPDATE machines SET pid=? WHERE id=?", (handle.pid, row["id"]))
            if spare is not None:
                await handle.resume()  # recorded first: a failed resume is purged with it
            t2 = time.monotonic()
            await self._set_identity(row["id"], name, handle)
            log.debug(
                "machine=%s event=child_timing spare=%s overlay=%.3f start=%.3f identity=%.3f",
                row["id"], spare is not None, t1 - t0, t2 - t1, time.monotonic() - t2,
            )
        except BaseException as exc:
            if spare is not None and row["id"] not in self.live:
                self.live[row["id"]] = spare.handle  # so that _purge kills it
            await self._purge(row["id"])
            if isinstance(exc, BoxdError):
                exc.message = f"fork child {name!r} failed: {exc.message}"
                exc.args = (exc.message,)
            raise
        self._set_state(row["id"], S.RUNNING)
        log.info("machine=%s event=forked source=%s spare=%s", row["id"], src["id"],
                 spare is not None)
        return await self.get(account, row["id"])

    async def _set_identity(self, machine_id: str, hostname: str, handle: QemuMachine) -> None:
        t0 = time.monotonic()
        agent = await handle.agent(timeout=60)
        log.debug("machine=%s event=agent_connected after=%.3f", machine_id, time.monotonic() - t0)
        await agent.identity(
            hostname=hostname, machine_id=secrets.token_hex(16), seed=os.urandom(64),
            now=time.time(),
        )

    # ------------------------------------------------------------- checkpoints

    def _checkpoint_row(self, machine: sqlite3.Row, name: str) -> sqlite3.Row:
        ck = self.db.one(
            "SELECT * FROM checkpoints WHERE machine_id=? AND name=?", (machine["id"], name)
        )
        if ck is None:
            raise CheckpointNotFound(
                f"machine {machine['name']!r} has no checkpoint named {name!r}",
                machine=machine["name"], checkpoint=name,
                hint=f"`boxd machine checkpoint list {machine['name']}` shows them",
            )
        return ck

    @staticmethod
    def _checkpoint_model(ck: sqlite3.Row) -> models.Checkpoint:
        return models.Checkpoint(
            id=ck["id"], name=ck["name"], machine_id=ck["machine_id"], created_at=ck["created_at"]
        )

    async def checkpoint_save(self, account: str, ref: str, name: str) -> models.Checkpoint:
        validate_name(name, "checkpoint")
        row = self._row(account, ref)
        async with self._lock(row["id"]):
            row = self._row(account, ref)
            if self.db.one(
                "SELECT 1 FROM checkpoints WHERE machine_id=? AND name=?", (row["id"], name)
            ):
                raise AlreadyExists(
                    f"machine {row['name']!r} already has a checkpoint named {name!r}",
                    kind="checkpoint", name=name, hint="delete it first or pick another name",
                )
            handle = await self._live(row)
            ck_id = new_id("c")
            dest = self.paths.checkpoints / ck_id
            try:
                frozen_id, image = await self._freeze_and_capture(row, handle, dest)
                self.db.execute(
                    "INSERT INTO checkpoints (id, machine_id, name, layer_id, mem_path,"
                    " state_path, created_at) VALUES (?,?,?,?,?,?,?)",
                    (ck_id, row["id"], name, frozen_id,
                     str(image.mem_path) if image.mem_path else "", str(image.state_path),
                     time.time()),
                )
            except BaseException:
                remove_tree(dest)
                raise
        ck = self._checkpoint_row(row, name)
        return self._checkpoint_model(ck)

    async def checkpoint_restore(self, account: str, ref: str, name: str) -> models.Machine:
        row = self._row(account, ref)
        async with self._lock(row["id"]):
            row = self._row(account, ref)
            ck = self._checkpoint_row(row, name)
            _, engine = await self.host.ready()
            image = MemoryImage(
                Path(ck["mem_path"]) if ck["mem_path"] else None, Path(ck["state_path"]),
                row["memory_mib"],
            )
            old = self.live.pop(row["id"], None)
            if old is not None:
                await old.destroy()
            layer_id = self._new_layer(ck["layer_id"], "")
            try:
                await disks.create_overlay(
                    self._layer_path(layer_id), self._layer_path(ck["layer_id"]), "qcow2",
                    row["disk_gib"], owner=self._owner(),
                )
                self.db.execute(
                    "UPDATE machines SET layer_id=?, template_id=NULL, ram_shared=1,"
                    " generation=generation+1 WHERE id=?", (layer_id, row["id"]),
                )
                handle = await engine.start_from(
                    self._config(row), BootDisk(self._layer_path(layer_id)), image,
                    self._run_dir(row["id"]), self._log_path(row["id"]), copy_memory=True,
                )
            except BaseException as exc:
                self._set_state(row["id"], S.FAILED, f"restore of {name!r} failed: {exc}")
                raise
            self.live[row["id"]] = handle
            self.db.execute(
                "UPDATE machines SET pid=?, state=?, error=NULL WHERE id=?",
                (handle.pid, S.RUNNING.value, row["id"]),
            )
            self.gc()
        log.info("machine=%s event=restored checkpoint=%s", row["id"], name)
        return await self.get(account, row["id"])

    async def checkpoint_list(self, account: str, ref: str) -> builtins.list[models.Checkpoint]:
        row = self._row(account, ref)
        return [
            self._checkpoint_model(ck)
            for ck in self.db.all(
                "SELECT * FROM checkpoints WHERE machine_id=? ORDER BY created_at", (row["id"],)
            )
        ]

    async def checkpoint_delete(self, account: str, ref: str, name: str) -> None:
        row = self._row(account, ref)
        async with self._lock(row["id"]):
            ck = self._checkpoint_row(row, name)
            self.db.execute("DELETE FROM checkpoints WHERE id=?", (ck["id"],))
            remove_tree(self.paths.checkpoints / ck["id"])
            self.gc()

    # --------------------------------------------------------------- lifecycle

    async def attach_all(self) -> None:
        """After a daemon (re)start: find the VMs of recorded machines again."""
        if self._attached:
            return
        self._attached = True
        rows = self.db.all("SELECT * FROM machines WHERE state IN ('starting','running')")
        stale = self.db.all("SELECT id FROM machines WHERE state='deleting'")
        for r in stale:
            await self._purge(r["id"])
        if not rows:
            self._sweep()
            return
        for row in rows:
            try:
                handle = attach_machine(
                    self._config(row), self._run_dir(row["id"]), row["pid"] or 0,
                    self._layer_path(row["layer_id"]), bool(row["ram_shared"]),
                    self._log_path(row["id"]), run_as=self.host.run_as(),
                )
                self.live[row["id"]] = handle
                # A daemon killed in the middle of a fork, checkpoint or snapshot left
                # the machine paused, maybe with its capture still streaming: cancel
                # that (it would stop the VM again when it completes), then resume.
                await handle.cancel_migration()
                status = (await handle.process.execute("query-status")).get("status")
                if status in ("paused", "postmigrate", "finish-migrate"):
                    log.info("machine=%s event=resumed_after_restart was=%s", row["id"], status)
                    await handle.resume()
            except MachineFailed as exc:
                self._set_state(row["id"], S.FAILED, exc.message)
        self._sweep()
        self.gc()

    def _sweep(self) -> None:
        """Remove run directories, templates and checkpoints no record knows."""
        known = {r["id"] for r in self.db.all("SELECT id FROM machines")}
        for d in (self.paths.shm / "machines").glob("*"):
            if d.name not in known:
                # A standby child of a daemon that died (spares are never recorded), or a
                # machine whose record is gone: its QEMU may still be running.
                _kill_stray(d)
                remove_tree(d)
        for d in self.paths.machines.glob("*"):
            if d.name not in known:
                remove_tree(d)
        tpls = {
            Path(r["mem_path"]).parent.name for r in self.db.all("SELECT mem_path FROM templates")
        }
        for d in self.paths.templates.glob("*"):
            if d.name not in tpls:
                remove_tree(d)
        cks = {r["id"] for r in self.db.all("SELECT id FROM checkpoints")}
        for d in self.paths.checkpoints.glob("*"):
            if d.name not in cks:
                remove_tree(d)
        remove_tree(self.paths.shm / "tmp")
        if self.snapshots is not None:
            # interrupted saves and imports leave staging files and unreferenced blobs
            report = self.snapshots.store.gc(in_use=self.snapshots.in_use)
            log.info("event=snapshot_store_gc report=%s", report)
        layers = {r["id"] for r in self.db.all("SELECT id FROM layers")}
        for f in self.paths.disks.glob("*.qcow2*"):
            if f.name.split(".")[0] not in layers:
                f.unlink(missing_ok=True)

    async def close(self) -> None:
        await self.spares.close()
        for task in list(self._background):
            task.cancel()
        for handle in list(self.live.values()):
            await handle.detach()
        self.live.clear()


def _kill_qemu(pid: int, machine_id: str) -> bool:
    """SIGKILL ``pid`` if it is still the QEMU process of ``machine_id`` (pids recycle)."""
    from boxd.engine.qemu._process import pid_matches

    if not pid_matches(pid, machine_id):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    return True


def _kill_stray(run_dir: Path) -> None:
    """SIGKILL the QEMU process of a run directory no machine owns, if it still runs."""
    try:
        pid = int((run_dir / "qemu.pid").read_text().strip())
    except (OSError, ValueError):
        return
    if _kill_qemu(pid, run_dir.name):
        log.info("machine=%s event=stray_qemu_killed pid=%s", run_dir.name, pid)


__all__ = ["Machines", "free_port", "validate_name"]
