"""A cgroup per VM process: bounded memory, an equal CPU share, a pids limit.

Every QEMU process a daemon starts is placed, before it runs QEMU's first instruction
(in the forked child, between fork and exec), in a cgroup of its own under one parent
per data directory (a gVisor sandbox likewise: ``runsc run``/``restore`` joins it
before exec, so the sandbox, its gofer and systrap's stub processes start in it; see
`sandbox_memory_limit`)::

    <the daemon's own cgroup>/boxd-<hash of the data dir>/<vm id>

On cgroup v1 (this host: hybrid, the controllers bound to v1 hierarchies) that path
exists once per controller (``memory``, ``cpu``, ``pids``); on v2 once, with the
controllers enabled for the subtree. Limits of one machine's cgroup:

- memory: guest RAM plus `QEMU_OVERHEAD_MIB` (twice the RAM for a process that maps
  an image privately: its copy-on-write pages and a full-RAM capture written to tmpfs
  are both charged to it while it takes over RAM of its own). Guest RAM is a tmpfs
  file, and tmpfs pages are charged to the cgroup of the process that first touches
  them, so a guest that touches all its RAM stays under the limit by the overhead.
- CPU: the same weight for every machine (``cpu.shares`` 1024 / ``cpu.weight`` 100,
  whatever its vCPU count), so a machine spinning on eight vCPUs gets no more CPU
  than one running a single thread. The parent's weight is kept at one machine's
  weight times the number of machines: the machines as a group compete with the rest
  of the host like that many processes, not like one.
- pids: `PIDS_MAX` tasks (QEMU's threads: vCPUs, its I/O thread pool of up to 64
  workers, migration and RCU threads).

The daemon writes these files as root; QEMU drops to its own user and cannot move
itself out (its seccomp filter denies resource control as well). A cgroup is removed
when its process has ended; `Cgroups.sweep` removes the empty ones a killed daemon
left. Without cgroups (not root, no controller, ``BOXD_CGROUPS=off``) machines run
unlimited and `Cgroups.summary` says why (``boxd info``, the daemon log).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("boxd.engine")

#: Host memory a QEMU process may use beyond its guest's RAM (TCG's 64 MiB translation
#: cache and its lookup structures, QEMU's heap and device buffers, page tables, the
#: disk layers' page cache, which is reclaimed first). Measured peaks are in
#: docs/security.md; this leaves room over the largest of them.
QEMU_OVERHEAD_MIB = 384
#: Tasks one QEMU process may run (measured: 6-31 threads; see docs/security.md).
PIDS_MAX = 512
#: Host memory a gVisor sandbox may use beyond twice its machine's memory: the Sentry
#: and gofer themselves (Go runtimes, page tables). Measured: ~20 MiB over the guest's
#: own use (docs/security.md).
GVISOR_OVERHEAD_MIB = 128
#: Tasks one gVisor sandbox may run: systrap gives every guest process a host stub
#: process, and guest threads host threads, so a guest's own tasks count here.
GVISOR_PIDS_MAX = 4096
CPU_SHARES = 1024  # v1 default and the weight of every machine
CPU_WEIGHT = 100  # v2 default
CONTROLLERS = ("memory", "cpu", "pids")
#: v1 hierarchies used where present, never required: ``freezer`` stops a paused
#: sandbox's idle threads (v2 has ``cgroup.freeze`` in every cgroup instead).
OPTIONAL = ("freezer",)


def memory_limit(memory_mib: int, *, ram_shared: bool) -> int:
    """Bytes of host memory a machine's QEMU process may use."""
    guest = memory_mib if ram_shared else 2 * memory_mib
    return (guest + QEMU_OVERHEAD_MIB) << 20


def sandbox_memory_limit(memory_mib: int) -> int:
    """Bytes of host memory a machine's gVisor sandbox may use.

    Everything of the guest is in the Sentry's memory file: its processes' memory, its
    file changes (the root overlay is in memory) and its tmpfs. A capture (fork
    template, checkpoint) is written by the Sentry to tmpfs and those pages are charged
    to the sandbox too, as with a QEMU process that maps its image privately: hence
    twice the machine's memory, plus the Sentry's and gofer's own.
    """
    return (2 * memory_mib + GVISOR_OVERHEAD_MIB) << 20


@dataclass(frozen=True)
class Limits:
    """What one VM process's cgroup allows."""

    memory_bytes: int
    pids: int = PIDS_MAX


def _write(path: Path, value: str) -> None:
    # (O_CREAT: cgroupfs refuses new files anyway; plain directories in tests need it.)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_int(path: Path, key: str | None = None) -> int | None:
    """The number in ``path``, or the value of ``key`` in a flat-keyed file."""
    try:
        text = path.read_text()
    except OSError:
        return None
    if key is None:
        word = text.strip()
        return int(word) if word.isdigit() else None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return None


