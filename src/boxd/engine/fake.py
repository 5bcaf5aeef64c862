"""An in-memory engine for unit tests of the node runtime: no processes, tiny files.

A fake machine's "memory" is a dict of guest files; capture writes it (as JSON) into
the image directory, and a machine started from an image reads it back, so fork,
checkpoint and snapshot semantics (a child sees its source's files; a restore rewinds)
are observable without QEMU. Its agent runs a few commands (``echo``, ``cat``,
``write PATH TEXT``, ``hostname``, and ``env``/``pwd``/``whoami``, which print the env,
cwd and user the request carried) and reports the rest as exit 0; its one long-lived
process is ``cat`` (``start(["cat"])``: what it is sent, it writes back).

Failures are injected by name (`FakeEngine.fail`), processes are killed by hand
(`FakeMachine.kill`), and `FakeEngine.gate` parks an operation at a chosen step so a
test can interleave another request exactly there.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import shutil
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path

from boxd.engine.agent import (
    ExecChunk,
    ExecExit,
    ExecOutcome,
    ExecOutput,
    FileStat,
    GuestUsage,
)
from boxd.engine.base import (
    BootDisk,
    EngineInfo,
    Fetcher,
    GuestStream,
    MachineConfig,
    MemoryImage,
    Process,
    RootFile,
)
from boxd.errors import (
    AgentLost,
    GuestFileNotFound,
    InternalError,
    InvalidRequest,
    MachineFailed,
)

_pids = itertools.count(100_000)


@dataclass
class FakeGuest:
    """What a fake machine's memory holds."""

    files: dict[str, str] = field(default_factory=dict)
    hostname: str = ""
    identities: int = 0  # how many times identity was set
    clock_steps: int = 0  # how many times the clock was stepped (wakes)
    api_keys: list[str] = field(default_factory=list)  # credentials delivered (serve_relay)
    metric_reads: int = 0  # `metrics` calls answered


class FakeProcess:
    """``cat`` in a fake machine: each write comes back as stdout; ``kill`` ends it."""

    def __init__(self, agent: FakeAgent) -> None:
        self._agent = agent
        self.exec_id = next(_pids)
        self._out: asyncio.Queue[ExecChunk] = asyncio.Queue()
        self._ended = False

    def __aiter__(self) -> AsyncIterator[ExecChunk]:
        return self._events()

    async def _events(self) -> AsyncIterator[ExecChunk]:
        while True:
            item = await self._out.get()
            yield item
            if isinstance(item, ExecExit):
                return

    def _end(self, code: int, sig: int | None) -> None:
        if not self._ended:
            self._ended = True
            self._out.put_nowait(ExecExit(exit_code=code, signal=sig, timed_out=False,
                                          duration=0.0))

    async def write(self, data: bytes) -> None:
        self._agent._check()
        if self._ended:
            raise InvalidRequest(f"no running exec with id {self.exec_id}", errno="ESRCH")
        self._out.put_nowait(ExecOutput("stdout", data))

    async def close_stdin(self) -> None:
        self._end(0, None)

    async def resize(self, rows: int, cols: int) -> None:
        self._agent._check()
        raise InvalidRequest(f"exec {self.exec_id} does not run on a pty", field="pty")

    async def kill(self, signal: int = 9) -> bool:
        ended = self._ended
        self._end(128 + signal, signal)
        return not ended

    async def aclose(self) -> None:
        self._end(137, 9)


