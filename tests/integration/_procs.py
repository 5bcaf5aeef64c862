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
