"""Checkpoints (named, per machine, on this node) and snapshots (into the store).

Both are taken as a template is (`Templates.freeze_and_capture`: pause, freeze the disk
layer, capture memory and device state, resume). A checkpoint restore replaces the
machine's VM process with one started from the checkpoint (`Launcher.start`); a
snapshot is copied and hashed into the snapshot store while the machine runs again.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Protocol

from boxd.config import Paths
from boxd.engine.base import MachineHandle, MemoryImage
from boxd.errors import AlreadyExists, CheckpointNotFound
from boxd.models import MachineState
from boxd.node._host import Host
from boxd.node._launch import Launch, Launcher, failed_error
from boxd.node._templates import Templates
from boxd.node.lifecycle import ASLEEP, Lease, Lifecycle
from boxd.state import CheckpointRecord, MachineRecord, Repos, new_id
from boxd.storage import Manifest, SnapshotStore
from boxd.storage.memory import remove_tree

log = logging.getLogger("boxd.node")

S = MachineState


class Machines(Protocol):
    """What checkpoints need of the node: a machine, awake and with RAM of its own."""

    def record(self, machine_id: str) -> MachineRecord: ...

    def lease(self, machine_id: str) -> Lease: ...

    def touch(self, machine_id: str) -> None: ...

    def gc(self) -> None: ...

    async def awake(self, rec: MachineRecord) -> MachineRecord: ...

    async def own_ram(self, rec: MachineRecord) -> MachineHandle: ...


class Checkpoints:
    """Checkpoint save, restore, list and delete; snapshot saves."""

    def __init__(
        self, paths: Paths, repos: Repos, host: Host, store: SnapshotStore,
        lifecycle: Lifecycle, *, machines: Machines, launcher: Launcher, templates: Templates,
    ) -> None:
        self.paths = paths
        self.repos = repos
        self.host = host
        self.store = store
        self.lifecycle = lifecycle
        self._machines = machines
        self._launcher = launcher
        self._templates = templates

    def _checkpoint(self, rec: MachineRecord, name: str) -> CheckpointRecord:
        ck = self.repos.checkpoints.get(rec.id, name)
        if ck is None:
            raise CheckpointNotFound(
                f"machine {rec.name!r} has no checkpoint named {name!r}",
                machine=rec.name, checkpoint=name,
                hint=f"`boxd machine checkpoint list {rec.name}` shows them",
            )
        return ck

    async def save(self, machine_id: str, name: str) -> CheckpointRecord:
        m = self._machines
        async with m.lease(machine_id).op():
            rec = m.record(machine_id)
            if self.repos.checkpoints.get(rec.id, name) is not None:
                raise AlreadyExists(
                    f"machine {rec.name!r} already has a checkpoint named {name!r}",
                    kind="checkpoint", name=name, hint="delete it first or pick another name",
                )
            rec = await m.awake(rec)
            m.touch(rec.id)
            handle = self._launcher.live.get(rec.id)
            if handle is None:
                raise failed_error(rec, "its VM process is not running")
            ck_id = new_id("c")
            dest = self.paths.checkpoints / ck_id
            try:
                frozen_id, image = await self._templates.freeze_and_capture(rec, handle, dest)
                return self.repos.checkpoints.add(
                    ck_id, rec.id, name, frozen_id, image.mem_path, image.state_path
                )
            except BaseException:
                remove_tree(dest)
                raise

    async def restore(self, machine_id: str, name: str) -> None:
        m = self._machines
        lease = m.lease(machine_id)
        async with lease.op():
            rec = m.record(machine_id)
            ck = self._checkpoint(rec, name)
            await self.host.ready(rec.engine)
            if rec.state in ASLEEP:
                rec = await m.awake(rec)  # takes its quota slot again if hibernated
            m.touch(rec.id)
            async with lease.replace():
                rec = self.lifecycle.begin(rec, S.RESTORING, S.RUNNING, S.FAILED)
                old = self._launcher.retire(rec.id)
                if old is not None:
                    await old.destroy()
                self.repos.machines.bump_generation(rec.id)
                image = MemoryImage(ck.mem_path, ck.state_path, rec.memory_mib)
                await self._launcher.start(
                    rec, Launch(image, backing=self._launcher.layer_path(ck.layer_id),
                                parent_layer=ck.layer_id, copy_memory=True,
                                disk_gib=rec.disk_gib),
                    identity=False,
                )
                self.repos.machines.update(rec.id, error=None)
            m.gc()
        log.info("machine=%s event=restored checkpoint=%s", machine_id, name)

    async def saved(self, machine_id: str) -> list[CheckpointRecord]:
        return self.repos.checkpoints.list(self._machines.record(machine_id).id)

    async def delete(self, machine_id: str, name: str) -> None:
        async with self._machines.lease(machine_id).op():
            rec = self._machines.record(machine_id)
            ck = self._checkpoint(rec, name)
            self.repos.checkpoints.delete(ck.id)
            remove_tree(self.paths.checkpoints / ck.id)
            self._machines.gc()

    async def save_snapshot(self, machine_id: str, meta: dict[str, object]) -> str:
        """Capture a machine into the snapshot store; return the manifest's digest.

        The capture goes to tmpfs (fast: the machine is paused meanwhile); the store
        then copies and hashes it into its own filesystem while the machine runs again.
        """
        m = self._machines
        _, engine = await self.host.ready(m.record(machine_id).engine)
        # In the store's staging area: an interrupted save is collected at next start.
        work = Path(tempfile.mkdtemp(prefix="save-", dir=self.store.staging_dir))
        capture = self.paths.shm / "tmp" / new_id("save")
        try:
            async with m.lease(machine_id).op():
                rec = await m.awake(m.record(machine_id))
                m.touch(rec.id)
                handle = await m.own_ram(rec)
                rec = m.record(machine_id)
                frozen_id, image = await self._templates.freeze_and_capture(
                    rec, handle, capture)
            # The machine runs again; the frozen layer and captured files are immutable.
            disk = work / "disk.qcow2"
            await engine.flatten_disk(self._launcher.layer_path(frozen_id), disk)
            memory = image.mem_path
            assert memory is not None
            full = {**meta, "engine": engine.name, "accelerator": engine.accelerator,
                    "cpu_model": engine.cpu_model, "image": rec.image}
            if rec.run_image is not None:  # the container image it runs (and its digest)
                full["run_image"] = rec.run_image.to_json()

            def stage() -> Manifest:
                with self.store.stage() as st:
                    st.add_blob("memory", memory, move=True)
                    st.add_blob("state", image.state_path, move=True)
                    st.add_blob("disk", disk, move=True)
                    return st.commit(full)

            manifest = await asyncio.to_thread(stage)
        finally:
            remove_tree(work)
            remove_tree(capture)
            m.gc()
        return manifest.digest


__all__ = ["Checkpoints"]
