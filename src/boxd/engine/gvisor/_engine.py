"""GvisorEngine and GvisorMachine: machines as gVisor sandboxes (``runsc``, systrap).

A machine is one sandbox started detached (``runsc run --detach``): its PID 1 is the
guest agent (the same agent and protocol as in a QEMU guest) serving on its stdin and
stdout, which are two FIFOs in the machine's run directory. The engine opens each FIFO
read-write for the sandbox, so neither ever reports EOF and the daemon can close and
reopen its ends at will (a daemon restart reattaches). ``runsc restore`` hands its own
stdio to the restored process, so a restored copy gets FIFOs of its own.

The filesystem: the image's root tree (unpacked once, read-only on the host) under
gVisor's in-memory overlay (``--overlay2=root:memory``), so every change lives in the
sandbox's memory and every checkpoint contains it. A disk layer of this engine is
therefore a small JSON file naming its backing (the node's chain bookkeeping stays the
same); the bytes are in the captures.

Capture = ``runsc checkpoint --leave-running --compression=none`` into a directory
(``checkpoint.img``, ``pages.img``, ``pages_meta.img``); `MemoryImage.mem_path` is
``mem`` (a hard link to ``pages.img``) and `MemoryImage.state_path` ``state``, a tar of
the other two plus the host trees the sandbox was built on, so a snapshot's two blobs
hold everything (and the node finds a hibernation image by the names QEMU uses).
Start-from = ``runsc restore``. Copies share no memory: each restore reads the image.
A fork template moves to another node as these files (`portable_templates`); the
receiving node lays it out the same way on its own trees (`unpack_received`).

Deleting a sandbox (``runsc delete``) takes 1.5-2 s when its parent does not reap it
promptly: `destroy` kills the sandbox at once and deletes its runsc state in the
background.

Limits: each sandbox runs in a cgroup of its own (`boxd.engine.cgroups`, the same
layout as QEMU's): ``runsc run``/``restore`` joins it before exec (runsc itself is told
``--ignore-cgroups``), so the sandbox, its gofer and systrap's stub processes are in it.
Memory is bounded by `sandbox_memory_limit`. gVisor has no OOM killer of its own (and
the guest's /proc/meminfo shows the host's memory): past the limit the host kernel's
kills the largest process in the cgroup, a guest process's stub (that process dies) or
the Sentry (the machine fails, and `exit_reason` says it was the OOM killer). Whatever
is left in the cgroup is killed when the sandbox ends, and the cgroup removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

from boxd.config import GUEST_HTTP_PORT
from boxd.engine.agent import AgentClient, connect_watched, dial_guest_port
from boxd.engine.base import (
    BootDisk,
    EngineInfo,
    Fetcher,
    MachineConfig,
    MemoryImage,
    RootFile,
)
from boxd.engine.cgroups import (
    GVISOR_OVERHEAD_MIB,
    GVISOR_PIDS_MAX,
    Cgroups,
    Limits,
    VmCgroup,
    sandbox_memory_limit,
)
from boxd.engine.gvisor import _net, _spec
from boxd.engine.gvisor._spec import Roots, RunFiles
from boxd.errors import (
    BoxdError,
    HostSetupError,
    InternalError,
    InvalidRequest,
    MachineFailed,
    StateError,
)
from boxd.guest import protocol as P
from boxd.images import AGENT_MOUNT, rootfs_tree
from boxd.images.oci import CHAINS
from boxd.storage.fds import OwnedFd, pipe_file

log = logging.getLogger("boxd.engine")

CHECKPOINT = "checkpoint.img"
PAGES = "pages.img"
PAGES_META = "pages_meta.img"
# The names the node reads a capture back by (QEMU's): a hard link to pages.img, and the
# tar of the rest.
MEM = "mem"
STATE_TAR = "state"
ROOTS = "roots.json"
LAYER_KIND = "boxd-gvisor-layer"
RUNSC_TIMEOUT = 60.0
#: Seconds a sandbox stays paused before its cgroup is frozen (`GvisorMachine.pause`).
FREEZE_AFTER = 0.5
#: Seconds a restored standby copy keeps running, at idle CPU priority, before its
#: freezer holds it (`GvisorMachine.hold`). About 0.8 s after a restore its Sentry does
#: a burst of one-off work (measured, not traced to its source); a copy frozen as soon
#: as its agent answered kept that work for its claim, where it cost the fork's first
#: half second ~65 ms of CPU beside the rollout.
HOLD_AFTER = 1.5
# A standby copy's CPU-bound restore yields to machines that are running an exec (the
# rollouts that claimed the previous standby copies): its cgroup is set to cpu.idle, or
# without a cgroup CPU controller every thread gets this niceness (on top of the
# daemon's). Claiming it gives it an equal share again.
BACKGROUND_NICE = 19
#: Seconds a pause waits for the guest's TCP handshakes with the outside to finish
#: (`GvisorMachine._settle_handshakes`).
SETTLE_HANDSHAKES = 2.0


# ----------------------------------------------------------------------- layers


def write_layer(path: Path, backing: Path, fmt: str) -> None:
    """A gVisor disk layer: JSON naming its backing (a raw rootfs image or a layer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"kind": LAYER_KIND, "backing": str(backing), "format": fmt}))
    os.replace(tmp, path)


def layer_base(path: Path) -> Path:
    """The raw rootfs image at the bottom of a layer chain.

    Raises:
        MachineFailed: a layer is missing or is not a gVisor layer (a QEMU qcow2 file).
    """
    seen = 0
    while True:
        if seen and (path.is_dir() or _not_json(path)):
            return path  # a base a collapse before the fix named as a layer
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise MachineFailed(
                f"{path} is not a disk layer of the gvisor engine ({exc.__class__.__name__})",
                hint="a machine keeps the engine it was created on; create it again on gvisor",
            ) from exc
        if not isinstance(data, dict) or data.get("kind") != LAYER_KIND:
            raise MachineFailed(f"{path} is not a disk layer of the gvisor engine",
                                hint="create the machine again on the gvisor engine")
        backing = Path(str(data["backing"]))
        if data.get("format") == "raw":
            return backing
        path = backing
        seen += 1
        if seen > 1000:
            raise InternalError(f"disk layer chain at {path} loops")


def _not_json(path: Path) -> bool:
    """Whether ``path`` is a file that does not start as a JSON object (a raw image)."""
    try:
        with open(path, "rb") as f:
            return f.read(1) != b"{"
    except OSError:
        return False  # missing: reading it says so


