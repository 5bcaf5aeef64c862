"""No machine outside a ``vm`` test: ``pytest -m "not vm"`` must start no QEMU or runsc.

Three checks, so that a test that drives a machine without the ``vm`` mark fails
loudly rather than slowing the fast tier down unnoticed:

1. an audit hook (`sys.addaudithook`: it cannot be removed) sees every process this
   interpreter starts (``subprocess.Popen``, ``asyncio`` subprocesses, ``os.exec*``,
   ``os.posix_spawn``); one whose executable is the host's real ``qemu-system-*`` or
   ``runsc`` is refused (the launch raises) while a non-vm test runs;
2. the refusal is recorded, and the test fails even if it caught the error;
3. after each non-vm test, a real engine process descending from this run (a
   ``boxd serve`` subprocess's machine, say) fails the test too.

Stand-ins (a script named ``runsc``, a Python process whose argv[0] reads
``runsc-sandbox``) are not the real binaries and stay allowed, and so is a question to
the real ones (``--version``, ``--help``). The harness's own way
to start a real daemon (`tests._support.daemon.start_daemon`) asks `require_vm` first.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_ENGINE_NAMES = ("runsc",)
_ENGINE_PREFIXES = ("qemu-system-",)


class _State:
    allowed = True  # until pytest says which test runs (collection starts no machine)
    test = ""
    refused: list[str] = []
    older: set[int] = set()  # the processes alive when the current test began


STATE = _State()


def real_engines() -> set[str]:
    """The real paths of the host's QEMU system emulators and runsc (PATH, BOXD_RUNSC)."""
    found: set[str] = set()
    dirs = os.environ.get("PATH", os.defpath).split(os.pathsep)
    for d in dirs:
        try:
            names = os.listdir(d or ".")
        except OSError:
            continue
        for n in names:
            if n in _ENGINE_NAMES or n.startswith(_ENGINE_PREFIXES):
                found.add(os.path.realpath(os.path.join(d, n)))
    if runsc := os.environ.get("BOXD_RUNSC", "").strip():  # the engine's own setting
        found.add(os.path.realpath(runsc))
    return found


_ENGINES: set[str] = set()


def _resolve(executable: Any, argv: Any) -> str | None:
    if isinstance(executable, bytes | os.PathLike):
        executable = os.fsdecode(executable)
    if not executable:
        if isinstance(argv, str | bytes | os.PathLike):
            argv = [argv]
        if not argv:
            return None
        executable = os.fsdecode(next(iter(argv)))
    if not isinstance(executable, str):
        return None
    if os.sep not in executable:
        executable = shutil.which(executable) or executable
    return os.path.realpath(executable)


_QUESTIONS = {"--version", "-version", "version", "--help", "-help", "help", "-h"}


def _asks_only(argv: Any) -> bool:
    """``qemu-system-x86_64 --version``, ``runsc --version``: a question, no machine."""
    if isinstance(argv, str | bytes | os.PathLike) or not argv:
        return False
    return any(os.fsdecode(a) in _QUESTIONS for a in list(argv)[1:])


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if STATE.allowed or event not in ("subprocess.Popen", "os.exec", "os.posix_spawn"):
        return
    exe = _resolve(args[0], args[1])
    if exe is not None and exe in _ENGINES and not _asks_only(args[1]):
        what = f"{STATE.test} launched {exe} but is not marked vm"
        STATE.refused.append(what)
        raise RuntimeError(f"{what}: mark it @pytest.mark.vm (or its module: "
                           "pytestmark = pytest.mark.vm); `pytest -m 'not vm'` starts no machine")


def install() -> None:
    """Add the audit hook (once per interpreter)."""
    if not _ENGINES:
        _ENGINES.update(real_engines())
        sys.addaudithook(_hook)


def require_vm(what: str) -> None:
    """Refuse ``what`` (a real daemon start, say) outside a vm test."""
    if not STATE.allowed:
        STATE.refused.append(f"{STATE.test} {what} but is not marked vm")
        raise RuntimeError(f"{STATE.test} {what} but is not marked vm: mark it "
                           "@pytest.mark.vm")


def live_pids() -> set[int]:
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}


def engine_descendants(root: int, older: Iterable[int] = ()) -> dict[int, str]:
    """Live processes under ``root`` whose executable is a real engine: pid -> argv.

    One with a process of ``older`` between it and ``root`` (a session daemon that an
    earlier vm test started, refilling its standby copies) is not counted."""
    parent: dict[int, int] = {}
    exes: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        pid = int(proc.name)
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            parent[pid] = int(stat[1])
            if stat[0] not in "ZX":
                exes[pid] = os.path.realpath(proc / "exe")
        except (OSError, IndexError, ValueError):
            continue
    skip = set(older)
    found: dict[int, str] = {}
    for pid, exe in exes.items():
        if exe not in _ENGINES or pid in skip:
            continue
        p, hops, old = parent.get(pid, 0), 0, False
        while p > 1 and p != root and hops < 64:
            old = old or p in skip
            p, hops = parent.get(p, 0), hops + 1
        if p == root and not old:
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(
                    b"\0", b" ").decode(errors="replace")[:200]
            except OSError:
                found[pid] = exe
    return found
