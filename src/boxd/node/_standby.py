"""What standby fork children hold: host memory, read from ``/proc``.

A standby child (`boxd.node._spares.Spare`) is not a machine of the user's; `info` and
``machines.warm`` report how many there are and the memory they hold. Memory is the
proportional set size (PSS) of the child's process and its descendants (a gVisor
sandbox is a tree: runsc, its Sentry and gofer), so pages a QEMU child shares with its
template count by share, not once per child.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def _children(proc: Path) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (proc / entry.name / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _pss(proc: Path, pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_pss(pids: Iterable[int], proc: Path = PROC) -> int:
    """Bytes of PSS held by ``pids`` and all their descendants (gone ones count 0)."""
    roots = [p for p in pids if p > 0]
    if not roots:
        return 0
    kids = _children(proc)
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(kids.get(pid, ()))
    return sum(_pss(proc, pid) for pid in seen)


__all__ = ["tree_pss"]
