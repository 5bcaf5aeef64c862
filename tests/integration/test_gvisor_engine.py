"""The gVisor engine driven directly (no daemon): real runsc sandboxes on the image's tree.

Skipped, with the probe's reason, where runsc cannot run sandboxes.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from boxd.config import Paths, Settings
from boxd.engine.base import BootDisk, Engine, MachineConfig, MachineHandle
from boxd.engine.registry import engine_status, open_engine
from boxd.images import GuestImage, ensure_image

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[Paths, GuestImage]]:
    home = Path(tempfile.mkdtemp(prefix="boxd-gvisor-", dir="/tmp"))
    paths = Paths(home)
    paths.ensure()
    image = ensure_image(paths)
    status = engine_status("gvisor", Settings.from_env(), paths, image)
    if status.status != "ok":
        pytest.skip(f"gvisor unavailable here: {status.reason}")
    yield paths, image
    import shutil

    shutil.rmtree(paths.shm, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)


def run_with_engine(env: tuple[Paths, GuestImage], body: Callable[..., Awaitable[None]]) -> None:
    """Run ``body(engine, paths, image)`` on a fresh gvisor engine in its own loop."""
    paths, image = env

    async def main() -> None:
        e = await open_engine("gvisor", Settings.from_env(), paths, image)
        try:
            await body(e, paths, image)
        finally:
            await e.drain()  # type: ignore[attr-defined]

    asyncio.run(main())


def _config(vm_id: str, hostname: str = "g1") -> MachineConfig:
    return MachineConfig(id=vm_id, hostname=hostname, vcpus=1, memory_mib=512, isolated=True,
                         port=None, kernel=Path(), initrd=Path(), cmdline="")


async def _boot(engine: Engine, paths: Paths, image: GuestImage, vm_id: str) -> MachineHandle:
    disk = paths.disks / f"{vm_id}.qcow2"
    await engine.create_disk(disk, image.rootfs, "raw", 8)
    return await engine.boot(_config(vm_id), BootDisk(disk), paths.run_dir(vm_id),
                             paths.machines / vm_id / "qemu.log")


def test_boot_exec_files_pause_destroy(env: tuple[Paths, GuestImage]) -> None:
    run_with_engine(env, _boot_exec_files)


async def _boot_exec_files(engine: Engine, paths: Paths, image: GuestImage) -> None:
    t0 = time.monotonic()
    m = await _boot(engine, paths, image, "m_gv1")
    agent = await m.agent(timeout=30)
    boot_s = time.monotonic() - t0
    out = await agent.run(["sh", "-c", "echo hi; uname -a; id -u"])
    assert out.exit_code == 0, out
    assert out.stdout.startswith(b"hi\n")
    await agent.write_file("/home/boxd/f.txt", b"data", 0o600)
    assert await agent.read_file("/home/boxd/f.txt") == b"data"
    await agent.identity(hostname="renamed", machine_id="ab" * 16, seed=b"x" * 64,
                         now=time.time())
    assert (await agent.run("hostname")).stdout == b"renamed\n"
    assert (await agent.run("cat /etc/machine-id")).stdout == b"ab" * 16 + b"\n"
    await m.pause()
    await m.resume()
    assert (await agent.run("true")).exit_code == 0
    await m.destroy()
    assert not m.alive()
    assert boot_s < 10


def test_capture_and_restore_copies(env: tuple[Paths, GuestImage]) -> None:
    run_with_engine(env, _capture_restore)


async def _capture_restore(engine: Engine, paths: Paths, image: GuestImage) -> None:
    src = await _boot(engine, paths, image, "m_gv2")
    agent = await src.agent(timeout=30)
    await agent.run("echo before > /home/boxd/a; echo tmp > /tmp/t; "
                    "nohup sleep 1000 >/dev/null 2>&1 &")
    dest = paths.templates / "t_gv2"
    await src.pause()
    img = await src.capture(dest)
    await src.resume()
    await agent.run("echo after > /home/boxd/a")
    children = []
    t0 = time.monotonic()
    for i in range(2):
        vm = f"m_gv2c{i}"
        disk = paths.disks / f"{vm}.qcow2"
        await engine.create_disk(disk, src.disk, "layer", 8)
        children.append(await engine.start_from(
            _config(vm), BootDisk(disk), img, paths.run_dir(vm),
            paths.machines / vm / "qemu.log", copy_memory=False))
    agents = await asyncio.gather(*(c.agent(timeout=30) for c in children))
    restore_s = time.monotonic() - t0
    for a in agents:
        assert (await a.run("cat /home/boxd/a /tmp/t")).stdout == b"before\ntmp\n"
        assert (await a.run("pgrep -x sleep")).exit_code == 0
    await agents[0].run("echo child0 > /home/boxd/a")
    assert (await agents[1].run("cat /home/boxd/a")).stdout == b"before\n"
    assert (await agent.run("cat /home/boxd/a")).stdout == b"after\n"
    for m in (src, *children):
        await m.destroy()
    assert restore_s < 20
