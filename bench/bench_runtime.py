"""Machine runtime benchmarks (issue 2): boot, exec round trip, agent ping, idle memory.

    python bench/bench_runtime.py        # this module alone (bench/run.py runs them all)

Measures, on the daemon the environment points at (``BOXD_HOME``), each figure with a
baseline taken in the same run (see ``_common`` for the Row/run() convention):

- **boot → agent ready**: ``machines.new`` + ``wait_until_ready`` (cold boot from the
  image), ``BENCH_BOOT_N`` times (default 3). Baseline: forking that freshly booted
  machine until the child is exec-ready.
- **exec round trip of ``true``** through SDK → HTTP → daemon → agent → guest process and
  back, ``BENCH_EXEC_N`` times (default 30). Baseline: ``subprocess.run(["true"])`` on
  the host.
- **agent ping round trip**, measured with the engine's own ``AgentClient.ping`` on a
  machine this module boots *in-process* with ``QemuEngine`` (the daemon's agent socket
  takes one client, so its machines cannot be pinged from outside). Baseline: a JSON
  line echoed over a host unix socket with asyncio (the transport floor).
- **idle memory**: PSS (``/proc/PID/smaps_rollup``) of the QEMU process of a freshly
  booted machine after ``BENCH_IDLE_S`` seconds idle (default 5), and of an idle fork
  child of it; the child's ratio is against the fresh machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Row,
    measure,
    pss_bytes,
    qemu_pid,
    row_from,
    say,
    standalone,
)
from boxd import Boxd

GROUP = "runtime"
BOOT_N = int(os.environ.get("BENCH_BOOT_N", "3"))
EXEC_N = int(os.environ.get("BENCH_EXEC_N", "30"))
PING_N = int(os.environ.get("BENCH_PING_N", "200"))
IDLE_S = float(os.environ.get("BENCH_IDLE_S", "5"))
READY_TIMEOUT = 600.0


def _delete(client: Boxd, ref: str) -> None:
    try:
        client.machines.delete(ref)
    except Exception as exc:  # clean-up must not hide the measurement's own error
        say(f"bench_runtime: could not delete {ref}: {exc}")


def _pss_of(machine_id: str) -> int:
    pid = qemu_pid(machine_id)
    if pid is None:
        raise RuntimeError(f"no QEMU process for machine {machine_id}")
    return pss_bytes(pid)


# ----------------------------------------------------------------- agent ping (engine)


async def _echo_baseline(n: int) -> list[float]:
    """Round trips of one JSON line over a host unix socket (asyncio both ends)."""
    tmp = Path(tempfile.mkdtemp(prefix="boxd-bench-echo-"))
    path = tmp / "echo.sock"

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            writer.write(line)
            await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(echo, path=str(path))
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
        msg = b'{"id": 1, "op": "ping"}\n'
        out = []
        for i in range(n + 3):
            t = time.perf_counter()
            writer.write(msg)
            await writer.drain()
            await reader.readline()
            if i >= 3:
                out.append(time.perf_counter() - t)
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.05)  # let the handler see EOF and return
        return out
    finally:
        server.close()
        await server.wait_closed()
        shutil.rmtree(tmp, ignore_errors=True)


async def _agent_pings(accelerator: str, reason: str, n: int) -> list[float]:
    """Boot one isolated machine with the engine directly and ping its agent ``n`` times."""
    async with engine_machine(accelerator, reason, "bench-ping") as agent:
        for _ in range(5):  # warm-up: first answers pay for cold guest code paths
            await agent.ping()
        return [await agent.ping() for _ in range(n)]


@contextlib.asynccontextmanager
async def engine_machine(accelerator: str, reason: str, hostname: str) -> AsyncIterator[Any]:
    """One isolated machine booted with the engine directly (no daemon): its agent.

    The daemon's agent socket takes one client, so this is how a benchmark reaches an
    agent without the daemon in between. ``accelerator``/``reason``: the daemon's
    choice (``boxd info``), so there is no second probe.
    """
    from boxd.config import Paths
    from boxd.engine.base import BootDisk, MachineConfig
    from boxd.engine.qemu import QemuEngine, qemu_version
    from boxd.engine.qemu._probe import AccelChoice
    from boxd.images import ensure_image
    from boxd.state import new_id
    from boxd.storage import disks

    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise RuntimeError("qemu-system-x86_64 not found")
    home = Path(tempfile.mkdtemp(prefix="boxd-bench-ping-")).resolve()
    paths = Paths(home)
    paths.ensure()
    handle = None
    try:
        image = await asyncio.to_thread(ensure_image, paths)
        # Reuse the daemon's accelerator choice: no second probe.
        engine = QemuEngine(qemu, AccelChoice(accelerator, reason),
                            readonly_rom=qemu_version(qemu) >= (8, 2, 0))
        mid = new_id("m")
        disk = disks.layer_path(paths.disks, mid)
        await disks.create_overlay(disk, image.rootfs, "raw", 8)
        config = MachineConfig(
            id=mid, hostname=hostname, vcpus=1, memory_mib=1024, isolated=True,
            port=None, kernel=image.kernel, initrd=image.initrd, cmdline=image.cmdline_hint,
        )
        handle = await engine.boot(config, BootDisk(disk), paths.run_dir(mid),
                                   paths.machines / mid / "qemu.log")
        yield await handle.agent(timeout=READY_TIMEOUT)
    finally:
        if handle is not None:
            await handle.destroy()
        shutil.rmtree(paths.shm, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


# ------------------------------------------------------------------------------ run


def run(client: Boxd | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    """Measure boot, exec and ping round trips and idle memory; return the rows."""
    tell = log or say
    own = client is None
    boxd = client or Boxd()
    try:
        info = boxd.info()
        accel = info.accelerator
        boots: list[float] = []
        forks: list[float] = []
        fresh_pss: list[float] = []
        child_pss: list[float] = []
        execs: list[float] = []
        stamp = f"{os.getpid() % 10000}-{int(time.time()) % 100000}"
        for i in range(BOOT_N):
            name = f"bench-rt-{stamp}-{i}"
            tell(f"bench_runtime: cold boot {i + 1}/{BOOT_N}")
            t = time.perf_counter()
            m = boxd.machines.new(name)
            made = [m.id]
            try:
                boxd.machines.wait_until_ready(m.id, timeout=READY_TIMEOUT)
                boots.append(time.perf_counter() - t)
                time.sleep(IDLE_S)
                fresh_pss.append(_pss_of(m.id))
                t = time.perf_counter()
                child = boxd.machines.fork(m.id, f"{name}-child")
                made.append(child.id)
                boxd.machines.wait_until_ready(child.id, timeout=READY_TIMEOUT)
                forks.append(time.perf_counter() - t)
                time.sleep(IDLE_S)
                child_pss.append(_pss_of(child.id))
                if i == 0:
                    tell(f"bench_runtime: exec round trip x{EXEC_N}")
                    execs = measure(lambda mid=m.id: boxd.machines.exec(mid, "true"), EXEC_N,
                                    warmup=3)
            finally:
                for ref in reversed(made):
                    _delete(boxd, ref)
        host_true = measure(lambda: subprocess.run(["true"], check=True), EXEC_N, warmup=3)

        tell(f"bench_runtime: agent ping x{PING_N} (engine, in-process machine)")
        pings = asyncio.run(_agent_pings(accel, info.accelerator_reason, PING_N))
        echo = asyncio.run(_echo_baseline(PING_N))
    finally:
        if own:
            boxd.close()

    return [
        row_from(GROUP, "boot → agent ready (machines.new + wait_until_ready)", boots,
                 accel=accel, baseline="fork → child ready", baseline_values=forks),
        row_from(GROUP, "fork of a fresh machine → child ready", forks, accel=accel),
        row_from(GROUP, "exec round trip of `true` (SDK → daemon → guest)", execs,
                 accel=accel, baseline="host subprocess.run(['true'])",
                 baseline_values=host_true),
        row_from(GROUP, "agent ping round trip (engine AgentClient.ping)", pings,
                 accel=accel, baseline="host unix-socket echo", baseline_values=echo),
        row_from(GROUP, "idle memory: freshly booted machine (QEMU PSS)", fresh_pss,
                 unit="B", accel=accel, note=f"after {IDLE_S:g}s idle; 1024 MiB guest"),
        row_from(GROUP, "idle memory: fork child (QEMU PSS)", child_pss, unit="B",
                 accel=accel, baseline="fresh machine", baseline_values=fresh_pss,
                 note=f"after {IDLE_S:g}s idle"),
    ]


if __name__ == "__main__":
    standalone(run)