# ---------------------------------------------------------------- processes


def _proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (R, S, Z, ...), or None when it is gone."""
    try:
        return stat_state(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def stat_state(stat: str) -> str | None:
    """The state field of a ``/proc/PID/stat`` text; None for a text with none (a
    process being reaped can read as empty)."""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] if fields else None


def sandbox_matches(pid: int, vm_id: str) -> bool:
    """True when ``pid`` is the live runsc sandbox process of ``vm_id``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return (bool(argv) and argv[0].endswith(b"runsc-sandbox") and vm_id.encode() in argv
            and _proc_state(pid) not in (None, "Z", "X"))


async def _gone(pid: int, vm_id: str, timeout: float) -> None:
    """Wait (briefly) until a killed sandbox has exited."""
    deadline = time.monotonic() + timeout
    while sandbox_matches(pid, vm_id) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def _tasks_of(pids: list[int]) -> list[int]:
    """Every thread of ``pids`` and of their descendants (a sandbox's systrap stubs)."""
    seen: set[int] = set()
    tasks: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        tasks += tids
        for tid in tids:
            with contextlib.suppress(OSError, ValueError):
                todo += [int(c) for c in
                         Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return tasks


def _command_lines() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process whose command line can be read."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        yield int(proc.name), argv


def find_sandbox(vm_id: str, pidfile: Path) -> int | None:
    """The pid of ``vm_id``'s live sandbox: from its pid file, else (none written yet:
    runsc writes it once the sandbox is up; or a stale one) by its command line."""
    pid = _read_pid(pidfile)
    if pid is not None and sandbox_matches(pid, vm_id):
        return pid
    return next((p for p, _ in _command_lines() if sandbox_matches(p, vm_id)), None)


def gofer_of(bundle: Path) -> int | None:
    """The pid of the gofer process serving the sandbox started from ``bundle``."""
    want = f"--bundle={bundle}".encode()
    for pid, argv in _command_lines():
        if argv and argv[0].endswith(b"runsc-gofer") and want in argv:
            return pid
    return None


def set_priority(pids: list[int], nice: int) -> None:
    """Set the niceness of every thread of ``pids`` and their descendants (Linux
    applies a niceness per thread)."""
    for tid in _tasks_of(pids):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def _tail(path: Path, n: int = 400) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _error_head(text: str) -> str:
    """A runsc failure's own words: what it printed before a Go stack trace."""
    return text.split("\ngoroutine ", 1)[0].strip()


def checkpoint_refusal(text: str) -> tuple[str, str] | None:
    """Why ``runsc checkpoint`` refused a sandbox because of its guest's TCP state, and
    what to do (message, hint), or None when it failed for another reason.

    gVisor cannot save a TCP connection to outside the sandbox. Without
    ``--net-disconnect-ok`` it refuses the save for any connection in a connected
    state, TIME_WAIT included (60 s after every connection the guest closed first);
    with it (what this engine runs) the save resets those connections. runsc
    20240729 still fails on a connection whose handshake is under way (SYN sent, no
    answer yet): resetting it dereferences state a handshake has not set up (a nil
    pointer in ``resetConnectionLocked``, fixed upstream in gVisor pull request
    12567). The sandbox runs on; that one connection attempt does not complete (its
    segments stay queued: it times out in the guest)."""
    if "tcp.(*Endpoint).beforeSave" not in text:
        return None
    if "resetConnectionLocked" in text:
        return ("the machine cannot be checkpointed while one of its TCP connections is "
                "being opened (its SYN sent, no answer yet): gVisor 20240729 fails on "
                "such a connection; that connection attempt will time out in the guest",
                "retry once the guest's connection is established or given up")
    return ("the machine cannot be checkpointed while it has a TCP connection to outside "
            f"the sandbox: {_error_head(text)[-300:]}",
            "its sandbox was started without --net-disconnect-ok (by an older boxd): "
            "retry once its connections are closed, or hibernate and wake it")


class Runsc:
    """Runs ``runsc`` subcommands with the engine's global flags."""

    def __init__(self, binary: str, state_root: Path, log_dir: Path) -> None:
        self.binary = binary
        self.state_root = state_root
        self.log_dir = log_dir

    def argv(self, *args: str, log: Path | None = None, network: str = "none") -> list[str]:
        """runsc's command line; a sandbox with a network (``sandbox``) gets
        ``--net-disconnect-ok``: a checkpoint resets its TCP connections to outside
        the sandbox instead of failing (see `checkpoint_refusal`)."""
        return [
            self.binary, f"--root={self.state_root}", "--platform=systrap",
            f"--network={network}",
            *(["--net-disconnect-ok"] if network == "sandbox" else []),
            "--overlay2=root:memory", "--ignore-cgroups",
            f"--log={log or self.log_dir / 'runsc.log'}", *args,
        ]

    async def run(
        self, *args: str, what: str, log: Path | None = None, stdin: int | None = None,
        stdout: int | None = None, stderr: int | None = None, timeout: float = RUNSC_TIMEOUT,
        machine: str | None = None, netns: _net.Namespace | None = None,
        background: bool = False, preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        """Run one subcommand to completion; with ``background`` at the lowest CPU
        priority (and so the sandbox it starts, until `set_priority` raises it);
        ``preexec_fn`` runs in the child before exec (joining the sandbox's cgroup).

        Raises:
            MachineFailed: it failed or timed out; the message has runsc's own words.
            StateError: a checkpoint the guest's TCP state refused (`checkpoint_refusal`).
        """
        argv = self.argv(*args, log=log)
        if netns is not None:
            # Its own network namespace and runsc's user-space network stack (see _net).
            argv = [*netns.runsc_prefix(), *self.argv(*args, log=log, network="sandbox")]
        if background:
            argv = ["nice", "-n", str(BACKGROUND_NICE), *argv]
        errfile: Any = stderr if stderr is not None else asyncio.subprocess.PIPE
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=stdin if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=stdout if stdout is not None else asyncio.subprocess.DEVNULL,
            stderr=errfile, start_new_session=True, preexec_fn=preexec_fn,
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise MachineFailed(f"runsc {what} did not finish within {timeout:.0f}s",
                                hint="see the machine's runsc.log", machine=machine) from None
        except BaseException:
            # Cancelled (a daemon closing while a standby copy is restored): a runsc
            # left running would start its sandbox after the caller's clean-up, with
            # nobody to own it. End it, and let the caller clean up after it.
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            text = (err or b"").decode(errors="replace").strip()
            if not text and log is not None:
                text = _tail(log)
            if what == "checkpoint" and (refusal := checkpoint_refusal(text)):
                raise StateError(refusal[0], hint=refusal[1], machine=machine)
            raise MachineFailed(
                f"runsc {what} failed (exit {proc.returncode}): "
                f"{_error_head(text)[-400:] or 'no output'}",
                hint="see the machine's runsc.log; `boxd info` shows whether gvisor works here",
                machine=machine,
            )


# ----------------------------------------------------------------- machines


class GvisorMachine:
    """A live gVisor machine: its sandbox process, runsc id and agent FIFOs."""

    def __init__(
        self, engine: GvisorEngine, config: MachineConfig, files: RunFiles, pid: int,
        disk: Path, log_path: Path, netns: _net.Namespace | None = None,
        cgroup: VmCgroup | None = None,
    ) -> None:
        self.engine = engine
        self.netns = netns
        self.cgroup = cgroup
        self._oom: tuple[bool, int | None] | None = None  # kept once the cgroup is gone
        self._config = config
        self.files = files
        self._pid = pid
        self.disk = disk
        self.log_path = log_path
        self._agent: AgentClient | None = None
        self._read_transport: asyncio.ReadTransport | None = None
        self._agent_lock = asyncio.Lock()
        self._reason = ""
        # How a standby copy is kept at the lowest CPU priority until its first resume:
        # "cpu.idle" (its cgroup runs only on otherwise idle CPU) or "nice" (niceness
        # 19 on every thread, where there is no cgroup CPU controller to do it).
        self.standby: str | None = None
        # A paused sandbox is frozen (its cgroup's freezer) once it has stayed paused
        # for FREEZE_AFTER: a paused Sentry's Go runtime still wakes every millisecond
        # (3-6% of a core per sandbox here), which a node's standby copies and
        # suspended machines would otherwise burn. None: unknown (attached after a
        # daemon restart), so the next thaw writes regardless.
        self._frozen: bool | None = None
        self._freeze_timer: asyncio.TimerHandle | None = None
        # A standby copy held by its freezer alone (`hold`: frozen, or its freeze due):
        # not runsc-paused, so its claim is a thaw, not a ``runsc resume``.
        self._held = False
        # Guest TCP connections still being opened when it was last paused.
        self._opening = 0
        self._captured = False  # checkpointed since its last pause (see `resume`)

    @property
    def config(self) -> MachineConfig:
        return self._config

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def ram_shared(self) -> bool:
        # Every capture writes the sandbox's whole memory: there is no RAM file to own.
        return True

    @property
    def console_log(self) -> Path:
        return self.log_path.with_name("console.log")

    def alive(self) -> bool:
        # A destroyed sandbox is dead at once, though its process may take a moment to go.
        return self._reason != "destroyed" and sandbox_matches(self._pid, self._config.id)

    def exit_reason(self) -> str:
        if self.alive():
            return "running"
        if self._reason:
            return self._reason
        oom, limit = self.oom_verdict()
        if oom:
            return (f"its gVisor sandbox (pid {self._pid}) was killed by the kernel's OOM "
                    f"killer: it reached its memory limit"
                    + (f" of {limit >> 20} MiB" if limit else "")
                    + f" (twice the machine's memory_mib + {GVISOR_OVERHEAD_MIB} MiB; "
                    "docs/security.md)")
        tail = _tail(self.console_log, 300).splitlines()[-2:]
        last = f" (its console ends: {' | '.join(tail)})" if tail else ""
        return f"its gVisor sandbox (pid {self._pid}) exited{last}"

    def oom_verdict(self) -> tuple[bool, int | None]:
        """Whether the host's OOM killer killed a task of the sandbox, and its limit."""
        if self._oom is not None:
            return self._oom
        if self.cgroup is None:
            return False, None
        return self.cgroup.oom_killed(), self.cgroup.memory_limit

    async def wait_exit(self) -> str:
        try:
            pidfd = OwnedFd.pidfd(self._pid)
        except ProcessLookupError:
            return self.exit_reason()
        with pidfd:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()

            def exited() -> None:
                if not done.done():
                    done.set_result(None)

            loop.add_reader(pidfd.fd, exited)
            try:
                await done  # a pidfd becomes readable when its process exits (zombie or not)
            finally:
                loop.remove_reader(pidfd.fd)
        await self.release_cgroup()  # its gofer and stubs end with it
        return self.exit_reason()

    def _failed(self) -> MachineFailed:
        return MachineFailed(
            f"machine {self._config.id} failed: {self.exit_reason()}",
            hint="delete it and create it again", machine=self._config.id,
        )

    async def _open_channel(self, timeout: float) -> AgentClient:
        reader, writer, rt = await open_fifo_streams(self.files.stdout, self.files.stdin)
        self._read_transport = rt
        try:
            return await AgentClient.over(reader, writer, self.files.stdin, timeout=timeout)
        except BaseException:
            rt.close()
            writer.close()
            self._read_transport = None
            raise

    def _close_reader(self) -> None:
        if self._read_transport is not None:
            self._read_transport.close()
            self._read_transport = None

    async def agent(self, timeout: float = 60.0) -> AgentClient:
        """The agent connection, (re)opened when needed.

        Raises:
            MachineFailed: the sandbox is gone or its agent does not answer in time.
        """
        async with self._agent_lock:
            if self._agent is not None and self._agent.connected:
                return self._agent
            if not self.alive():
                raise self._failed()
            if self._agent is not None:
                with contextlib.suppress(Exception):
                    await self._agent.close()
                self._agent = None
            self._close_reader()
            try:
                self._agent = await connect_watched(self._open_channel(timeout), self.alive,
                                                    self._failed)
            except OSError as exc:
                raise MachineFailed(f"cannot open the agent channel of {self._config.id}: {exc}",
                                    machine=self._config.id) from exc
            return self._agent

    async def pause(self) -> None:
        """``runsc pause``; a machine with a network first lets the guest's TCP
        handshakes with the outside finish (`_settle_handshakes`): a capture follows
        most pauses, and gVisor cannot checkpoint a connection being opened."""
        self.thaw()
        self._opening = 0
        if self.netns is not None and self.standby is None:
            t0 = time.monotonic()
            self._opening = await self._settle_handshakes()
            log.debug("machine=%s event=handshakes_settled left=%d seconds=%.3f",
                      self._config.id, self._opening, time.monotonic() - t0)
        await self.engine.runsc.run("pause", self._config.id, what="pause",
                                    machine=self._config.id, log=self.log_path)
        if self.cgroup is not None:
            # Not at once: a pause for a capture is followed by the checkpoint within
            # milliseconds, and a freeze then would only cost a thaw.
            self._freeze_timer = asyncio.get_running_loop().call_later(
                FREEZE_AFTER, self._freeze)

    async def _settle_handshakes(self) -> int:
        """Wait up to SETTLE_HANDSHAKES for the guest's TCP connections in a handshake
        with the outside (SYN_SENT, SYN_RECV) to be established or given up; how many
        are left. Best effort, through the agent connection the machine has (none, or
        one that does not answer in time: 0, and a checkpoint that meets such a
        connection fails with the same StateError, `checkpoint_refusal`)."""
        agent = self._agent
        if agent is None or not agent.connected:
            return 0
        left = 0
        try:
            async with asyncio.timeout(SETTLE_HANDSHAKES + 1.0):
                deadline = time.monotonic() + SETTLE_HANDSHAKES
                while True:
                    tables = await asyncio.gather(*(agent.read_file(f"/proc/net/{name}")
                                                    for name in ("tcp", "tcp6")))
                    left = sum(_net.handshakes(t.decode(errors="replace")) for t in tables)
                    if left == 0 or time.monotonic() >= deadline:
                        return left
                    await asyncio.sleep(0.02)
        except (BoxdError, OSError, TimeoutError) as exc:
            log.debug("machine=%s event=handshakes_unknown error=%r", self._config.id, exc)
            return left

    async def hold(self) -> None:
        """Stop a standby copy until its claim. Where its cgroup has a freezer, the
        freezer alone stops it, HOLD_AFTER from now (once the Sentry's post-restore
        work is done), and the claim (`resume`) is a cgroup write, or only the
        cancelled freeze: no ``runsc pause`` now and no ``runsc resume`` on the fork's
        path, where the 8 claims of a rollout batch started 8 runsc processes at once
        (60-170 ms of wall time each here). Elsewhere, `pause`."""
        if self.cgroup is not None and self.cgroup.set_frozen(False):  # has a freezer
            self._frozen = False
            self._held = True
            self._freeze_timer = asyncio.get_running_loop().call_later(
                HOLD_AFTER, self._freeze)
            return
        await self.pause()

    def _freeze(self) -> None:
        self._freeze_timer = None
        if self.cgroup is not None and self.alive():
            self._frozen = self.cgroup.set_frozen(True)

    def thaw(self) -> None:
        """Let the sandbox's tasks run again before anything talks to its Sentry (a
        runsc command, a port forward, a kill): cancel a pending freeze, undo a done
        one. (The agent needs no thaw: a paused sandbox's agent does not answer
        anyway, and whoever resumes it thaws it.)"""
        self._held = False  # whatever stopped it, it runs once thawed
        if self._freeze_timer is not None:
            self._freeze_timer.cancel()
            self._freeze_timer = None
        if self._frozen is not False:
            cg = self.cgroup or self.engine.cgroups.of(self._config.id)
            if cg is not None:
                cg.set_frozen(False)
            self._frozen = False

    async def resume(self) -> None:
        held = self._held
        self.thaw()
        self._opening = 0  # unknown again until its next pause
        if self.standby == "cpu.idle" and self.cgroup is not None:
            # A claimed standby copy: from now on it runs at an equal CPU share.
            if not self.cgroup.set_idle(False):
                log.warning("machine=%s event=cpu_idle_not_cleared", self._config.id)
        elif self.standby == "nice":
            pids = [self._pid]
            gofer = await asyncio.to_thread(gofer_of, self.files.bundle)
            if gofer is not None:
                pids.append(gofer)
            await asyncio.to_thread(set_priority, pids, os.getpriority(os.PRIO_PROCESS, 0))
        self.standby = None
        if held:
            return  # only frozen (`hold`): the thaw was the resume
        await self.engine.runsc.run("resume", self._config.id, what="resume",
                                    machine=self._config.id, log=self.log_path)
        if self._captured:
            # Requests written to its stdin while it was paused are taken in by runsc
            # 20240729's ``checkpoint --leave-running`` (its restored copies answer them)
            # and boxd-init is left asleep on them: those execs waited for the next
            # request (the fork churn test, one run in a few). A ping wakes it now.
            self._captured = False
            if self._agent is not None:
                self._agent.nudge()

    async def recover(self) -> str | None:
        """Resume a sandbox a killed daemon left paused (runsc state ``paused``) or
        frozen."""
        self.thaw()
        proc = await asyncio.create_subprocess_exec(
            *self.engine.runsc.argv("state", self._config.id, log=self.log_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            stdin=asyncio.subprocess.DEVNULL,
        )
        out, _ = await proc.communicate()
        try:
            status = json.loads(out or b"{}").get("status")
        except ValueError:
            status = None
        if status == "paused":
            await self.resume()
            return "resumed a sandbox left paused"
        return None

    async def freeze_disk(self, new_active: Path) -> Path:
        """The layer bookkeeping only: the filesystem's bytes are in the sandbox's memory."""
        frozen = self.disk
        await asyncio.to_thread(write_layer, new_active, frozen, "layer")
        self.disk = new_active
        return frozen

    async def collapse_disk(self, base: Path) -> None:
        # The active layer sits on the chain's base (a guest root or an image's tree)
        # now: a base, "raw" (before, "layer": `layer_base` then read the guest root's
        # image as a layer, and a snapshot or cross-node fork of the machine failed).
        await asyncio.to_thread(write_layer, self.disk, base, "raw")

    async def capture(self, dest_dir: Path) -> MemoryImage:
        """Checkpoint the sandbox (its memory, kernel state and overlay files) to ``dest_dir``.

        The sandbox keeps running (``--leave-running``); the node pauses and resumes it
        around the call as for any engine.
        """
        self.thaw()
        if self._opening:
            # Refused before the checkpoint, which would fail and leave that
            # connection attempt stuck (`checkpoint_refusal`).
            raise StateError(
                f"machine {self._config.id} cannot be checkpointed now: its guest was "
                f"still opening {self._opening} TCP connection(s) after "
                f"{SETTLE_HANDSHAKES:.0f}s (SYN sent, no answer), which gVisor 20240729 "
                "cannot save", hint="retry once the guest's connection is established "
                "or given up", machine=self._config.id)
        dest_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self._captured = True  # `resume` wakes its agent (a failed checkpoint too)
        await self.engine.runsc.run(
            "checkpoint", "--leave-running", "--compression=none",
            f"--image-path={dest_dir}", self._config.id, what="checkpoint",
            machine=self._config.id, log=self.log_path,
        )
        roots = self.files.roots.read_bytes()
        await asyncio.to_thread(_pack_state, dest_dir, roots)
        mem = dest_dir / MEM
        mem.unlink(missing_ok=True)
        os.link(dest_dir / PAGES, mem)
        log.debug("machine=%s event=checkpoint seconds=%.3f", self._config.id,
                  time.monotonic() - t0)
        return MemoryImage(mem_path=mem, state_path=dest_dir / STATE_TAR,
                           memory_mib=self._config.memory_mib)

    async def destroy(self) -> None:
        """Kill the sandbox now; the rest is done in the background: waiting for it to
        exit (a sentry freeing ~100 MB takes a few hundred ms on a busy host), ending its
        namespace, removing its cgroup and run directory, deleting its runsc state.

        A sandbox started again under the same id (a restore in place, a wake from
        hibernation) waits for that teardown first (`GvisorEngine.settled`).
        """
        self.thaw()  # a frozen task cannot even die
        await self.detach()
        self._reason = "destroyed"
        self.engine.kill(self._config.id, self._pid, delete_state=False)
        if self.netns is not None:
            self.netns.signal_end()  # now: a daemon that dies meanwhile leaks nothing
        self.engine.teardown(self._config.id, self._finish_destroy())

    async def _finish_destroy(self) -> None:
        await _gone(self._pid, self._config.id, 5.0)
        await self.engine._delete(self._config.id)
        if self.netns is not None:
            await asyncio.to_thread(self.netns.kill)  # waits for pasta: not on the loop
        await self.release_cgroup()
        await asyncio.to_thread(shutil.rmtree, self.files.run_dir, ignore_errors=True)

    async def release_cgroup(self) -> None:
        """End what is left in the sandbox's cgroup (its gofer, stub processes) and
        remove it; the OOM verdict is kept for `exit_reason`."""
        cg, self.cgroup = self.cgroup, None
        if cg is None:
            return
        self._oom = (cg.oom_killed(), cg.memory_limit)
        _kill_all(cg)
        await self.engine.cgroups.release(cg)

    async def open_http(
        self, port: int = GUEST_HTTP_PORT
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A guest port, through a dialer process in the sandbox (`AgentClient.dial`).

        Not ``runsc port-forward``: in runsc 20240729 (the newest Debian ships) its
        copy loop reads the sandbox's socket 16 KiB at a time and the Sentry panics on
        any larger TCP segment ("io.Writer.Write succeeded with incomplete write",
        gVisor pull request 12521): one response over 16 KiB killed the machine.
        """
        if self.netns is None:
            raise OSError(f"machine {self._config.id} has no network (isolated)")
        self.thaw()
        return await dial_guest_port(self._config.id, self.agent(timeout=10.0), port,
                                     tree=AGENT_MOUNT)

    async def detach(self) -> None:
        if self._agent is not None:
            with contextlib.suppress(Exception):
                await self._agent.close()
            self._agent = None
        self._close_reader()


def _kill_all(cg: VmCgroup) -> None:
    """SIGKILL every process in a sandbox's cgroup (only that sandbox's are in it),
    thawing it first: a frozen task does not die until it is thawed."""
    cg.set_frozen(False)
    for pid in cg.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _pack_state(dest: Path, roots: bytes) -> None:
    """``state.tar``: checkpoint.img, pages_meta.img and the trees the sandbox used."""
    with tarfile.open(dest / STATE_TAR, "w") as tar:
        for name in (CHECKPOINT, PAGES_META):
            tar.add(dest / name, arcname=name)
        info = tarfile.TarInfo(ROOTS)
        info.size = len(roots)
        tar.addfile(info, io.BytesIO(roots))


def _agent_tree(agent_dir: Path, name: str, whose: str) -> Path:
    """This node's agent tree named ``name`` (an agent tree is named by the digest of
    its files) in ``agent_dir``.

    Raises:
        HostSetupError: there is none (``whose`` another boxd version, as the message
            says).
    """
    agent = agent_dir / name
    if not agent.is_dir():
        raise HostSetupError(f"this node has no agent tree {name} ({whose} another boxd "
                             "version)", hint="run the same boxd version on every node")
    return agent


def unpack_received(image: MemoryImage, ours: Roots, agent_dir: Path) -> None:
    """Give a capture copied from another node (its ``mem`` and ``state`` files) the
    layout `capture` writes (checkpoint.img, pages_meta.img and pages.img beside them),
    its state naming this node's trees: ``ours`` (root and, for a container image's
    machine, runtime), and the agent tree in ``agent_dir`` with the name of the one it
    was captured on (an agent tree is named by the digest of its files).

    Raises:
        MachineFailed: ``state`` is not a gvisor capture's.
        HostSetupError: this node has no agent tree of that content.
    """
    dest = image.state_path.parent
    if image.mem_path is None:
        raise MachineFailed("this memory image has no pages file: it was not made by the "
                            "gvisor engine", hint="fork it on its own node")
    try:
        with tarfile.open(image.state_path) as tar:
            for name in (CHECKPOINT, PAGES_META):
                tar.extract(name, dest, filter="data")
            member = tar.extractfile(ROOTS)
            assert member is not None
            theirs = Roots.from_json(json.loads(member.read()))
    except (OSError, tarfile.TarError, KeyError, ValueError) as exc:
        raise MachineFailed(f"{image.state_path} is not a gvisor capture ({exc})",
                            hint="fork it on its own node") from exc
    agent = _agent_tree(agent_dir, theirs.agent.name, "the fork's source runs")
    pages = dest / PAGES
    pages.unlink(missing_ok=True)
    os.link(image.mem_path, pages)
    _pack_state(dest, json.dumps(Roots(ours.rootfs, agent, ours.runtime).to_json()).encode())


def _image_dir(image: MemoryImage, files: RunFiles,
               roots_here: Callable[[], Roots]) -> tuple[Path, Roots]:
    """A directory runsc can restore from, and the host trees the sandbox needs.

    A capture of this engine is used in place (a template, a checkpoint); a snapshot's
    blobs (content-addressed files) are reassembled under the run directory, to run on
    ``roots_here()`` (this node's trees under the machine's disk).

    Raises:
        MachineFailed: the files are not a gvisor capture's.
        HostSetupError: this node has no agent tree of the content it was saved with.
    """
    if image.mem_path is None:
        raise MachineFailed("this memory image has no pages file: it was not made by the "
                            "gvisor engine", hint="start it on the engine that saved it")
    src = image.state_path.parent
    if ((src / CHECKPOINT).exists() and (src / PAGES_META).exists()
            and (src / PAGES).exists() and image.mem_path.exists()
            and os.path.samefile(image.mem_path, src / PAGES)):
        with tarfile.open(image.state_path) as tar:
            member = tar.extractfile(ROOTS)
            assert member is not None
            roots = Roots.from_json(json.loads(member.read()))
        return src, roots
    out = files.image
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        with tarfile.open(image.state_path) as tar:
            tar.extractall(out, filter="data")
    except (OSError, tarfile.TarError) as exc:
        raise MachineFailed(f"{image.state_path} is not a gvisor checkpoint ({exc})",
                            hint="start it on the engine that saved it") from exc
    (out / PAGES).symlink_to(image.mem_path)
    theirs = Roots.from_json(json.loads((out / ROOTS).read_text()))
    ours = roots_here()
    # The trees of the node that saved it are named by path: this node's of the same
    # content stand in (its root tree under the disk's chain, its agent tree by name,
    # the guest root it ran its agent from where this host has it, else this node's).
    agent = _agent_tree(ours.agent.parent, theirs.agent.name, "the snapshot was saved by")
    runtime = theirs.runtime if theirs.runtime is not None and theirs.runtime.is_dir() \
        else ours.runtime
    return out, Roots(ours.rootfs, agent, runtime)


# ------------------------------------------------------------------- engine


#: The mode of runsc's ``--root`` (``<shm>/gvisor``): no listing by other users.
STATE_ROOT_MODE = 0o711


class GvisorEngine:
    """Runs machines as gVisor sandboxes (``runsc --platform=systrap``)."""

    name = "gvisor"

    def __init__(
        self, runsc: str, version: str, state_root: Path, agent_tree: Path, reason: str,
        fallback_rootfs: Path, net_user: str = "boxd-net", cgroups: Cgroups | None = None,
        image_roots: Path | None = None,
    ) -> None:
        self.binary = runsc
        # Where this node unpacks container images (`chains/<chain id>`): a layer naming
        # another node's tree of a chain runs on this node's (a snapshot started here).
        self.image_trees = image_roots
        self.cgroups = cgroups or Cgroups.off("not set up")
        self.version = version
        state_root.mkdir(parents=True, exist_ok=True)
        # runsc's state files are named after the machines: other users may pass
        # through (by a known name) but not list them
        state_root.chmod(STATE_ROOT_MODE)
        # The log of runsc commands that name no machine's own: made here, the daemon's
        # alone, before runsc appends to it (runsc would make it 0644 in a folder others
        # pass through: test_file_access found it readable by another local user).
        os.close(os.open(state_root / "runsc.log",
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600))
        (state_root / "runsc.log").chmod(0o600)
        self.runsc = Runsc(runsc, state_root, state_root)
        self.agent_tree = agent_tree
        self.reason = reason
        self.fallback_rootfs = fallback_rootfs
        self._deletes: set[asyncio.Task[None]] = set()
        self._teardowns: dict[str, asyncio.Task[None]] = {}
        self._net_user = net_user
        self._net: _net.GvisorNet | None = None

    @property
    def net(self) -> _net.GvisorNet:
        """pasta and its filter, set up by the first machine that has a network.

        Raises:
            HostSetupError: pasta, nft or pasta's user are missing (isolated machines
                need none of them).
        """
        if self._net is None:
            self._net = _net.GvisorNet.detect(self._net_user)
            log.info("event=machine_network engine=gvisor pasta=%s user=%s filtered=%s",
                     self._net.pasta, self._net.user.name if self._net.user else "-",
                     self._net.filtered)
        return self._net

    @property
    def accelerator(self) -> str:
        return "systrap"

    @property
    def accelerator_reason(self) -> str:
        return self.reason

    @property
    def cpu_model(self) -> str:
        return "host"

    @property
    def file_owner(self) -> tuple[int, int] | None:
        return None

    def info(self) -> EngineInfo:
        return EngineInfo(
            name=self.name, binary=self.binary, version=self.version,
            accelerator=self.accelerator, accelerator_reason=self.reason,
            cpu_model=self.cpu_model,
            limits=self.cgroups.summary(
                memory=f"twice memory_mib + {GVISOR_OVERHEAD_MIB} MiB", pids=GVISOR_PIDS_MAX),
        )

    # -------------------------------------------------------------- helpers

    def _roots(self, disk: Path) -> Roots:
        base = layer_base(disk)
        if not base.exists() and self.image_trees is not None and base.parent.name == CHAINS:
            # Another node's tree of an image's layer chain (a snapshot saved there):
            # a chain is named by its layers' digests, so this node's is the same tree.
            ours = self.image_trees / CHAINS / base.name
            if not ours.is_dir():  # not the guest root: running that instead would lie
                raise HostSetupError(
                    f"this node has no tree of the container image this machine runs "
                    f"(layer chain {base.name[:12]})",
                    hint="import the image here (`boxd image import`), then start it again")
            base = ours
        if base.is_dir():
            # A container image's unpacked tree (`image_roots`): the agent runs on the
            # guest root's Python, mounted beside it.
            return Roots(base, self.agent_tree, rootfs_tree(self.fallback_rootfs))
        if not base.exists():
            log.warning("event=gvisor_base_missing base=%s using=%s", base, self.fallback_rootfs)
            base = self.fallback_rootfs
        return Roots(rootfs_tree(base), self.agent_tree)

    def kill(self, vm_id: str, pid: int | None, *, delete_state: bool = True) -> None:
        """SIGKILL a sandbox now and (``delete_state``) delete its runsc state in the
        background."""
        if pid is not None and sandbox_matches(pid, vm_id):
            cg = self.cgroups.of(vm_id)
            if cg is not None:
                cg.set_frozen(False)  # a frozen task does not die until it is thawed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not delete_state:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (recovery from a thread): the next sweep deletes it
        task = loop.create_task(self._delete(vm_id), name=f"runsc delete {vm_id}")
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    def teardown(self, vm_id: str, work: Coroutine[Any, Any, None]) -> None:
        """Run the end of a destroyed sandbox's teardown in the background (`drain`
        waits for it; a new sandbox under ``vm_id`` waits for it in `settled`)."""
        task = asyncio.get_running_loop().create_task(work, name=f"teardown {vm_id}")
        self._teardowns[vm_id] = task
        self._deletes.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._deletes.discard(t)
            if self._teardowns.get(vm_id) is t:
                del self._teardowns[vm_id]
            if not t.cancelled() and t.exception() is not None:
                log.warning("machine=%s event=teardown_failed error=%r", vm_id, t.exception())

        task.add_done_callback(done)

    async def settled(self, vm_id: str) -> None:
        """Wait until no teardown of a previous sandbox named ``vm_id`` is running (its
        cgroup, namespace and run directory have the same names as the next one's)."""
        task = self._teardowns.get(vm_id)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def _delete(self, vm_id: str) -> None:
        try:
            await self.runsc.run("delete", "-force", vm_id, what="delete", timeout=30)
        except MachineFailed as exc:
            if "does not exist" not in exc.message and "not found" not in exc.message:
                log.warning("machine=%s event=runsc_delete_failed error=%s", vm_id, exc.message)

    def sweep(self) -> list[str]:
        """Delete the runsc state of sandboxes that no longer run (a daemon that stopped
        before its background deletes finished). Returns their ids."""
        live: set[bytes] = set()
        for pid, argv in _command_lines():
            if argv and argv[0].endswith(b"runsc-sandbox") and _proc_state(pid) \
                    not in (None, "Z", "X"):
                live.update(argv)
        gone = []
        for state in self.runsc.state_root.glob("*_sandbox:*.state"):
            vm_id = state.name.split("_sandbox:", 1)[0]
            if vm_id.encode() in live:
                continue
            subprocess.run(self.runsc.argv("delete", "-force", vm_id),
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                           check=False)
            self._release_now(vm_id)
            gone.append(vm_id)
        return gone

    def _release_now(self, vm_id: str) -> None:
        """Remove a dead sandbox's cgroup (after killing what is left in it)."""
        cg = self.cgroups.of(vm_id)
        if cg is not None:
            _kill_all(cg)
            self.cgroups.release_now(cg)

    async def drain(self) -> None:
        """Wait for background deletes (tests, shutdown)."""
        while self._deletes:
            await asyncio.gather(*list(self._deletes), return_exceptions=True)

    async def _launch(
        self, config: MachineConfig, disk: Path, run_dir: Path, log_path: Path,
        args: Sequence[str], roots: Roots, what: str, background: bool = False,
    ) -> GvisorMachine:
        run_dir.mkdir(parents=True, exist_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        files = RunFiles(run_dir)
        netns = None
        if not config.isolated:
            netns = await start_net(self.net, run_dir, config)
        try:
            await asyncio.to_thread(_spec.write_bundle, files, config.hostname, roots,
                                    config.memory_mib, netns.path if netns else None)
            return await self._launch_in(config, disk, files, log_path, args, what, netns,
                                         background)
        except BaseException:
            if netns is not None:
                netns.kill()
            raise

    async def _launch_in(
        self, config: MachineConfig, disk: Path, files: RunFiles, log_path: Path,
        args: Sequence[str], what: str, netns: _net.Namespace | None,
        background: bool = False,
    ) -> GvisorMachine:
        files.make_fifos()
        files.pidfile.unlink(missing_ok=True)
        # Stale runsc state of a previous sandbox with this id (a crashed daemon).
        if (self.runsc.state_root / f"{config.id}_sandbox:{config.id}.state").exists():
            await self._delete(config.id)
        stdio = _open_stdio(files, log_path)  # runsc's: it gets copies, ours close after
        fin, fout, console = (f.fd for f in stdio)
        # runsc joins the cgroup before exec; the sandbox and gofer it starts inherit it.
        cgroup = self.cgroups.create(
            config.id, Limits(sandbox_memory_limit(config.memory_mib), pids=GVISOR_PIDS_MAX))
        standby = None
        if background:
            # A per-sandbox cgroup competes with the others as one: niceness inside it
            # would only rank its own threads. cpu.idle ranks the whole sandbox.
            standby = "cpu.idle" if cgroup is not None and cgroup.set_idle(True) else "nice"
        try:
            await self.runsc.run(
                *args, "--detach", f"--bundle={files.bundle}", f"--pid-file={files.pidfile}",
                config.id, what=what, log=log_path, stdin=fin, stdout=fout, stderr=console,
                machine=config.id, netns=netns, background=standby == "nice",
                preexec_fn=cgroup.join() if cgroup is not None else None,
            )
            pid = _read_pid(files.pidfile)
            if pid is None:
                raise MachineFailed(f"runsc {what} of {config.id} wrote no pid file",
                                    hint="see the machine's runsc.log", machine=config.id)
        except BaseException:
            self.kill(config.id, find_sandbox(config.id, files.pidfile))
            if cgroup is not None:
                _kill_all(cgroup)
                await self.cgroups.release(cgroup)
            raise
        finally:
            for f in stdio:
                f.close()
        if cgroup is not None and not cgroup.contains(pid):
            log.warning("machine=%s event=cgroup_not_joined pid=%s", config.id, pid)
        machine = GvisorMachine(self, config, files, pid, disk, log_path, netns, cgroup)
        machine.standby = standby
        return machine

    # ------------------------------------------------------------- protocol

    async def boot(
        self, config: MachineConfig, disk: BootDisk, run_dir: Path, log_path: Path
    ) -> GvisorMachine:
        """Start a fresh sandbox on the image's root tree; its agent answers in ~0.2 s."""
        await self.settled(config.id)
        roots = await asyncio.to_thread(self._roots, disk.path)
        return await self._launch(config, disk.path, run_dir, log_path, ["run"], roots, "run")

    async def start_from(
        self, config: MachineConfig, disk: BootDisk, image: MemoryImage, run_dir: Path,
        log_path: Path, *, copy_memory: bool, paused: bool = False,
    ) -> GvisorMachine:
        """Restore a sandbox from a checkpoint (``copy_memory`` changes nothing here: a
        restored sandbox always owns its memory). With ``paused`` (a standby copy) the
        restore runs at the lowest CPU priority and the sandbox is held once its agent
        answers (`GvisorMachine.hold`: frozen HOLD_AFTER later, after the Sentry's
        post-restore work; a claim before then cancels the freeze); its first `resume`
        gives it an equal CPU share."""
        files = RunFiles(run_dir)
        await self.settled(config.id)  # before anything is written to its run directory
        run_dir.mkdir(parents=True, exist_ok=True)
        src, roots = await asyncio.to_thread(_image_dir, image, files,
                                             lambda: self._roots(disk.path))
        machine = await self._launch(config, disk.path, run_dir, log_path,
                                     ["restore", f"--image-path={src}"], roots, "restore",
                                     background=paused)
        if paused:
            try:
                # Its agent channel is opened now, off the claim's path: a claim resumes
                # it and sends the identity straight away.
                await machine.agent(timeout=RUNSC_TIMEOUT)
                await machine.hold()
            except BaseException:
                await machine.destroy()
                raise
        return machine

    def attach(
        self, config: MachineConfig, run_dir: Path, pid: int, disk: Path, ram_shared: bool,
        log_path: Path,
    ) -> GvisorMachine:
        if not sandbox_matches(pid, config.id):
            raise MachineFailed(
                f"machine {config.id} failed: its gVisor sandbox (pid {pid}) is gone",
                hint="delete it and create it again", machine=config.id,
            )
        return GvisorMachine(self, config, RunFiles(run_dir), pid, disk, log_path,
                             _net.load(run_dir), self.cgroups.of(config.id))

    def kill_stray(self, vm_id: str, run_dir: Path, pid: int | None = None) -> bool:
        """SIGKILL the sandbox of ``vm_id`` if it still runs, end its namespace and
        remove its cgroup (killing whatever else is in it). ``runsc`` writes the pid
        file only once the sandbox is up: without one, or with a stale one, the sandbox
        is found by its command line (which names the VM), as with cgroups off nothing
        else would find a sandbox started just before the daemon died. So is it when
        ``pid`` (the record's) is no longer the sandbox's (a restore or wake started a
        new one and the daemon died before recording it)."""
        if pid is None or not sandbox_matches(pid, vm_id):
            pid = find_sandbox(vm_id, RunFiles(run_dir).pidfile)
        netns = _net.load(run_dir)
        if netns is not None:
            netns.kill()
        if pid is None or not sandbox_matches(pid, vm_id):
            self._release_now(vm_id)
            return False
        self.kill(vm_id, pid)
        self._release_now(vm_id)
        return True

    async def create_disk(
        self, path: Path, backing: Path, backing_format: str, size_gib: int
    ) -> None:
        fmt = "raw" if backing_format == "raw" else "layer"
        await asyncio.to_thread(write_layer, path, backing, fmt)

    async def flatten_disk(self, layer: Path, dest: Path) -> None:
        base = await asyncio.to_thread(layer_base, layer)
        await asyncio.to_thread(write_layer, dest, base, "raw")

    def remove_disk(self, path: Path) -> None:
        for p in (path, path.with_name(path.name + ".tmp")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    # ------------------------------------------------- templates between nodes

    @property
    def image_roots(self) -> bool:
        # The root is a host directory anyway; the guest root's Python comes along.
        return True

    @property
    def portable_templates(self) -> bool:
        # A capture is files (pages, a tar of the rest) and a layer is a JSON file: a
        # node with the same runsc and guest image restores it (and the same CPU
        # features: runsc refuses a restore on a CPU that lacks one the image used).
        return True

    @property
    def portable_image_templates(self) -> bool:
        # The image's root is its unpacked tree (the same files on every node, from
        # the same digest) under an in-memory overlay: the layer JSON names this node's.
        return True

    async def retarget_disk(self, path: Path, backing: Path, backing_format: str) -> None:
        fmt = "raw" if backing_format == "raw" else "layer"
        await asyncio.to_thread(write_layer, path, backing, fmt)

    async def receive_image(self, image: MemoryImage, disk: Path) -> MemoryImage:
        """Lay a capture copied from another node out as `capture` does here, naming
        this node's root tree (under ``disk``'s chain) and its agent tree of the same
        content, so its restores use it in place (`_image_dir`)."""
        roots = await asyncio.to_thread(self._roots, disk)
        await asyncio.to_thread(unpack_received, image, roots, self.agent_tree.parent)
        return image

    def root_files(self, layer: Path, image: MemoryImage) -> tuple[RootFile, ...]:
        return ()  # a layer names a tree every node unpacks alike (the image's digest)

    async def receive_root(self, files: Sequence[tuple[str, Fetcher]],
                           into: Path) -> Path | None:
        if files:
            raise InvalidRequest("the gvisor engine boots an image on its tree: it "
                                 "takes no root files from another node", field="roots")
        return None


async def start_net(net: _net.GvisorNet, run_dir: Path,
                    config: MachineConfig) -> _net.Namespace:
    """The machine's network namespace (`_net.start`, in a thread). A launch cancelled
    meanwhile (a standby copy whose template went stale, a daemon stopping) cannot stop
    that thread: the namespace it makes is ended when it is done, or its pasta and
    holder would outlive everything (nothing records them once the launch is gone)."""
    job = asyncio.ensure_future(asyncio.to_thread(_net.start, net, run_dir, config.id,
                                                  config.net))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        job.add_done_callback(_end_unclaimed)
        raise


def _end_unclaimed(job: asyncio.Future[_net.Namespace]) -> None:
    if not job.cancelled() and job.exception() is None:
        job.result().signal_end()


def _open_stdio(files: RunFiles, log_path: Path) -> tuple[OwnedFd, OwnedFd, OwnedFd]:
    """The sandbox's stdin and stdout (its agent FIFOs) and its console log, for runsc."""
    with contextlib.ExitStack() as opened:
        fin = opened.enter_context(OwnedFd.open(files.stdin, os.O_RDWR))
        fout = opened.enter_context(OwnedFd.open(files.stdout, os.O_RDWR))
        console = opened.enter_context(OwnedFd.open(
            log_path.with_name("console.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640))
        opened.pop_all()
    return fin, fout, console


async def open_fifo_streams(
    stdout: Path, stdin: Path,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.ReadTransport]:
    """Streams over a sandbox's agent FIFOs: a reader of its ``stdout``, a writer to its
    ``stdin``, and the read transport (the writer closes its own).

    Each FIFO end is owned by exactly one object at every step: an `OwnedFd` until the
    loop's transport takes it (`pipe_file`), then the transport, which closes it once.
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=P.MAX_LINE)
    # The sandbox holds both FIFOs read-write: these opens never block or fail for want
    # of a peer.
    with OwnedFd.open(stdout, os.O_RDONLY | os.O_NONBLOCK) as rfd, \
            OwnedFd.open(stdin, os.O_WRONLY | os.O_NONBLOCK) as wfd:
        rt, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe_file(loop, rfd, "rb"))
        try:
            wt, wp = await loop.connect_write_pipe(
                lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()),
                pipe_file(loop, wfd, "wb"))
        except BaseException:
            rt.close()
            raise
    return reader, asyncio.StreamWriter(wt, wp, None, loop), rt


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
