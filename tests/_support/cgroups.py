"""Cgroup helpers: a fake cgroup v1 tree for unit tests, and the cgroups of a real
machine's process for the integration tests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def _v1(tmp: Path, own_memory: str = "/") -> tuple[Path, Path]:
    root = tmp / "cgroup"
    lines = []
    for c in ("memory", "cpu,cpuacct", "pids"):
        (root / c).mkdir(parents=True)
        lines.append(f"cgroup {root / c} cgroup rw,nosuid,{c} 0 0")
    lines.append(f"cgroup2 {root / 'unified'} cgroup2 rw 0 0")
    mounts = tmp / "mounts"
    mounts.write_text("\n".join(["proc /proc proc rw 0 0", *lines]) + "\n")
    (root / "memory" / own_memory.lstrip("/")).mkdir(parents=True, exist_ok=True)
    self_cg = tmp / "self_cgroup"
    self_cg.write_text(f"4:memory:{own_memory}\n2:cpu,cpuacct:/\n8:pids:/\n0::/\n")
    return mounts, self_cg


def _cgroups_of(pid: int) -> dict[str, Path]:
    """controller -> the cgroup directory of ``pid`` (v1 hierarchies under /sys/fs/cgroup)."""
    found = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            if c in ("memory", "cpu", "pids"):
                found[c] = Path("/sys/fs/cgroup", c, path.lstrip("/"))
    return found


def _require_cgroups(client) -> None:  # type: ignore[no-untyped-def]
    limits = client.info().limits or ""
    if not limits.startswith("cgroup v1"):
        pytest.skip(f"needs root and cgroup v1 controllers (this host's kind): {limits}")


def _limit(dirs: dict[str, Path]) -> int:
    return int((dirs["memory"] / "memory.limit_in_bytes").read_text())


def _gone(dirs: dict[str, Path], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(d.exists() for d in dirs.values()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
