"""The real guest agent (``guest/agent.py``, or boxd-init in front of it) as a host
process behind `FakeQemu`, a stand-in for QEMU's virtio-serial chardev; the fixtures
``guest`` (both front ends), ``hup_guest`` and ``init_guest``. Used by test_agent.py
and the tests built on it (streams, process bounds, rl attach)."""

from __future__ import annotations

import asyncio
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

import boxd.guest.agent as agent_module
from boxd.engine.agent import AgentClient
from boxd.errors import HostSetupError
from boxd.images._initramfs import INIT_SOURCE, compile_init

T = TypeVar("T")
AGENT = Path(agent_module.__file__)


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


class FakeQemu:
    """Relays bytes between one agent ("guest") and one host connection at a time.

    Like QEMU's virtio-serial port: while no host is connected, the guest's output waits
    (``buffer`` mode) and is delivered to the next host, stale replies included. With
    ``hup=True`` a host disconnect also hangs up on the agent (it sees EOF and reconnects),
    like POLLHUP on the port.
    """

    def __init__(self, directory: Path, *, hup: bool = False) -> None:
        self.guest_path = directory / "guest.sock"
        self.host_path = directory / "agent.sock"
        self.hup = hup
        self.guest_listen = self._listen(self.guest_path)
        self.host_listen = self._listen(self.host_path)
        self.guest: socket.socket | None = None
        self.host: socket.socket | None = None
        self.to_guest = bytearray()
        self.to_host = bytearray()
        self.guest_connects = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def _listen(path: Path) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen(4)
        sock.setblocking(False)
        return sock

    def stop(self) -> None:
        self.stopped = True
        self.thread.join(5)
        for s in (self.guest, self.host, self.guest_listen, self.host_listen):
            if s is not None:
                s.close()

    def _close_host(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None
        if self.hup and self.guest is not None:
            self.guest.close()
            self.guest = None
            self.to_host.clear()
            self.to_guest.clear()

    def _run(self) -> None:
        while not self.stopped:
            rlist: list[socket.socket] = [self.guest_listen, self.host_listen]
            wlist: list[socket.socket] = []
            for conn, out in ((self.guest, self.to_guest), (self.host, self.to_host)):
                if conn is not None:
                    rlist.append(conn)
                    if out:
                        wlist.append(conn)
            readable, writable, _ = select.select(rlist, wlist, [], 0.05)
            for sock in readable:
                if sock is self.guest_listen:
                    new, _ = sock.accept()
                    new.setblocking(False)
                    if self.guest is not None:
                        self.guest.close()
                    self.guest = new
                    self.guest_connects += 1
                elif sock is self.host_listen:
                    new, _ = sock.accept()
                    new.setblocking(False)
                    if self.host is not None:
                        self._close_host()
                    self.host = new
                elif sock is self.guest:
                    try:
                        data = sock.recv(1 << 20)
                    except OSError:
                        data = b""
                    if not data:
                        sock.close()
                        self.guest = None
                    else:
                        self.to_host += data
                elif sock is self.host:
                    try:
                        data = sock.recv(1 << 20)
                    except OSError:
                        data = b""
                    if not data:
                        self._close_host()
                    else:
                        self.to_guest += data
            for sock, buf in ((self.guest, self.to_guest), (self.host, self.to_host)):
                if sock is not None and sock in writable and buf:
                    try:
                        n = sock.send(buf)
                        del buf[:n]
                    except BlockingIOError:
                        pass
                    except OSError:
                        if sock is self.host:
                            self._close_host()


_INIT_BINARY: list[Path] = []


def init_binary(tmp_factory: pytest.TempPathFactory) -> Path:
    """boxd-init compiled from guest/init.c, once per test session."""
    if not _INIT_BINARY:
        try:
            data = compile_init((AGENT.parent / INIT_SOURCE).read_bytes())
        except HostSetupError as exc:
            pytest.skip(f"boxd-init cannot be built here ({exc.message}); the integration "
                        "tests still run it as every guest's PID 1")
        path = tmp_factory.mktemp("init") / "boxd-init"
        path.write_bytes(data)
        path.chmod(0o755)
        _INIT_BINARY.append(path)
    return _INIT_BINARY[0]


class Guest:
    """A running agent behind a FakeQemu: agent.py alone, or boxd-init in front of it."""

    def __init__(self, tmp: Path, *, hup: bool = False, init: Path | None = None) -> None:
        self.tmp = tmp
        self.qemu = FakeQemu(tmp, hup=hup)
        self.home = tmp / "home"
        self.sysroot = tmp / "sysroot"
        self.log_path = tmp / "agent.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.init = init
        agent_args = ["--default-cwd", str(self.home), "--sysroot", str(self.sysroot)]
        if init is None:
            argv = [sys.executable, str(AGENT), "--connect", str(self.qemu.guest_path),
                    *agent_args]
        else:
            argv = [str(init), "--connect", str(self.qemu.guest_path),
                    "--sysroot", str(self.sysroot), "--python", sys.executable,
                    "--agent", str(AGENT), "--", *agent_args]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=self.log)

    @property
    def socket_path(self) -> Path:
        return self.qemu.host_path

    async def client(self, timeout: float = 15.0) -> AgentClient:
        return await AgentClient.connect(self.socket_path, timeout=timeout)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.qemu.stop()
        self.log.close()


FRONTS = ["agent.py", "boxd-init"]  # every agent test runs against both front ends


def _front(request: pytest.FixtureRequest, tmp_factory: pytest.TempPathFactory) -> Path | None:
    return init_binary(tmp_factory) if request.param == "boxd-init" else None


@pytest.fixture(params=FRONTS)
def guest(
    request: pytest.FixtureRequest, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Guest]:
    g = Guest(tmp_path, init=_front(request, tmp_path_factory))
    yield g
    g.stop()
    print(g.log_path.read_text(errors="replace")[-4000:])  # shown when a test fails


@pytest.fixture(params=FRONTS)
def hup_guest(
    request: pytest.FixtureRequest, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Guest]:
    g = Guest(tmp_path, hup=True, init=_front(request, tmp_path_factory))
    yield g
    g.stop()
    print(g.log_path.read_text(errors="replace")[-4000:])


@pytest.fixture
def init_guest(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guest]:
    g = Guest(tmp_path, init=init_binary(tmp_path_factory))
    yield g
    g.stop()
    print(g.log_path.read_text(errors="replace")[-4000:])


def with_client(g: Guest, body: Callable[[AgentClient], Awaitable[T]]) -> T:
    async def main() -> T:
        client = await g.client()
        try:
            return await body(client)
        finally:
            await client.close()

    return run(main())


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]
