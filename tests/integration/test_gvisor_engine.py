"""The gVisor engine driven directly (no daemon): real runsc sandboxes on the image's tree.

Skipped, with the probe's reason, where runsc cannot run sandboxes.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from boxd.config import Paths, Settings
from boxd.engine.base import BootDisk, Engine, MachineConfig, MachineHandle
from boxd.engine.gvisor._engine import sandbox_matches
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
    await engine.drain()  # the teardown after the kill runs in the background
    assert not sandbox_matches(m.pid, "m_gv1")
    assert not paths.run_dir("m_gv1").exists()
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


# ------------------------------------------------------------------ network

INDEX_HOST = "pypi.org"
# Run in the sandbox: try each host:port; print {"host:port": "connected" | error}.
PROBE = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        out[target] = "connected"
    except OSError as e:
        out[target] = repr(e)
print(json.dumps(out))
"""
RESOLVE = f"import socket; print(socket.gethostbyname({INDEX_HOST!r}))"


def _host_addresses() -> list[str]:
    import json
    import subprocess

    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True,
                         check=True).stdout
    return [a["local"] for link in json.loads(out) for a in link.get("addr_info", [])]


def _ends(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` is gone or a zombie."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


def _index_unreachable() -> str | None:
    import socket

    try:
        with socket.create_connection((INDEX_HOST, 443), timeout=10):
            return None
    except OSError as exc:
        return f"this host has no route to the package index ({INDEX_HOST}): {exc}"


def test_network_reaches_nothing_on_the_host_and_forks_get_their_own(
    env: tuple[Paths, GuestImage],
) -> None:
    """A non-isolated sandbox has a network namespace of its own behind pasta: a listener
    on the host (127.0.0.1 and every other address of the host) is unreachable, from the
    machine and from a restored copy; DNS of the package index resolves where the host
    has a route to it."""
    import json
    import socket
    import threading

    server = socket.create_server(("0.0.0.0", 0))
    port = server.getsockname()[1]
    accepted: list[object] = []

    def serve() -> None:
        while True:
            try:
                conn, peer = server.accept()
            except OSError:
                return
            accepted.append(peer)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    targets = [f"{a}:{port}" for a in ["127.0.0.1", "10.0.2.2", *_host_addresses()]]
    no_index = _index_unreachable()

    async def body(engine: Engine, paths: Paths, image: GuestImage) -> None:
        disk = paths.disks / "m_gvnet0.qcow2"
        await engine.create_disk(disk, image.rootfs, "raw", 8)
        cfg = replace(_config("m_gvnet0"), isolated=False)
        m = await engine.boot(cfg, BootDisk(disk), paths.run_dir("m_gvnet0"),
                              paths.machines / "m_gvnet0" / "qemu.log")
        machines = [m]
        try:
            agent = await m.agent(timeout=30)
            addr = await agent.run("ip -4 addr; cat /etc/resolv.conf")
            assert b"10.0.2.15" in addr.stdout and b"nameserver 10.0.2.3" in addr.stdout
            await m.pause()
            img = await m.capture(paths.templates / "t_gvnet")
            await m.resume()
            cdisk = paths.disks / "m_gvnet1.qcow2"
            await engine.create_disk(cdisk, m.disk, "layer", 8)
            child = await engine.start_from(
                replace(cfg, id="m_gvnet1"), BootDisk(cdisk), img, paths.run_dir("m_gvnet1"),
                paths.machines / "m_gvnet1" / "qemu.log", copy_memory=False)
            machines.append(child)
            for a in (agent, await child.agent(timeout=30)):
                r = await a.run(["python3", "-c", PROBE, *targets], timeout=120)
                assert r.exit_code == 0, r
                result = json.loads(r.stdout)
                assert all(v != "connected" for v in result.values()), result
                if no_index is None:
                    dns = await a.run(["python3", "-c", RESOLVE], timeout=60)
                    assert dns.exit_code == 0 and dns.stdout.strip(), dns
            assert accepted == []
        finally:
            for x in machines:
                await x.destroy()
        # The namespace and pasta end with the machine.
        for x in machines:
            ns = x.netns  # type: ignore[attr-defined]
            assert ns is not None
            for pid in (ns.holder_pid, ns.pasta_pid):
                assert _ends(pid), f"process {pid} of {x.config.id}'s namespace still runs"

    try:
        run_with_engine(env, body)
    finally:
        server.close()
    if no_index is not None:
        pytest.skip(f"host reachability checked; DNS not: {no_index}")


def test_a_request_sent_while_paused_for_a_capture_is_answered(
    env: tuple[Paths, GuestImage]
) -> None:
    run_with_engine(env, _request_across_capture)


async def _request_across_capture(engine: Engine, paths: Paths, image: GuestImage) -> None:
    # What the fork churn hit: requests written to the agent's stdin while the source
    # was paused for a template's checkpoint. runsc 20240729's checkpoint took them in
    # (the restored copies answered them) and left boxd-init asleep on them: the
    # source answered only when its next request came. Its `resume` wakes the agent.
    src = await _boot(engine, paths, image, "m_gv4")
    try:
        agent = await src.agent(timeout=30)
        for n in range(3):
            await src.pause()
            pending = [asyncio.ensure_future(agent.run(["sh", "-c", f"echo {n}-{i}"]))
                       for i in range(3)]
            await asyncio.sleep(0.2)  # the requests wait in the FIFO: the sandbox is paused
            await src.capture(paths.templates / f"t_gv4_{n}")
            await src.resume()
            done = await asyncio.wait_for(asyncio.gather(*pending), 20)
            assert [d.stdout for d in done] == [f"{n}-{i}\n".encode() for i in range(3)]
    finally:
        await src.destroy()