def _setup_v1_cpu(parent: Path) -> None:
    _write(parent / "cpu.shares", str(CPU_SHARES))


def _setup_v1_memory(parent: Path) -> None:
    # Hierarchical accounting (always on in newer kernels; set if asked).
    with contextlib.suppress(OSError):
        if (parent / "memory.use_hierarchy").read_text().strip() == "0":
            _write(parent / "memory.use_hierarchy", "1")


def _setup_v1_pids(parent: Path) -> None:
    _read_int(parent / "pids.max")


#: What each required v1 controller's parent directory is given (or checked for) once
#: made; an OSError says the controller is unusable.
_V1_SETUP: dict[str, Callable[[Path], None]] = {
    "cpu": _setup_v1_cpu, "memory": _setup_v1_memory, "pids": _setup_v1_pids,
}


class VmCgroup:
    """The cgroup(s) of one VM process: one directory per v1 hierarchy, or one on v2."""

    def __init__(self, vm_id: str, version: int, dirs: dict[str, Path]) -> None:
        self.vm_id = vm_id
        self.version = version
        self.dirs = dirs  # controller -> directory (v2: every controller, one directory)

    @property
    def paths(self) -> list[Path]:
        return sorted(set(self.dirs.values()))

    def join(self) -> Callable[[], None]:
        """A function for the forked child before exec: moves the calling process in.

        It only opens and writes files (no locks, no allocation worth the name), which
        is what is safe between fork and exec in a threaded daemon; a failure is left
        for `contains` to notice.
        """
        procs = [os.fsencode(d / "cgroup.procs") for d in self.paths]

        def join() -> None:
            for p in procs:
                try:
                    fd = os.open(p, os.O_WRONLY)
                    try:
                        os.write(fd, b"0")
                    finally:
                        os.close(fd)
                except OSError:
                    pass

        return join

    def set_idle(self, idle: bool) -> bool:
        """Let the cgroup run only on CPU nothing else wants (``cpu.idle`` 1: SCHED_IDLE
        for the whole group, Linux 5.15+), or give it back its equal share (0). False
        when there is no CPU controller or no ``cpu.idle`` (the caller falls back)."""
        d = self.dirs.get("cpu")
        if d is None:
            return False
        try:
            _write(d / "cpu.idle", "1" if idle else "0")
        except OSError:
            return False
        return True

    def set_frozen(self, frozen: bool) -> bool:
        """Freeze every task of the cgroup (none runs until thawed; v1 ``freezer.state``,
        v2 ``cgroup.freeze``) or thaw them. False when this cgroup cannot be frozen.

        A frozen task cannot even die: SIGKILL waits for the thaw, so whoever kills a
        machine thaws its cgroup first (the gVisor engine's ``kill``).
        """
        try:
            if self.version == 1:
                d = self.dirs.get("freezer")
                if d is None:
                    return False
                _write(d / "freezer.state", "FROZEN" if frozen else "THAWED")
            else:
                _write(self.paths[0] / "cgroup.freeze", "1" if frozen else "0")
        except (OSError, IndexError):
            return False
        return True

    def pids(self) -> set[int]:
        """The processes in any of the directories."""
        found: set[int] = set()
        for d in self.paths:
            found |= self._procs(d)
        return found

    def contains(self, pid: int) -> bool:
        return all(pid in self._procs(d) for d in self.paths)

    @staticmethod
    def _procs(d: Path) -> set[int]:
        try:
            return {int(w) for w in (d / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            return set()

    @property
    def memory_limit(self) -> int | None:
        d = self.dirs.get("memory")
        if d is None:
            return None
        return _read_int(d / ("memory.limit_in_bytes" if self.version == 1 else "memory.max"))

    @property
    def memory_peak(self) -> int | None:
        """The most memory the process has used (for measurements and logs)."""
        d = self.dirs.get("memory")
        if d is None:
            return None
        return _read_int(d / ("memory.max_usage_in_bytes" if self.version == 1
                              else "memory.peak"))

    def oom_killed(self) -> bool:
        """True when the kernel killed a task here for reaching the memory limit."""
        d = self.dirs.get("memory")
        if d is None:
            return False
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        return (_read_int(d / name, "oom_kill") or 0) > 0

    def remove(self) -> bool:
        """Remove the directories (one try). True when none is left; False while a
        task is still in one (a killed process leaves its cgroup as it is reaped)."""
        done = True
        for d in self.paths:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("machine=%s event=cgroup_remove_failed path=%s error=%r",
                                self.vm_id, d, exc)
                done = False
        return done


class Cgroups:
    """The per-VM cgroups of one data directory (or none, and why)."""

    def __init__(self, version: int, parents: dict[str, Path], reason: str = "") -> None:
        self.version = version  # 0: unavailable
        self.parents = parents  # controller -> parent directory
        self.reason = reason

    @property
    def available(self) -> bool:
        return self.version > 0 and bool(self.parents)

    @classmethod
    def off(cls, reason: str) -> Cgroups:
        return cls(0, {}, reason)

    def summary(self, memory: str = f"guest RAM + {QEMU_OVERHEAD_MIB} MiB",
                pids: int = PIDS_MAX) -> str:
        """One line for ``boxd info`` and the log (``memory``: how the limit is sized)."""
        if not self.available:
            return f"none ({self.reason}): machines run without per-machine limits"
        where = ", ".join(f"{c} {p}" for c, p in sorted(self.parents.items()))
        missing = [c for c in CONTROLLERS if c not in self.parents]
        text = (f"cgroup v{self.version} per machine (memory: {memory}; an equal CPU "
                f"share; {pids} tasks) under {where}")
        if missing:
            text += f"; without {', '.join(missing)} ({self.reason})"
        return text

    @classmethod
    def open(
        cls, name: str, mode: str = "auto", *, mounts: Path = Path("/proc/self/mounts"),
        self_cgroup: Path = Path("/proc/self/cgroup"),
    ) -> Cgroups:
        """Find the controllers, make the parent ``name`` and check it is writable.

        Never raises: a host without usable cgroups gives an unavailable value whose
        ``reason`` says why.
        """
        if mode == "off":
            return cls.off("BOXD_CGROUPS=off")
        try:
            v1, v2 = _mounts(mounts)
            own = _own_cgroups(self_cgroup)
        except OSError as exc:
            return cls.off(f"cannot read the cgroup mounts: {exc.strerror or exc}")
        if any(c in v1 for c in CONTROLLERS):
            return cls._open_v1(name, v1, own)
        if v2 is not None:
            return cls._open_v2(name, v2, own.get("", "/"))
        return cls.off("no cgroup filesystem is mounted")

    @classmethod
    def _open_v1(cls, name: str, mounts: dict[str, Path], own: dict[str, str]) -> Cgroups:
        parents: dict[str, Path] = {}
        problems: list[str] = []
        for c in CONTROLLERS:
            if c not in mounts:
                problems.append(f"no {c} controller")
                continue
            parent = mounts[c] / own.get(c, "/").lstrip("/") / name
            try:
                parent.mkdir(exist_ok=True)
                _V1_SETUP[c](parent)
            except OSError as exc:
                problems.append(f"cannot use {parent}: {exc.strerror or exc}")
                continue
            parents[c] = parent
        if not parents:
            return cls.off("; ".join(problems))
        for c in OPTIONAL:
            if c in mounts:
                parent = mounts[c] / own.get(c, "/").lstrip("/") / name
                try:
                    parent.mkdir(exist_ok=True)
                except OSError as exc:
                    log.info("event=cgroup_optional_unusable controller=%s error=%r", c, exc)
                    continue
                parents[c] = parent
        return cls(1, parents, "; ".join(problems))

    @classmethod
    def _open_v2(cls, name: str, mount: Path, own: str) -> Cgroups:
        base = mount / own.lstrip("/")
        try:
            offered = (base / "cgroup.controllers").read_text().split()
        except OSError as exc:
            return cls.off(f"cannot read {base}/cgroup.controllers: {exc.strerror or exc}")
        wanted = [c for c in CONTROLLERS if c in offered]
        if not wanted:
            return cls.off(f"cgroup v2 offers none of {', '.join(CONTROLLERS)} at {base}")
        enable = " ".join(f"+{c}" for c in wanted)
        parent = base / name
        try:
            # A v2 cgroup with processes in it cannot hand controllers to children
            # (EBUSY): the daemon then needs a delegated cgroup of its own.
            _write(base / "cgroup.subtree_control", enable)
            parent.mkdir(exist_ok=True)
            _write(parent / "cgroup.subtree_control", enable)
            if "cpu" in wanted:
                _write(parent / "cpu.weight", str(CPU_WEIGHT))
        except OSError as exc:
            hint = (" (the daemon's cgroup has processes: run it in a delegated cgroup "
                    "of its own, e.g. a systemd unit with Delegate=yes)"
                    if exc.errno == errno.EBUSY else "")
            return cls.off(f"cannot use {parent}: {exc.strerror or exc}{hint}")
        missing = [c for c in CONTROLLERS if c not in wanted]
        return cls(2, {c: parent for c in wanted},
                   f"cgroup v2 does not offer {', '.join(missing)}" if missing else "")

    # ---------------------------------------------------------------- per VM

    def _dirs(self, vm_id: str) -> dict[str, Path]:
        return {c: p / vm_id for c, p in self.parents.items()}

    def create(self, vm_id: str, limits: Limits) -> VmCgroup | None:
        """Make (or reuse) the cgroup of ``vm_id`` with ``limits``; None without cgroups
        or when it cannot be made (logged: the machine then runs unlimited)."""
        if not self.available:
            return None
        cg = VmCgroup(vm_id, self.version, self._dirs(vm_id))
        try:
            for d in cg.paths:
                d.mkdir(exist_ok=True)
            self._set_limits(cg, limits)
        except OSError as exc:
            log.warning("machine=%s event=cgroup_failed error=%r", vm_id, exc)
            cg.remove()
            return None
        self._rebalance()
        return cg

    def _set_limits(self, cg: VmCgroup, limits: Limits) -> None:
        d = cg.dirs
        if self.version == 1:
            if "memory" in d:
                _write(d["memory"] / "memory.limit_in_bytes", str(limits.memory_bytes))
            if "cpu" in d:
                _write(d["cpu"] / "cpu.shares", str(CPU_SHARES))
        else:
            if "memory" in d:
                _write(d["memory"] / "memory.max", str(limits.memory_bytes))
                # No swapping of guest RAM: at the limit, reclaim page cache, else OOM.
                with contextlib.suppress(OSError):
                    _write(d["memory"] / "memory.swap.max", "0")
            if "cpu" in d:
                _write(d["cpu"] / "cpu.weight", str(CPU_WEIGHT))
        if "pids" in d:
            _write(d["pids"] / "pids.max", str(limits.pids))

    def _rebalance(self) -> None:
        """Give the parent one machine's CPU weight per machine in it."""
        parent = self.parents.get("cpu")
        if parent is None:
            return
        n = max(1, sum(1 for p in parent.iterdir() if p.is_dir()))
        with contextlib.suppress(OSError):
            if self.version == 1:
                _write(parent / "cpu.shares", str(min(CPU_SHARES * n, 262144)))
            else:
                _write(parent / "cpu.weight", str(min(CPU_WEIGHT * n, 10000)))

    def of(self, vm_id: str) -> VmCgroup | None:
        """The existing cgroup of ``vm_id`` (after a daemon restart), if any."""
        if not self.available:
            return None
        cg = VmCgroup(vm_id, self.version, self._dirs(vm_id))
        return cg if any(p.is_dir() for p in cg.paths) else None

    async def release(self, cg: VmCgroup | None, timeout: float = 2.0) -> None:
        """Remove a VM's cgroup once its process has ended (retried while the kernel
        still counts the dying task)."""
        if cg is None:
            return
        deadline = time.monotonic() + timeout
        while not cg.remove():
            if time.monotonic() > deadline:
                log.warning("machine=%s event=cgroup_busy pids=%s", cg.vm_id, sorted(cg.pids()))
                break
            await asyncio.sleep(0.02)
        self._rebalance()

    def release_now(self, cg: VmCgroup | None, timeout: float = 1.0) -> None:
        """`release` for synchronous callers (recovery, killing a stray VM)."""
        if cg is None:
            return
        deadline = time.monotonic() + timeout
        while not cg.remove() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._rebalance()

    def sweep(self, keep: Collection[str] = ()) -> list[str]:
        """Remove the cgroups no live process is in (a killed daemon's leftovers) and
        whose VM is not in ``keep``. Returns the VM ids removed."""
        if not self.available:
            return []
        names: set[str] = set()
        for parent in self.parents.values():
            with contextlib.suppress(OSError):
                names |= {p.name for p in parent.iterdir() if p.is_dir()}
        removed = []
        for vm_id in sorted(names - set(keep)):
            cg = VmCgroup(vm_id, self.version, self._dirs(vm_id))
            if not cg.pids() and cg.remove():
                removed.append(vm_id)
        if removed:
            self._rebalance()
        return removed


def _mounts(mounts: Path) -> tuple[dict[str, Path], Path | None]:
    """The v1 hierarchies by controller, and the v2 mount point (if any)."""
    v1: dict[str, Path] = {}
    v2: Path | None = None
    for line in mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = Path(fields[1].replace("\\040", " "))
        if fields[2] == "cgroup2" and v2 is None:
            v2 = point
        elif fields[2] == "cgroup":
            for opt in fields[3].split(","):
                if opt in CONTROLLERS or opt in OPTIONAL:
                    v1.setdefault(opt, point)
    return v1, v2


def _own_cgroups(self_cgroup: Path) -> dict[str, str]:
    """The daemon's own cgroup path per v1 controller ('' for v2)."""
    own: dict[str, str] = {}
    for line in self_cgroup.read_text().splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            own[""] = path
        for c in controllers.split(","):
            if c:
                own[c] = path
    return own


__all__ = ["CONTROLLERS", "GVISOR_OVERHEAD_MIB", "GVISOR_PIDS_MAX", "PIDS_MAX",
           "QEMU_OVERHEAD_MIB", "Cgroups", "Limits", "VmCgroup", "memory_limit",
           "sandbox_memory_limit"]