class FakeAgent:
    def __init__(self, machine: FakeMachine) -> None:
        self._m = machine

    @property
    def connected(self) -> bool:
        return self._m.alive()

    def _check(self) -> None:
        if not self._m.alive():
            raise AgentLost(f"machine {self._m.config.id}: agent connection lost",
                            machine=self._m.config.id)

    async def exec(
        self, command: str | list[str], *, env: Mapping[str, str | None] | None = None,
        cwd: str | None = None, timeout: float | None = None, stdin: bytes | None = None,
        user: str | None = None,
    ) -> AsyncIterator[ExecChunk]:
        self._check()
        await self._m.engine._step("exec")
        self._check()
        argv = command.split(" ", 2) if isinstance(command, str) else list(command)
        out, code = "", 0
        g = self._m.guest
        if argv[0] == "echo":
            out = " ".join(argv[1:]) + "\n"
        elif argv[0] == "cat":
            if argv[1] not in g.files:
                out, code = "", 1
            else:
                out = g.files[argv[1]]
        elif argv[0] == "write":
            g.files[argv[1]] = argv[2] if len(argv) > 2 else ""
        elif argv[0] == "hostname":
            out = g.hostname + "\n"
        elif argv[0] == "env":  # what the request set (the agent's defaults are the guest's)
            out = "".join(f"{k}={v}\n" for k, v in sorted((env or {}).items()))
        elif argv[0] == "pwd":
            out = (cwd or "/home/boxd") + "\n"
        elif argv[0] == "whoami":
            out = (user or "root") + "\n"
        if out:
            yield ExecOutput("stdout", out.encode())
        yield ExecExit(exit_code=code, signal=None, timed_out=False, duration=0.0)

    async def start(
        self, command: str | list[str], *, env: Mapping[str, str | None] | None = None,
        cwd: str | None = None, timeout: float | None = None, user: str | None = None,
        pty: tuple[int, int] | None = None,
    ) -> Process:
        # The fake guest runs no programs but ``cat``: process streams (forks, re-attach)
        # are tested on real machines.
        self._check()
        if command != ["cat"] or pty is not None:
            raise InvalidRequest("the fake engine runs no long-lived processes but cat "
                                 "(and no pty)", field="argv")
        return FakeProcess(self)

    async def attach(self, exec_id: int) -> Process:
        self._check()
        raise InvalidRequest("the fake engine runs no long-lived processes", field="process")

    async def run(
        self, command: str | list[str], *, env: Mapping[str, str | None] | None = None,
        cwd: str | None = None, timeout: float | None = None, stdin: bytes | None = None,
        max_output: int | None = None, user: str | None = None,
    ) -> ExecOutcome:
        out = b""
        code = 0
        async for item in self.exec(command, env=env, cwd=cwd, timeout=timeout, stdin=stdin,
                                    user=user):
            if isinstance(item, ExecExit):
                code = item.exit_code
            else:
                out += item.data
        cut = max_output is not None and len(out) > max_output
        if max_output is not None:
            out = out[:max_output]
        return ExecOutcome(out, b"", code, None, False, 0.0, stdout_truncated=cut)

    async def write_file(
        self, path: str, data: bytes | AsyncIterable[bytes], mode: int = 0o644,
        user: str | None = None,
    ) -> FileStat:
        self._check()
        if not isinstance(data, bytes):
            data = b"".join([chunk async for chunk in data])
        self._m.guest.files[path] = data.decode()
        import hashlib

        return FileStat(path, len(data), mode, hashlib.sha256(data).hexdigest())

    async def read_stream(self, path: str) -> AsyncGenerator[bytes, None]:
        data = await self.read_file(path)
        for i in range(0, len(data), 1 << 20):
            yield data[i : i + (1 << 20)]

    async def read_file(self, path: str) -> bytes:
        self._check()
        if path not in self._m.guest.files:
            raise GuestFileNotFound(f"no file {path!r} in the machine", path=path)
        return self._m.guest.files[path].encode()

    async def identity(self, *, hostname: str, machine_id: str, seed: bytes, now: float,
                       api_key: str | None = None) -> None:
        self._check()
        if api_key is not None:
            self._m.guest.api_keys.append(api_key)
        await self._m.engine._step("identity")
        self._check()
        self._m.guest.hostname = hostname
        self._m.guest.identities += 1

    async def sync(self, timeout: float = 60.0) -> None:
        self._check()

    async def metrics(self) -> GuestUsage:
        """A guest whose CPU counters advance by one busy tick of four per call."""
        self._check()
        self._m.guest.metric_reads += 1
        n = self._m.guest.metric_reads
        return GuestUsage(time=time.time(), cpu_count=self._m.config.vcpus, cpu_busy=n * 100,
                          cpu_total=n * 400, mem_total=self._m.config.memory_mib << 20,
                          mem_used=64 << 20, mem_cache=16 << 20, disk_total=1 << 30,
                          disk_used=256 << 20)

    async def clock(self, now: float) -> None:
        self._check()
        self._m.guest.clock_steps += 1

    def supports(self, minor: int) -> bool:
        return True

    async def set_api_key(self, api_key: str) -> None:
        self._check()
        self._m.guest.api_keys.append(api_key)

    def on_guest_connect(self, callback: Callable[[], None]) -> None:
        return None  # no guest process ever connects

    async def serve_relay(
        self, key: str, on_stream: Callable[[GuestStream], Awaitable[None]], *,
        streams: dict[int, GuestStream] | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        """Take the credential; no guest process ever connects. Ends with the machine."""
        self._check()
        if self._m.guest.api_keys[-1:] != [key]:
            self._m.guest.api_keys.append(key)
        if on_started is not None:
            on_started()
        while self._m.alive():
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        return None


class FakeMachine:
    def __init__(
        self, engine: FakeEngine, config: MachineConfig, disk: Path, run_dir: Path,
        guest: FakeGuest, ram_shared: bool, paused: bool = False,
    ) -> None:
        self.engine = engine
        self._config = config
        self._disk = disk
        self.run_dir = run_dir
        self.guest = guest
        self._ram_shared = ram_shared
        self._pid = next(_pids)
        self.paused = paused
        self._exited = asyncio.Event()
        self._reason = ""
        self.destroyed = False
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "pid").write_text(str(self._pid))
        engine.running[config.id] = self

    @property
    def config(self) -> MachineConfig:
        return self._config

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def disk(self) -> Path:
        return self._disk

    @property
    def ram_shared(self) -> bool:
        return self._ram_shared

    def kill(self, reason: str = "the fake VM process was killed by SIGKILL") -> None:
        """End the 'process' (as a crash would)."""
        if not self._exited.is_set():
            self._reason = reason
            self._exited.set()
            self.engine.running.pop(self._config.id, None)

    async def agent(self, timeout: float = 60.0) -> FakeAgent:
        if not self.alive():
            raise MachineFailed(f"machine {self._config.id} failed: {self._reason}",
                                machine=self._config.id)
        return FakeAgent(self)

    def alive(self) -> bool:
        return not self._exited.is_set()

    def exit_reason(self) -> str:
        return self._reason or "running"

    async def wait_exit(self) -> str:
        await self._exited.wait()
        return self._reason

    async def open_http(
        self, port: int = 8080
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        raise OSError("the fake engine's machines have no guest network")

    async def pause(self) -> None:
        await self.engine._step("pause")
        self.paused = True

    async def resume(self) -> None:
        await self.engine._step("resume")
        self.paused = False

    async def recover(self) -> str | None:
        if self.paused:
            self.paused = False
            return "resumed a VM left paused"
        return None

    async def freeze_disk(self, new_active: Path) -> Path:
        await self.engine._step("freeze_disk")
        frozen = self._disk
        new_active.write_text(json.dumps({"backing": str(frozen)}))
        self._disk = new_active
        return frozen

    async def collapse_disk(self, base: Path) -> None:
        await self.engine._step("collapse_disk")
        self._disk.write_text(json.dumps({"backing": str(base)}))

    async def capture(self, dest_dir: Path) -> MemoryImage:
        await self.engine._step("capture")
        if not self.alive():
            raise MachineFailed(f"machine {self._config.id} died during capture")
        dest_dir.mkdir(parents=True, exist_ok=True)
        state = dest_dir / "state"
        state.write_text(json.dumps({"files": self.guest.files, "hostname": self.guest.hostname}))
        mem: Path | None = None
        if self._ram_shared:
            mem = dest_dir / "mem"
            mem.write_text("ram")
        return MemoryImage(mem, state, self._config.memory_mib)

    async def destroy(self) -> None:
        self.destroyed = True
        self.kill("destroyed")
        shutil.rmtree(self.run_dir, ignore_errors=True)

    async def detach(self) -> None:
        return None


class FakeEngine:
    """The engine protocol in memory; see the module docstring."""

    def __init__(self) -> None:
        self.running: dict[str, FakeMachine] = {}
        self.failures: dict[str, Exception] = {}
        self.gates: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}
        self.calls: list[str] = []
        self.portable = True  # its templates move between nodes (`portable_templates`)
        self.portable_images = True  # ... an image machine's too (`portable_image_templates`)
        self.roots_from_images = True  # boots on an image's tree (`image_roots`)
        # Set: a machine of an image's tree sits on a file this engine makes of the tree
        # here (as QEMU's disk: each node's differs), which a cross-node fork sends along
        # (`root_files`, `receive_root`); received ones are kept there by name.
        self.made_roots: Path | None = None

    @property
    def name(self) -> str:
        return "fake"

    @property
    def accelerator(self) -> str:
        return "none"

    @property
    def accelerator_reason(self) -> str:
        return "the fake engine runs no guest code"

    @property
    def cpu_model(self) -> str:
        return "fake"

    @property
    def file_owner(self) -> tuple[int, int] | None:
        return None

    def info(self) -> EngineInfo:
        return EngineInfo("fake", "", "0", "none", self.accelerator_reason, "fake")

    # ------------------------------------------------------------ test controls

    def fail(self, step: str, error: Exception | None = None) -> None:
        """Make the next ``step`` (boot, start_from, capture, identity, …) raise
        ``error`` (a boxd error, or any other, as a real engine's bug or the host's)."""
        self.failures[step] = error or InternalError(f"injected failure at {step}")

    def gate(self, step: str) -> tuple[asyncio.Event, asyncio.Event]:
        """Park the next ``step``: returns (reached, release) events."""
        pair = (asyncio.Event(), asyncio.Event())
        self.gates[step] = pair
        return pair

    async def _step(self, step: str) -> None:
        self.calls.append(step)
        gate = self.gates.pop(step, None)
        if gate is not None:
            gate[0].set()
            await gate[1].wait()
        err = self.failures.pop(step, None)
        if err is not None:
            raise err

    # ---------------------------------------------------------------- protocol

    async def boot(
        self, config: MachineConfig, disk: BootDisk, run_dir: Path, log_path: Path
    ) -> FakeMachine:
        await self._step("boot")
        return FakeMachine(self, config, disk.path, run_dir, FakeGuest(), ram_shared=True)

    async def start_from(
        self, config: MachineConfig, disk: BootDisk, image: MemoryImage, run_dir: Path,
        log_path: Path, *, copy_memory: bool, paused: bool = False,
    ) -> FakeMachine:
        await self._step("start_from")
        data = json.loads(image.state_path.read_text())
        guest = FakeGuest(files=dict(data["files"]), hostname=data["hostname"])
        shared = copy_memory or image.mem_path is None
        return FakeMachine(self, config, disk.path, run_dir, guest, ram_shared=shared,
                           paused=paused)

    def attach(
        self, config: MachineConfig, run_dir: Path, pid: int, disk: Path, ram_shared: bool,
        log_path: Path,
    ) -> FakeMachine:
        for m in self.running.values():
            if m.pid == pid and m.config.id == config.id:
                return m
        raise MachineFailed(f"machine {config.id} failed: its process (pid {pid}) is gone",
                            machine=config.id)

    def kill_stray(self, vm_id: str, run_dir: Path, pid: int | None = None) -> bool:
        m = self.running.get(vm_id)
        if m is None:
            return False
        m.kill("killed as a stray")
        return True

    async def create_disk(
        self, path: Path, backing: Path, backing_format: str, size_gib: int
    ) -> None:
        await self._step("create_disk")
        if backing.is_dir() and self.made_roots is not None:
            own = self.made_roots / f"{backing.name}.root"
            if not own.exists():
                own.parent.mkdir(parents=True, exist_ok=True)
                own.write_text(secrets.token_hex(8))  # this node's own making of the tree
            backing, backing_format = own, "root"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"backing": str(backing), "format": backing_format}))

    async def flatten_disk(self, layer: Path, dest: Path) -> None:
        await self._step("flatten_disk")
        shutil.copyfile(layer, dest)

    def remove_disk(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    @property
    def image_roots(self) -> bool:
        return self.roots_from_images

    @property
    def portable_templates(self) -> bool:
        return self.portable

    @property
    def portable_image_templates(self) -> bool:
        return self.portable_images

    async def retarget_disk(self, path: Path, backing: Path, backing_format: str) -> None:
        await self._step("retarget_disk")
        path.write_text(json.dumps({"backing": str(backing), "format": backing_format}))

    async def receive_image(self, image: MemoryImage, disk: Path) -> MemoryImage:
        await self._step("receive_image")
        return image

    def root_files(self, layer: Path, image: MemoryImage) -> tuple[RootFile, ...]:
        backing = Path(json.loads(layer.read_text())["backing"])
        if self.made_roots is None or backing.parent != self.made_roots:
            return ()
        if backing.suffix == ".root":  # made here: named by its content
            return (RootFile(f"{backing.stem}.{backing.read_text()}", backing),)
        return (RootFile(backing.name, backing),)

    async def receive_root(self, files: Sequence[tuple[str, Fetcher]],
                           into: Path) -> Path | None:
        await self._step("receive_root")
        top: Path | None = None
        for name, fetch in files:
            if self.made_roots is None or "/" in name or name.count(".") != 1:
                raise InvalidRequest(f"{name!r} is not a root file's name", field="roots")
            tree, token = name.split(".")
            own = self.made_roots / f"{tree}.root"
            top = self.made_roots / name
            if own.exists() and own.read_text() == token:
                top = own
            elif not top.exists():
                self.calls.append(f"fetch_root:{name}")
                self.made_roots.mkdir(parents=True, exist_ok=True)
                await fetch(top)
        return top


__all__ = ["FakeAgent", "FakeEngine", "FakeGuest", "FakeMachine"]
