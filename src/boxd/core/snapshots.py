"""Snapshots: a machine's memory, device state and flattened disk, stored by digest.

Names and versions live in SQLite (per account); the bytes live in the content-addressed
`SnapshotStore`. ``NAME`` means the latest version, ``NAME@N`` one version and
``sha256:HEX`` one digest. Saving to an existing name needs ``new_version``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from boxd import models
from boxd.api.services.snapshots import SnapshotService
from boxd.engine.base import BootDisk, MemoryImage
from boxd.errors import AlreadyExists, InvalidRequest, SnapshotNotFound
from boxd.state import new_id
from boxd.storage import Manifest, SnapshotStore, disks
from boxd.storage.memory import remove_tree

if TYPE_CHECKING:
    from boxd.core.machines import Machines

log = logging.getLogger("boxd.core")


class Snapshots(SnapshotService):
    """The engine-backed SnapshotService."""

    def __init__(self, machines: Machines, store: SnapshotStore) -> None:
        self.machines = machines
        self.store = store
        self.db = machines.db

    def in_use(self) -> set[str]:
        """Blob digests that machines started from snapshots still map or back onto."""
        used: set[str] = set()
        for r in self.db.all("SELECT DISTINCT snapshot FROM machines WHERE snapshot IS NOT NULL"):
            if self.store.exists(r["snapshot"]):
                used |= {b.digest for b in self.store.get(r["snapshot"]).blobs.values()}
        return used

    def _resolve(self, account: str, ref: str) -> sqlite3.Row:
        """Find a snapshot row by NAME, NAME@N or sha256:HEX.

        Raises:
            SnapshotNotFound: nothing matches.
        """
        row: sqlite3.Row | None
        if ref.startswith("sha256:"):
            row = self.db.one(
                "SELECT * FROM snapshots WHERE account_id=? AND digest=? "
                "ORDER BY version DESC LIMIT 1", (account, ref[7:]),
            )
        elif "@" in ref:
            name, _, ver = ref.partition("@")
            row = None
            if ver.isdigit():
                row = self.db.one(
                    "SELECT * FROM snapshots WHERE account_id=? AND name=? AND version=?",
                    (account, name, int(ver)),
                )
        else:
            row = self.db.one(
                "SELECT * FROM snapshots WHERE account_id=? AND (name=? OR id=?) "
                "ORDER BY version DESC LIMIT 1", (account, ref, ref),
            )
        if row is None:
            raise SnapshotNotFound(
                f"no snapshot {ref!r}", snapshot=ref,
                hint="`boxd snapshots list` shows your snapshots",
            )
        return row

    def _model(self, row: sqlite3.Row) -> models.Snapshot:
        m = self.store.get(row["digest"])
        meta = m.meta
        return models.Snapshot(
            id=row["id"], name=row["name"], version=row["version"],
            digest="sha256:" + row["digest"], created_at=row["created_at"],
            source_machine=meta.get("source_machine"),
            memory_bytes=m.blobs["memory"].size if "memory" in m.blobs else 0,
            disk_bytes=m.blobs["disk"].size if "disk" in m.blobs else 0,
            stored_bytes=m.stored_bytes(), engine=meta.get("engine"),
            cpu_model=meta.get("cpu_model"), image=meta.get("image"),
        )

    def _next_version(self, account: str, name: str, new_version: bool) -> int:
        row = self.db.one(
            "SELECT MAX(version) AS v FROM snapshots WHERE account_id=? AND name=?",
            (account, name),
        )
        latest = row["v"] if row and row["v"] is not None else 0
        if latest and not new_version:
            raise AlreadyExists(
                f"snapshot {name!r} exists (version {latest}); a name keeps meaning the same bytes",
                kind="snapshot", name=name,
                hint="save with --new-version to add version "
                f"{latest + 1}, or pick another name",
            )
        return int(latest) + 1

    async def save(
        self, account: str, machine_ref: str, name: str, *, new_version: bool = False
    ) -> models.Snapshot:
        from boxd.core.machines import validate_name

        validate_name(name, "snapshot")
        mach = self.machines
        row = mach._row(account, machine_ref)
        self._next_version(account, name, new_version)  # fail early on a taken name
        _, engine = await mach.host.ready()
        # In the store's staging area: an interrupted save is collected at next start.
        work = Path(tempfile.mkdtemp(prefix="save-", dir=self.store.staging_dir))
        # Capture to tmpfs (fast: the machine is paused meanwhile); the store then
        # copies and hashes into its own filesystem while the machine runs again.
        capture = mach.paths.shm / "tmp" / new_id("save")
        try:
            async with mach._lock(row["id"]):
                row = mach._row(account, machine_ref)
                handle = await mach._own_ram(row)
                row = mach._row(account, machine_ref)
                frozen_id, image = await mach._freeze_and_capture(row, handle, capture)
            # The machine runs again; the frozen layer and captured files are immutable.
            disk = work / "disk.qcow2"
            await disks.flatten(mach._layer_path(frozen_id), disk)
            assert image.mem_path is not None
            meta = {
                "name": name, "source_machine": row["name"], "source_machine_id": row["id"],
                "created_at": time.time(), "engine": engine.name, "accelerator": engine.accelerator,
                "cpu_model": engine.cpu_model, "image": row["image"],
                "memory_mib": row["memory_mib"], "vcpus": row["vcpus"],
                "disk_gib": row["disk_gib"], "isolated": bool(row["isolated"]),
            }

            def stage() -> Manifest:
                with self.store.stage() as st:
                    st.add_blob("memory", image.mem_path, move=True)  # type: ignore[arg-type]
                    st.add_blob("state", image.state_path, move=True)
                    st.add_blob("disk", disk, move=True)
                    return st.commit(meta)

            manifest = await asyncio.to_thread(stage)
        finally:
            remove_tree(work)
            remove_tree(capture)
            mach.gc()
        with self.db.transaction() as conn:
            row_v = conn.execute(
                "SELECT MAX(version) FROM snapshots WHERE account_id=? AND name=?",
                (account, name),
            ).fetchone()[0]
            if row_v and not new_version:
                raise AlreadyExists(
                    f"snapshot {name!r} was saved meanwhile", kind="snapshot", name=name,
                    hint="save with --new-version",
                )
            snap_id = new_id("s")
            conn.execute(
                "INSERT INTO snapshots (id, account_id, name, version, digest, created_at)"
                " VALUES (?,?,?,?,?,?)",
                (snap_id, account, name, (row_v or 0) + 1, manifest.digest, time.time()),
            )
        log.info("snapshot=%s event=saved name=%s digest=%s", snap_id, name, manifest.digest[:12])
        return await self.get(account, snap_id)

    async def list(self, account: str) -> list[models.Snapshot]:
        rows = self.db.all(
            "SELECT * FROM snapshots WHERE account_id=? ORDER BY name, version", (account,)
        )
        return [self._model(r) for r in rows if self.store.exists(r["digest"])]

    async def get(self, account: str, ref: str) -> models.Snapshot:
        return self._model(self._resolve(account, ref))

    async def delete(self, account: str, ref: str) -> None:
        row = self._resolve(account, ref)
        self.db.execute("DELETE FROM snapshots WHERE id=?", (row["id"],))
        others = self.db.one("SELECT 1 FROM snapshots WHERE digest=?", (row["digest"],))
        if others is None:
            await asyncio.to_thread(self.store.delete, row["digest"], in_use=self.in_use)

    async def export(self, account: str, ref: str) -> Path:
        row = self._resolve(account, ref)
        out = self.store.root / "staging" / f"export-{secrets.token_hex(6)}.boxd"
        out.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.store.export, row["digest"], out)
        return out

    async def import_(self, account: str, path: Path, name: str | None = None) -> models.Snapshot:
        manifest = await asyncio.to_thread(self.store.import_, path)
        name = name or str(manifest.meta.get("name") or "")
        if not name:
            raise InvalidRequest("the imported snapshot has no name; pass one", field="name")
        existing = self.db.one(
            "SELECT * FROM snapshots WHERE account_id=? AND digest=? AND name=?",
            (account, manifest.digest, name),
        )
        if existing is not None:
            return self._model(existing)
        version = self._next_version(account, name, True)
        snap_id = new_id("s")
        self.db.execute(
            "INSERT INTO snapshots (id, account_id, name, version, digest, created_at)"
            " VALUES (?,?,?,?,?,?)",
            (snap_id, account, name, version, manifest.digest, time.time()),
        )
        return await self.get(account, snap_id)


async def start_from_snapshot(
    machines: Machines, account: str, req: models.MachineCreate
) -> models.Machine:
    """Create a machine that continues from a snapshot (memory mapped copy-on-write)."""
    snaps = machines.snapshots
    assert snaps is not None and req.from_snapshot is not None
    srow = snaps._resolve(account, req.from_snapshot)
    manifest = snaps.store.get(srow["digest"])
    await asyncio.to_thread(snaps.store.ensure_verified, manifest.digest)
    meta = manifest.meta
    _, engine = await machines.host.ready()
    row = machines._insert(
        account, req.name, vcpus=int(meta.get("vcpus", req.vcpus)),
        memory_mib=int(meta.get("memory_mib", req.memory_mib)),
        disk_gib=max(req.disk_gib, int(meta.get("disk_gib", req.disk_gib))),
        isolated=req.isolated or bool(meta.get("isolated", False)), snapshot=manifest.digest,
    )
    try:
        layer_id = machines._new_layer(None, str(manifest.blob_path("disk")))
        await disks.create_overlay(
            machines._layer_path(layer_id), manifest.blob_path("disk"), "qcow2", row["disk_gib"],
            owner=machines._owner(),
        )
        machines.db.execute(
            "UPDATE machines SET layer_id=?, ram_shared=0 WHERE id=?", (layer_id, row["id"])
        )
        image = MemoryImage(manifest.blob_path("memory"), manifest.blob_path("state"),
                            row["memory_mib"])
        handle = await engine.start_from(
            machines._config(row), BootDisk(machines._layer_path(layer_id)), image,
            machines._run_dir(row["id"]), machines._log_path(row["id"]), copy_memory=False,
        )
        machines.live[row["id"]] = handle
        machines.db.execute("UPDATE machines SET pid=? WHERE id=?", (handle.pid, row["id"]))
        await machines._set_identity(row["id"], row["name"], handle)
    except BaseException:
        await machines._purge(row["id"])
        raise
    machines._set_state(row["id"], models.MachineState.RUNNING)
    return await machines.get(account, row["id"])

