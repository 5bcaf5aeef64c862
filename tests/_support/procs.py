"""The QEMU processes of a data directory, read from /proc (no `ps` column limits)."""

from __future__ import annotations

from pathlib import Path


def qemu_cmdlines(home: Path) -> list[list[str]]:
    """The argv of every running QEMU process whose command line mentions ``home``."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and argv[0].endswith(("qemu-system-x86_64", "qemu-system-x86")) and any(
            str(home) in a for a in argv
        ):
            out.append(argv)
    return out


def qemu_pid(vm_id: str) -> int:
    """The pid of the one live QEMU process of VM ``vm_id`` (by its ``-name``)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"boxd-{vm_id},".encode() in cmdline and state != "Z":
            found.append(int(proc.name))
    assert len(found) == 1, f"expected one QEMU process for {vm_id}, got {found}"
    return found[0]


def vm_id_of(home: Path, machine_id: str) -> str:
    """The engine's id of a machine's VM (a claimed standby child keeps its own)."""
    import sqlite3

    from boxd.config import Paths

    with sqlite3.connect(Paths(home.resolve()).db) as db:
        (vm_id,) = db.execute("SELECT vm_id FROM machines WHERE id=?", (machine_id,)).fetchone()
    return str(vm_id)
