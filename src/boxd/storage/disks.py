"""Disk layers: qcow2 files in ``disks/``, chained by backing files.

A machine writes to its *active* layer. Forking or checkpointing freezes the active
layer (it becomes a read-only backing file) and gives the machine a new active layer
on top; children get their own active layers on the same frozen one. Layers are
reference-counted in the state database and removed when nothing refers to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
from pathlib import Path

from boxd.errors import HostSetupError, InternalError, ResourceExhausted
from boxd.storage._files import fsync_path

QEMU_IMG = "qemu-img"
log = logging.getLogger("boxd.storage")


async def _run(*argv: str) -> str:
    try:
        # umask 077: disk layers hold guest data; they are born 0600. In a thread with
        # the stdlib's subprocess: the event loop's own (uvloop's) has no umask.
        proc = await asyncio.to_thread(
            subprocess.run, argv, stdin=subprocess.DEVNULL, capture_output=True, umask=0o077,
            check=False,
        )
    except FileNotFoundError as exc:
        raise HostSetupError(
            f"{argv[0]} not found", hint="run scripts/setup-host.sh to install qemu-utils"
        ) from exc
    out, err = proc.stdout, proc.stderr
    if proc.returncode != 0:
        text = err.decode(errors="replace").strip()
        # qemu-img names the layer files: its words go to the log, not to the client.
        log.warning("event=qemu_img_failed argv=%r error=%r", argv, text[-2000:])
        if "No space left" in text:
            raise ResourceExhausted(
                f"disk full while running {argv[0]}", hint="free space in the data directory"
            )
        raise InternalError(
            f"{argv[0]} {argv[1]} failed (status {proc.returncode})",
            hint="the daemon's log has its error message",
        )
    return out.decode()


def layer_path(disks_dir: Path, layer_id: str) -> Path:
    return disks_dir / f"{layer_id}.qcow2"


async def create_overlay(
    path: Path, backing: Path, backing_format: str, size_gib: int,
    owner: tuple[int, int] | None = None,
) -> None:
    """Create a qcow2 overlay of ``size_gib`` on ``backing`` (written to a temp name first).

    ``owner`` (uid, gid) hands the file to the user QEMU runs as, which reopens it
    read-write after dropping privileges.
    """
    tmp = path.with_name(path.name + ".tmp")
    # 16 KiB clusters: a fork child's first writes (hostname, machine-id, journal) copy
    # 16 KiB per touched cluster instead of 64 KiB, so an idle child's layer stays small.
    await _run(
        QEMU_IMG, "create", "-q", "-f", "qcow2",
        "-o", "cluster_size=16384,lazy_refcounts=on",
        "-b", str(backing), "-F", backing_format,
        str(tmp), f"{size_gib}G",
    )
    if owner is not None:
        os.chown(tmp, *owner)
    os.replace(tmp, path)


async def flatten(src: Path, dest: Path) -> None:
    """Write the whole backing chain of ``src`` into one standalone qcow2 file ``dest``."""
    tmp = dest.with_name(dest.name + ".tmp")
    await _run(QEMU_IMG, "convert", "-q", "-O", "qcow2", str(src), str(tmp))
    fsync_path(tmp)
    os.replace(tmp, dest)


async def retarget(path: Path, backing: Path, backing_format: str) -> None:
    """Point a layer received from another node at this node's copy of its backing file
    (same content, another path): ``qemu-img rebase -u`` rewrites the header only."""
    await _run(QEMU_IMG, "rebase", "-q", "-u", "-b", str(backing), "-F", backing_format,
               "-f", "qcow2", str(path))


def remove(path: Path) -> None:
    for p in (path, path.with_name(path.name + ".tmp")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
