"""boxd guest agent: runs as PID 1 inside every machine and serves the host over virtio-serial.

Stdlib only, one file (plus ``protocol.py`` next to it), Python 3.11. The wire protocol is
documented in ``docs/agent-protocol.md``. Design points:

* The channel outlives host connections: EOF/POLLHUP means "the host went away", so the agent
  waits ~20 ms and retries; it never exits. A VM fork or restore looks like a reconnect.
* Every request carries an id; every reply echoes it. A ``hello`` carries the host
  connection's nonce; output of requests that arrived on an older connection is dropped.
* Writes never block forever: while the host is away, output is dropped.
* As PID 1 it reaps every zombie. One reaper thread owns ``waitpid(-1)`` and hands statuses
  to the exec that owns the pid (remembering statuses that arrive before registration).

For host tests: ``--connect PATH`` uses a unix socket (as a client, reconnecting on EOF)
instead of the virtio port; the agent then marks itself child subreaper so orphaned
grandchildren are still reparented to it and reaped.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import errno
import fcntl
import glob
import grp
import hashlib
import json
import os
import pwd
import queue
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

try:
    from boxd.guest import protocol as P
except ImportError:  # inside the guest: protocol.py sits next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import protocol as P  # type: ignore[no-redef]

RETRY_SLEEP = 0.02
WRITE_STALL_LIMIT = 30.0  # seconds a connected but non-reading host may stall one message
EXIT_DRAIN_IDLE = 0.25  # after the command exits, stop reading its pipes after this much quiet
EXIT_DRAIN_MAX = 2.0  # ... or after this long (background children may hold the pipes)
UNCLAIMED_TTL = 120.0
RELAY_MOVE_WAIT = 10.0  # seconds a relayed stream waits for its relay to come back
IDLE_WAIT = 60.0  # seconds an idle loop sleeps between checks (it is woken for real work)
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
PR_SET_CHILD_SUBREAPER = 36


def drain_over(now: float, last_data: float, exited_at: float) -> bool:
    """After a command exited, whether to stop reading its pipes (background children that
    still hold them are not waited for). The quiet counts from the exit, never from before
    it: what the command wrote just before exiting may not have been read yet, and a silence
    before the exit is no reason to stop."""
    return now - max(last_data, exited_at) > EXIT_DRAIN_IDLE or now - exited_at > EXIT_DRAIN_MAX


def log(msg: str) -> None:
    try:
        sys.stderr.write(f"boxd-agent[{os.getpid()}] {time.strftime('%H:%M:%S')} {msg}\n")
        sys.stderr.flush()
    except Exception:
        pass


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64d(text: Any) -> bytes:
    if not text:
        return b""
    return base64.b64decode(text, validate=False)


class RequestError(Exception):
    """An error to report to the host as ``{"ev": "error", "code": ...}``."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra


def os_error(exc: OSError, path: str | None = None) -> RequestError:
    code = errno.errorcode.get(exc.errno or 0, "EIO")
    where = path if path is not None else exc.filename
    text = f"{exc.strerror or exc}: {where}" if where else str(exc.strerror or exc)
    return RequestError(code, text, path=where)


# --------------------------------------------------------------------------- channels


class Channel:
    """A byte pipe to the host that survives host reconnects.

    ``read()`` blocks until bytes arrive and returns them, or returns ``b""`` once each time
    the host goes away (the caller then drops any partial line). ``write()`` sends one whole
    message or drops it; it never blocks forever.
    """

    def __init__(self) -> None:
        self.fd = -1
        self.out_fd = -1  # where writes go when not ``fd`` (StdioChannel)
        self.lock = threading.Lock()
        self.broken_line = False  # a message was cut mid-way: start the next on a new line
        self.host_present = False

    def open(self) -> None:
        raise NotImplementedError

    def on_eof(self) -> None:
        """The host went away (EOF or POLLHUP)."""
        time.sleep(RETRY_SLEEP)

    def read(self) -> bytes:
        while True:
            fd = self.fd
            if fd < 0:
                self.open()
                continue
            try:
                p = select.poll()
                p.register(fd, select.POLLIN)
                events = p.poll(int(IDLE_WAIT * 1000))
            except (OSError, ValueError):
                self.on_eof()
                continue
            if not events:
                continue
            revents = events[0][1]
            if revents & select.POLLIN:
                try:
                    data = os.read(fd, 1 << 20)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    log(f"channel read error: {exc}")
                    data = b""
                if data:
                    self.host_present = True
                    return data
            was_present = self.host_present
            self.host_present = False
            self.on_eof()
            if was_present:
                return b""

    def write(self, data: bytes) -> bool:
        with self.lock:
            if self.broken_line:
                data = b"\n" + data
            fd = self.out_fd if self.out_fd >= 0 else self.fd
            if fd < 0:
                return False
            view = memoryview(data)
            stalled_since: float | None = None
            while view:
                try:
                    n = os.write(fd, view)
                    view = view[n:]
                    stalled_since = None
                    continue
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as exc:
                    # ENOTCONN/EPIPE/ENODEV...: the host is gone; drop the message.
                    if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                        log(f"channel write error: {exc}")
                    self.broken_line = len(view) != len(data)
                    return False
                now = time.monotonic()
                stalled_since = stalled_since or now
                try:
                    p = select.poll()
                    p.register(fd, select.POLLOUT)
                    events = p.poll(100)
                except (OSError, ValueError):
                    events = [(fd, select.POLLHUP)]
                revents = events[0][1] if events else 0
                if (revents & (select.POLLHUP | select.POLLERR | select.POLLNVAL)) and not (
                    revents & select.POLLOUT
                ):
                    self.broken_line = len(view) != len(data)
                    return False
                if now - stalled_since > WRITE_STALL_LIMIT:
                    log("host stopped reading; dropping a message")
                    self.broken_line = True
                    return False
            self.broken_line = False
            return True


class VirtioChannel(Channel):
    """The virtio-serial port named ``boxd.agent``, found through sysfs (no udev here)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.warned = False

    def find(self) -> str | None:
        for name_file in sorted(glob.glob("/sys/class/virtio-ports/*/name")):
            try:
                with open(name_file) as f:
                    if f.read().strip() != self.name:
                        continue
            except OSError:
                continue
            port_dir = os.path.dirname(name_file)
            dev = "/dev/" + os.path.basename(port_dir)
            if not os.path.exists(dev):
                # No devtmpfs entry: make the node from sysfs' major:minor.
                try:
                    with open(os.path.join(port_dir, "dev")) as f:
                        major, minor = (int(x) for x in f.read().strip().split(":"))
                    os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
                except OSError as exc:
                    log(f"cannot create {dev}: {exc}")
                    return None
            return dev
        return None

    def open(self) -> None:
        dev = self.find()
        if dev is None:
            if not self.warned:
                log(f"virtio port {self.name!r} not found yet; retrying")
                self.warned = True
            time.sleep(0.1)
            return
        try:
            fd = os.open(dev, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log(f"cannot open {dev}: {exc}")
            time.sleep(0.5)
            return
        log(f"serving on {dev}")
        with self.lock:
            self.fd = fd


class SocketChannel(Channel):
    """A unix socket we connect to (host tests), reconnecting whenever it closes."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.sock: socket.socket | None = None

    def open(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            time.sleep(RETRY_SLEEP)
            return
        sock.setblocking(False)
        with self.lock:
            self.sock = sock
            self.fd = sock.fileno()
            self.broken_line = False

    def on_eof(self) -> None:
        with self.lock:
            if self.sock is not None:
                self.sock.close()
            self.sock = None
            self.fd = -1
        time.sleep(RETRY_SLEEP)


class RelayChannel(Channel):
    """The socketpair to boxd-init (init.c), which owns the host connection.

    boxd-init answers hello, ping, identity, sync and exec without stdin itself and
    relays every other line here; a hello with a new nonce (request id -1, its reply
    dropped by boxd-init) tells this agent that the host connection changed.
    """

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.relay_fd = fd

    def open(self) -> None:
        os.set_blocking(self.relay_fd, False)
        with self.lock:
            self.fd = self.relay_fd

    def on_eof(self) -> None:
        log("boxd-init closed the relay; exiting")
        os._exit(1)


class StdioChannel(Channel):
    """stdin/stdout (gVisor: the sandbox's stdio are two host FIFOs, which ``runsc restore``
    hands to each restored copy). The host opens them O_RDWR for the sandbox, so they never
    report EOF: a host reconnect is only visible as a hello with a new nonce."""

    def open(self) -> None:
        for fd in (0, 1):
            os.set_blocking(fd, False)
        with self.lock:
            self.fd, self.out_fd = 0, 1


# --------------------------------------------------------------------------- reaping


class Reaper:
    """Owns every ``waitpid``: reaps all children (and, as PID 1, all orphans)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiters: dict[int, tuple[threading.Event, list[int]]] = {}
        self.unclaimed: dict[int, tuple[int, float]] = {}  # pid -> (status, monotonic time)
        self.wake = threading.Event()
        threading.Thread(target=self.run, name="reaper", daemon=True).start()

    def run(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                # No children: sleep until register() announces one. (The timeout is
                # only a safety net; a busy wake-up here would be guest code that every
                # fork child must translate again under TCG, and idle CPU for nothing.)
                self.wake.wait(IDLE_WAIT)
                self.wake.clear()
                continue
            except Exception as exc:
                log(f"reaper: {exc}")
                time.sleep(0.1)
                continue
            if pid <= 0:
                continue
            now = time.monotonic()
            with self.lock:
                waiter = self.waiters.pop(pid, None)
                if waiter is not None:
                    waiter[1].append(status)
                    waiter[0].set()
                else:
                    self.unclaimed[pid] = (status, now)
                    if len(self.unclaimed) > 256:
                        for old in [
                            p for p, (_, t) in self.unclaimed.items() if now - t > UNCLAIMED_TTL
                        ]:
                            del self.unclaimed[old]

    def register(self, pid: int, spawned_at: float) -> tuple[threading.Event, list[int]]:
        """Claim ``pid``'s exit status; ``spawned_at`` is ``time.monotonic()`` before spawning."""
        event, box = threading.Event(), []
        with self.lock:
            early = self.unclaimed.pop(pid, None)
            if early is not None and early[1] >= spawned_at:
                box.append(early[0])
                event.set()
            else:
                self.waiters[pid] = (event, box)
        self.wake.set()
        return event, box


# --------------------------------------------------------------------------- the host link


class HostLink:
    """The host connection as the request handlers see it: which one is current (the nonce
    of its ``hello``; None while the host is away) and the events sent on it.

    A request remembers the connection it arrived on; its output is dropped once that is no
    longer the current one (a fork child, a restore, a reconnect).
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.conn: str | None = None  # nonce of the current host connection

    def send(self, msg: dict[str, Any], conn: str | None = None, *, check: bool = True) -> bool:
        """Send one message; drop it if the request's connection is gone (``check``)."""
        if check and conn != self.conn:
            return False
        try:
            line = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
        except (TypeError, ValueError) as exc:
            log(f"cannot encode reply: {exc}")
            return False
        return self.channel.write(line)

    def reply(self, req_id: Any, conn: str | None, **fields: Any) -> None:
        self.send({"id": req_id, "ev": P.EV_RESULT, **fields}, conn)

    def fail(self, req_id: Any, conn: str | None, err: RequestError) -> None:
        msg = {"id": req_id, "ev": P.EV_ERROR, "code": err.code, "message": err.message}
        msg.update({k: v for k, v in err.extra.items() if v is not None})
        self.send(msg, conn)


#: A request handler: ``(request id, its connection, the request)``. It answers through the
#: `HostLink` (now or from a thread of its own); a `RequestError` or OSError it raises is
#: answered as an error event.
Handler = Callable[[int, str | None, dict[str, Any]], None]


def spawn_thread(name: str, fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` in a daemon thread that logs, instead of losing, what it raises."""

    def run() -> None:
        try:
            fn(*args)
        except Exception:
            log(f"{name} thread crashed:\n{traceback.format_exc()}")

    threading.Thread(target=run, name=name, daemon=True).start()


class Window:
    """Flow control of one streamed reply (1.3): at most ``size`` bytes sent and not yet
    acknowledged by the host (``size`` 0: no limit, the host did not ask for it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.sent = 0
        self.acked = 0
        self.cancelled = False
        self.cond = threading.Condition()

    def full(self) -> bool:
        return self.size > 0 and self.sent - self.acked >= self.size

    def wait(self, timeout: float) -> None:
        """Sleep until an ack (or cancel) arrives, at most ``timeout`` seconds."""
        with self.cond:
            if self.full() and not self.cancelled:
                self.cond.wait(timeout)

    def ack(self, total: int) -> None:
        with self.cond:
            self.acked = max(self.acked, total)
            self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()


def window_arg(msg: dict[str, Any]) -> Window:
    size = msg.get("window") or 0
    if not isinstance(size, int) or size < 0:
        raise RequestError(P.ERR_INVALID, "window must be a non-negative integer")
    return Window(size)


# --------------------------------------------------------------------------- exec


class Exec:
    """One exec request: the command's process once spawned, its stdin and output window,
    and the request (id, connection) its output goes to (``attach`` moves it)."""

    def __init__(self, req_id: int, conn: str | None) -> None:
        self.id = req_id
        self.conn = conn
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid = 0
        self.pending_signal = 0  # a kill that arrived before the process was spawned
        self.stdin_q: queue.Queue[bytes | None] = queue.Queue()
        self.stream_stdin = False
        self.done = False
        self.window = Window(0)
        self.tty_fd = -1  # 1.7: the pty's master, for a command run on a terminal


class Command(NamedTuple):
    """What an exec runs, checked: ``argv`` in ``cwd`` with ``env``, for at most ``timeout``
    seconds, its stdin a pipe (``want_stdin``) or /dev/null."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    timeout: float | None
    want_stdin: bool
    user: RunAs | None = None
    pty: tuple[int, int] | None = None  # 1.7: (rows, cols) of the terminal it runs on


class RunAs(NamedTuple):
    """The user an exec runs as (``user``: a container image's USER)."""

    uid: int
    gid: int
    groups: list[int]


def user_arg(msg: dict[str, Any], env: dict[str, str]) -> RunAs | None:
    """The request's ``user`` (`lookup_user`); None runs as root. Sets ``env``'s HOME and
    USER from the user's entry unless the request set them."""
    found = lookup_user(msg.get("user"))
    if found is None:
        return None
    run_as, entry = found
    given = msg.get("env") if isinstance(msg.get("env"), dict) else {}
    if "HOME" not in given:
        env["HOME"] = entry.pw_dir if entry is not None and entry.pw_dir else "/"
    if "USER" not in given and entry is not None:
        env["USER"] = entry.pw_name
    return run_as


def lookup_user(raw: Any) -> tuple[RunAs, pwd.struct_passwd | None] | None:
    """``raw`` (``NAME[:GROUP]`` or ``UID[:GID]``, as a Dockerfile's USER) resolved
    through the guest's /etc/passwd and /etc/group, with its passwd entry (None for a
    numeric uid that has none); None for no user (absent or empty).

    Raises:
        RequestError: ``EINVAL`` (field ``user``) for a malformed value, or a name or
            group the guest does not have.
    """
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str) or "\0" in raw:
        raise RequestError(P.ERR_INVALID, "user must be NAME[:GROUP] or UID[:GID]",
                           field="user")
    name, _, group = raw.partition(":")
    try:
        entry: pwd.struct_passwd | None = (
            pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name))
    except KeyError:
        if not name.isdigit():
            raise RequestError(P.ERR_INVALID, f"no user {name!r} in the machine's "
                               "/etc/passwd", field="user") from None
        entry = None  # a numeric uid needs no entry (gid 0, as runc gives it)
    uid = entry.pw_uid if entry is not None else int(name)
    gid = entry.pw_gid if entry is not None else 0
    if group:
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise RequestError(P.ERR_INVALID, f"no group {group!r} in the machine's "
                               "/etc/group", field="user") from None
    groups = os.getgrouplist(entry.pw_name, gid) if entry is not None else [gid]
    return RunAs(uid, gid, groups), entry


def argv_arg(msg: dict[str, Any]) -> list[str]:
    cmd = msg.get("cmd")
    if isinstance(cmd, str):
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
        argv = list(cmd)
    else:
        raise RequestError(P.ERR_INVALID, "cmd must be a string or a non-empty list of strings")
    # Checked here, not left to Popen in the exec thread: a bad request gets an
    # error reply instead of a thread that dies without one.
    if any("\0" in a for a in argv):
        raise RequestError(P.ERR_INVALID, "cmd must not contain NUL bytes", field="command")
    return argv


def env_arg(msg: dict[str, Any]) -> dict[str, str]:
    """`P.DEFAULT_ENV` with the request's ``env`` over it (a None value unsets a name)."""
    env = dict(P.DEFAULT_ENV)
    raw_env = msg.get("env") or {}
    if not isinstance(raw_env, dict):
        raise RequestError(P.ERR_INVALID, "env must be an object", field="env")
    for key, value in raw_env.items():
        key = str(key)
        if not key or "=" in key or "\0" in key:
            raise RequestError(
                P.ERR_INVALID,
                f"invalid environment variable name {key!r}: it must be non-empty "
                "without '=' or NUL", field="env",
            )
        if value is None:
            env.pop(key, None)
        elif "\0" in str(value):
            raise RequestError(
                P.ERR_INVALID, f"environment variable {key} contains a NUL byte",
                field="env",
            )
        else:
            env[key] = str(value)
    return env


def cwd_arg(msg: dict[str, Any], default_cwd: str) -> str:
    """The request's ``cwd``, which must be a directory; without one ``default_cwd``
    (created if missing; ``/`` when it cannot be)."""
    cwd = msg.get("cwd")
    if isinstance(cwd, str) and "\0" in cwd:
        raise RequestError(P.ERR_INVALID, "cwd must not contain NUL bytes", field="cwd")
    if cwd is None:
        try:
            os.makedirs(default_cwd, exist_ok=True)
        except OSError as exc:
            log(f"cannot create default cwd {default_cwd}: {exc}")
            return "/"
        return default_cwd
    if not isinstance(cwd, str):
        raise RequestError(P.ERR_INVALID, "cwd must be a string")
    if not os.path.isdir(cwd):
        code = P.ERR_NOT_DIR if os.path.exists(cwd) else P.ERR_NOT_FOUND
        raise RequestError(code, f"working directory does not exist: {cwd}", path=cwd)
    return cwd


def size_arg(raw: Any, name: str = "pty") -> tuple[int, int]:
    """A terminal size ``{"rows", "cols"}`` (each 1-65535) as ``(rows, cols)``."""
    if not isinstance(raw, dict):
        raise RequestError(P.ERR_INVALID, f"{name} must be {{\"rows\": R, \"cols\": C}}",
                           field=name)
    size = raw.get("rows"), raw.get("cols")
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 65536
               for n in size):
        raise RequestError(P.ERR_INVALID, f"{name} rows and cols must be 1-65535",
                           field=name)
    return int(raw["rows"]), int(raw["cols"])


def set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def take_tty() -> None:
    """In a pty command's child (a session leader): its terminal becomes the session's
    controlling terminal, so job control and SIGWINCH reach the shell."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def timeout_arg(msg: dict[str, Any]) -> float | None:
    timeout = msg.get("timeout")
    if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
        raise RequestError(P.ERR_INVALID, "timeout must be a positive number")
    return timeout


def killpg(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except OSError:
        return False


def exit_outcome(status: int) -> tuple[int, int | None]:
    """A wait status as the exec's ``(exit_code, signal)``; a signal death exits 128 + it."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


def feed_stdin(ex: Exec, pipe: Any) -> None:
    """The command's stdin: what arrives in the exec's queue until None (its EOF)."""
    fd = pipe.fileno()
    try:
        while True:
            chunk = ex.stdin_q.get()
            if chunk is None:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
    except OSError:
        pass  # the command closed its stdin or exited
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


class RunningCommand:
    """An exec's spawned command until its exit status: its pipes forwarded as output
    events of the exec (within its flow-control window), its timeout enforced."""

    def __init__(
        self,
        host: HostLink,
        ex: Exec,
        proc: subprocess.Popen[bytes],
        start: float,
        timeout: float | None,
        reaped: tuple[threading.Event, list[int]],
    ) -> None:
        assert proc.stdout is not None
        self.host = host
        self.ex = ex
        self.proc = proc
        # A command on a pty has one output, the terminal (its stderr goes there too).
        self.outputs = tuple(f for f in (proc.stdout, proc.stderr) if f is not None)
        self.done_event, self.status_box = reaped
        self.pipes = {proc.stdout.fileno(): P.EV_STDOUT}
        if proc.stderr is not None:
            self.pipes[proc.stderr.fileno()] = P.EV_STDERR
        for fd in self.pipes:
            os.set_blocking(fd, False)
        self.poller = select.poll()
        for fd in self.pipes:
            self.poller.register(fd, select.POLLIN)
        self.deadline = start + timeout if timeout is not None else None
        self.timed_out = False
        self.kill_at: float | None = None  # after a timeout's SIGTERM: when SIGKILL comes
        self.exited_at: float | None = None
        self.last_data = time.monotonic()

    def enforce_timeout(self, now: float) -> None:
        """At the deadline the process group gets SIGTERM; `P.EXEC_KILL_GRACE` seconds
        later, if the command still runs (it ignores or traps TERM), SIGKILL."""
        if self.deadline is not None and not self.timed_out and now >= self.deadline:
            self.timed_out = True
            self.kill_at = now + P.EXEC_KILL_GRACE
            killpg(self.ex.pgid, signal.SIGTERM)
        elif self.kill_at is not None and now >= self.kill_at:
            self.kill_at = None
            killpg(self.ex.pgid, signal.SIGKILL)

    def forward_output(self) -> None:
        """Send what the command writes until its pipes close, or go quiet after its exit."""
        ex = self.ex
        while self.pipes:
            now = time.monotonic()
            if self.exited_at is None and self.done_event.is_set():
                self.exited_at = now
            if self.exited_at is not None and drain_over(now, self.last_data, self.exited_at):
                break  # background children still hold the pipes: don't wait for them
            self.enforce_timeout(now)
            if ex.stream_stdin and ex.conn != self.host.conn:
                # Nobody follows it (a fork child, a restore, a reconnect): its output
                # waits in the pipes for the host that re-attaches (1.4; the command
                # waits too once a pipe is full). Other execs are read and dropped.
                self.done_event.wait(0.05)
                continue
            wait = 0.05 if self.exited_at is not None or self.deadline is not None else 0.2
            if ex.window.full():
                self.hold(wait)
            else:
                self.read_pipes(wait)

    def hold(self, wait: float) -> None:
        """The host has not taken what was sent: stop reading the pipes (the command
        blocks on a full pipe) until it acknowledges. A pause is not silence: the drain
        limits after the exit count from its end."""
        ex = self.ex
        ex.window.wait(wait)
        self.last_data = time.monotonic()
        if self.exited_at is not None:
            self.exited_at = self.last_data
        if ex.conn != self.host.conn:
            # Its host is gone: nobody will acknowledge. Stop waiting for acks
            # (output is dropped from now on, as for any gone connection).
            ex.window.size = 0

    def read_pipes(self, wait: float) -> None:
        """Forward one chunk of each pipe that has output within ``wait`` seconds."""
        for fd, _ in self.poller.poll(wait * 1000):
            try:
                data = os.read(fd, P.EXEC_CHUNK)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self.poller.unregister(fd)
                del self.pipes[fd]
                continue
            self.last_data = time.monotonic()
            self.ex.window.sent += len(data)
            self.host.send({"id": self.ex.id, "ev": self.pipes[fd], "data": b64e(data)},
                           self.ex.conn)

    def wait_status(self) -> int:
        """Wait for the exit status (still honouring the timeout) and release the pipes."""
        while not self.done_event.wait(0.05):
            self.enforce_timeout(time.monotonic())
        if self.timed_out:
            # The whole group dies, not only the leader.
            killpg(self.ex.pgid, signal.SIGKILL)
        status = self.status_box[0]
        # The reaper collected the status; tell Popen so it never waits on its own.
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        for f in self.outputs:
            with contextlib.suppress(OSError):
                f.close()
        return status


class Execs:
    """The exec requests (``exec``, ``attach``, ``stdin``, ``kill``): each command runs
    in a thread of its own, in a session of its own, reaped by the `Reaper`."""

    def __init__(self, host: HostLink, reaper: Reaper, default_cwd: str) -> None:
        self.host = host
        self.reaper = reaper
        self.default_cwd = default_cwd
        self.lock = threading.Lock()
        self.execs: dict[int, Exec] = {}

    def window(self, req_id: int) -> Window | None:
        """The output window of exec ``req_id``, if it runs."""
        with self.lock:
            ex = self.execs.get(req_id)
        return ex.window if ex is not None else None

    def op_exec(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        env = env_arg(msg)
        command = Command(
            argv=argv_arg(msg),
            env=env,
            cwd=cwd_arg(msg, self.default_cwd),
            timeout=timeout_arg(msg),
            want_stdin=msg.get("stdin") is not None or bool(msg.get("stdin_stream")),
            user=user_arg(msg, env),
            pty=size_arg(msg["pty"]) if msg.get("pty") is not None else None,
        )
        ex = Exec(req_id, conn)
        ex.window = window_arg(msg)
        ex.stream_stdin = bool(msg.get("stdin_stream"))
        stdin_data = msg.get("stdin")
        if stdin_data is not None:
            ex.stdin_q.put(b64d(stdin_data))
        if not ex.stream_stdin:
            ex.stdin_q.put(None)
        with self.lock:
            if req_id in self.execs:
                raise RequestError(P.ERR_INVALID, f"exec id {req_id} is already running")
            self.execs[req_id] = ex
        spawn_thread(f"exec-{req_id}", self.run_exec, ex, command)

    def run_exec(self, ex: Exec, command: Command) -> None:
        try:
            self._run_exec(ex, command)
        except Exception as exc:
            # Never leave the host waiting: an exec that fails before its result is
            # answered with an error (after a result, the failure is only logged).
            log(f"exec {ex.id} failed:\n{traceback.format_exc()}")
            if not ex.done:
                ex.done = True
                self.host.fail(ex.id, ex.conn, RequestError(
                    P.ERR_INVALID if isinstance(exc, ValueError) else P.ERR_INTERNAL,
                    f"{type(exc).__name__}: {exc}"))
        finally:
            ex.done = True
            with self.lock:
                self.execs.pop(ex.id, None)

    def _run_exec(self, ex: Exec, command: Command) -> None:
        start = time.monotonic()
        proc = self.spawn(ex, command, start)
        if proc is None:
            return
        reaped = self.reaper.register(proc.pid, start)
        ex.proc = proc
        if command.pty is not None:
            assert proc.stdout is not None
            ex.tty_fd = proc.stdout.fileno()
        with self.lock:
            ex.pgid = proc.pid
            early_signal = ex.pending_signal
        if early_signal:
            killpg(ex.pgid, early_signal)
        self.host.send({"id": ex.id, "ev": P.EV_STARTED, "pid": proc.pid}, ex.conn)
        if proc.stdin is not None:
            spawn_thread(f"stdin-{ex.id}", feed_stdin, ex, proc.stdin)
        running = RunningCommand(self.host, ex, proc, start, command.timeout, reaped)
        running.forward_output()
        # Pipes closed (or given up on): now wait for the exit status, still honouring timeout.
        status = running.wait_status()
        ex.stdin_q.put(None)
        exit_code, sig = exit_outcome(status)
        ex.done = True  # before the reply: a stdin/kill sent right after it gets ESRCH
        self.host.reply(
            ex.id,
            ex.conn,
            exit_code=exit_code,
            signal=sig,
            timed_out=running.timed_out,
            duration=round(time.monotonic() - start, 6),
        )

    def spawn(self, ex: Exec, command: Command, start: float) -> subprocess.Popen[bytes] | None:
        """Start the command; when it cannot start, answer the exec as a shell would
        (its error on stderr, exit code 127 or 126) and return None."""
        try:
            if command.pty is not None:
                return self.spawn_pty(command)
            return subprocess.Popen(
                command.argv,
                stdin=subprocess.PIPE if command.want_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=command.env,
                cwd=command.cwd,
                start_new_session=True,
                close_fds=True,
                **({"user": command.user.uid, "group": command.user.gid,
                    "extra_groups": command.user.groups} if command.user else {}),
            )
        except OSError as exc:
            # Behave like a shell: 127 for "not found", 126 for "cannot execute".
            code = 127 if exc.errno == errno.ENOENT else 126
            text = f"boxd-agent: {command.argv[0]}: {exc.strerror}\n".encode()
            self.host.send({"id": ex.id, "ev": P.EV_STDERR, "data": b64e(text)}, ex.conn)
            self.host.reply(
                ex.id,
                ex.conn,
                exit_code=code,
                signal=None,
                timed_out=False,
                duration=time.monotonic() - start,
            )
            return None

    @staticmethod
    def spawn_pty(command: Command) -> subprocess.Popen[bytes]:
        """Start the command on a new pty of ``command.pty``'s size (1.7): the master is
        its output and its stdin."""
        assert command.pty is not None
        master, slave = os.openpty()
        try:
            set_winsize(slave, *command.pty)
            proc = subprocess.Popen(
                command.argv, stdin=slave, stdout=slave, stderr=slave, env=command.env,
                cwd=command.cwd, start_new_session=True, close_fds=True,
                preexec_fn=take_tty,
                **({"user": command.user.uid, "group": command.user.gid,
                    "extra_groups": command.user.groups} if command.user else {}),
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        proc.stdout = os.fdopen(master, "rb", buffering=0)
        proc.stdin = os.fdopen(os.dup(master), "wb", buffering=0)
        return proc

    def find_exec(self, msg: dict[str, Any]) -> Exec:
        exec_id = msg.get("exec_id")
        with self.lock:
            ex = self.execs.get(exec_id) if isinstance(exec_id, int) else None
        if ex is None or ex.done:
            raise RequestError(P.ERR_NO_EXEC, f"no running exec with id {exec_id!r}")
        return ex

    def op_attach(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """Follow a running exec again, on this connection and under this request's id.

        After a fork, a restore or a reconnect the exec still runs (the memory is the
        same) but its output goes to a connection that is gone; from now on it goes to
        ``req_id`` here (stdin and kill use ``req_id`` as the exec id).
        """
        ex = self.find_exec(msg)
        with self.lock:
            self.execs.pop(ex.id, None)
            ex.id = req_id
            ex.conn = conn
            ex.window.size = 0  # the new host acknowledges nothing it asked no window for
            self.execs[req_id] = ex
        pid = ex.proc.pid if ex.proc is not None else 0
        self.host.send({"id": req_id, "ev": P.EV_STARTED, "pid": pid, "attached": True}, conn)

    def op_stdin(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        ex = self.find_exec(msg)
        if not ex.stream_stdin:
            raise RequestError(P.ERR_INVALID, "exec was not started with stdin_stream")
        data = b64d(msg.get("data"))
        if data:
            ex.stdin_q.put(data)
        if msg.get("eof"):
            ex.stdin_q.put(None)
        if msg.get("reply") is not False:  # 1.4: "reply": false is answered only on error
            self.host.reply(req_id, conn, size=len(data))

    def op_resize(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """A new size for a pty command's terminal (1.7); its foreground gets SIGWINCH."""
        ex = self.find_exec(msg)
        rows, cols = size_arg(msg.get("size"), "size")
        if ex.tty_fd < 0:
            raise RequestError(P.ERR_INVALID, f"exec {ex.id} does not run on a pty")
        try:
            set_winsize(ex.tty_fd, rows, cols)
        except OSError as exc:
            raise RequestError(P.ERR_NO_EXEC, f"exec {ex.id} has ended: {exc}") from exc
        self.host.reply(req_id, conn, rows=rows, cols=cols)

    def op_kill(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        ex = self.find_exec(msg)
        sig = msg.get("signal", signal.SIGKILL)
        if not isinstance(sig, int):
            raise RequestError(P.ERR_INVALID, "signal must be an integer")
        with self.lock:
            pgid = ex.pgid
            if not pgid:
                ex.pending_signal = sig  # delivered as soon as the process exists
        delivered = killpg(pgid, sig) if pgid else True
        self.host.reply(req_id, conn, delivered=delivered)


# --------------------------------------------------------------------------- files


class FileWrite:
    def __init__(self, path: str, tmp: str, fd: int, mode: int, conn: str | None) -> None:
        self.path = path
        self.tmp = tmp
        self.fd = fd
        self.mode = mode
        self.conn = conn
        self.size = 0
        self.sha = hashlib.sha256()
        self.failed = False


def path_arg(msg: dict[str, Any]) -> str:
    path = msg.get("path")
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise RequestError(P.ERR_INVALID, f"path must be absolute: {path!r}", path=path)
    return path


def check_regular(path: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise RequestError(P.ERR_IS_DIR, f"Is a directory: {path}", path=path)
    if not stat.S_ISREG(st.st_mode):
        kind = ("a character device" if stat.S_ISCHR(st.st_mode) else
                "a block device" if stat.S_ISBLK(st.st_mode) else
                "a fifo" if stat.S_ISFIFO(st.st_mode) else
                "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise RequestError(
            P.ERR_INVALID, f"{path} is {kind}: only regular files can be read", path=path)


def make_parents(parent: str, owner: RunAs | None) -> None:
    """Make directory ``parent`` and its missing ancestors (0755); those it makes belong
    to ``owner`` when given (1.9), as envd's upload makes them."""
    if owner is None:
        os.makedirs(parent, exist_ok=True)
        return
    missing = []
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs
        os.chown(path, owner.uid, owner.gid, follow_symlinks=False)


class Files:
    """The file requests: ``stat``, ``write`` (chunks into a temporary file renamed over
    the path at its end), ``read`` (streamed from a thread, flow controlled) and its
    ``cancel``."""

    def __init__(self, host: HostLink) -> None:
        self.host = host
        self.lock = threading.Lock()
        self.writes: dict[int, FileWrite] = {}
        self.reads: dict[int, Window] = {}

    def read_window(self, req_id: int) -> Window | None:
        """The window of read ``req_id``, if it streams."""
        with self.lock:
            return self.reads.get(req_id)

    def op_stat(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        path = path_arg(msg)
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise os_error(exc, path) from exc
        if stat.S_ISREG(st.st_mode):
            kind = "file"
        elif stat.S_ISDIR(st.st_mode):
            kind = "dir"
        elif stat.S_ISLNK(st.st_mode):
            kind = "symlink"
        else:
            kind = "other"
        self.host.reply(
            req_id,
            conn,
            path=path,
            type=kind,
            size=st.st_size,
            mode=stat.S_IMODE(st.st_mode),
            mtime=st.st_mtime,
            uid=st.st_uid,
            gid=st.st_gid,
        )

    def op_write(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        with self.lock:
            fw = self.writes.get(req_id)
        offset = msg.get("offset", 0)
        if fw is None:
            if offset != 0:
                return  # the write already failed (and was answered) or was aborted
            fw = self.open_write(req_id, conn, msg)
        if fw.failed:
            return
        try:
            if offset != fw.size:
                raise RequestError(P.ERR_INVALID, f"chunk at offset {offset}, expected {fw.size}")
            data = b64d(msg.get("data"))
            view = memoryview(data)
            while view:
                view = view[os.write(fw.fd, view) :]
            fw.size += len(data)
            fw.sha.update(data)
            if msg.get("eof"):
                self.finish_write(req_id, fw)
        except (RequestError, OSError) as exc:
            self.drop_write(req_id, fw)
            raise exc if isinstance(exc, RequestError) else os_error(exc, fw.path) from exc

    def open_write(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> FileWrite:
        path = path_arg(msg)
        mode = msg.get("mode", 0o644)
        if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise RequestError(P.ERR_INVALID, f"bad mode {mode!r}")
        if os.path.isdir(path):
            raise RequestError(P.ERR_IS_DIR, f"Is a directory: {path}", path=path)
        with contextlib.suppress(OSError):
            # The write replaces the path by a rename: a device node, fifo or socket
            # (/dev/null) would be swapped for a plain file under every program using it.
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise RequestError(
                    P.ERR_INVALID,
                    f"not a regular file: {path} (an upload replaces a file; devices, "
                    "fifos and sockets are not replaced)", path=path)
        # 1.9: the file (and the parents the write makes) belong to ``user``, as E2B's
        # envd leaves an upload: checked before anything is made.
        found = lookup_user(msg.get("user"))
        owner = found[0] if found is not None else None
        parent = os.path.dirname(path) or "/"
        try:
            make_parents(parent, owner)
            tmp = os.path.join(parent, f".{os.path.basename(path)}.boxd-{os.getpid()}-{req_id}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise os_error(exc, path) from exc
        if owner is not None:
            try:
                os.fchown(fd, owner.uid, owner.gid)
            except OSError as exc:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise os_error(exc, path) from exc
        fw = FileWrite(path, tmp, fd, mode, conn)
        with self.lock:
            self.writes[req_id] = fw
        return fw

    def finish_write(self, req_id: int, fw: FileWrite) -> None:
        os.fchmod(fw.fd, fw.mode)
        os.fsync(fw.fd)
        os.close(fw.fd)
        fw.fd = -1
        os.rename(fw.tmp, fw.path)
        with contextlib.suppress(OSError):
            dfd = os.open(os.path.dirname(fw.path) or "/", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        with self.lock:
            self.writes.pop(req_id, None)
        self.host.reply(
            req_id, fw.conn, path=fw.path, size=fw.size, mode=fw.mode, sha256=fw.sha.hexdigest()
        )

    def drop_write(self, req_id: int, fw: FileWrite) -> None:
        fw.failed = True
        if fw.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fw.fd)
            fw.fd = -1
        with contextlib.suppress(OSError):
            os.unlink(fw.tmp)
        # Keep the failed entry so later chunks of this id are ignored, not re-opened.
        with self.lock:
            self.writes[req_id] = fw
            if len(self.writes) > 1024:
                for key in [k for k, w in self.writes.items() if w.failed][:512]:
                    del self.writes[key]

    def abort_stale_writes(self) -> None:
        """Drop the writes of connections other than the current one (they never end)."""
        with self.lock:
            stale = [(k, w) for k, w in self.writes.items() if w.conn != self.host.conn]
            for k, _ in stale:
                del self.writes[k]
        for _, w in stale:
            if not w.failed:
                w.failed = True
                with contextlib.suppress(OSError):
                    os.close(w.fd)
                with contextlib.suppress(OSError):
                    os.unlink(w.tmp)

    def op_read(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        path = path_arg(msg)
        window = window_arg(msg)
        try:
            # Refuse devices and fifos before opening them: /dev/zero never ends, and
            # opening a fifo blocks until a writer comes. O_NONBLOCK covers a swap
            # between the stat and the open; fstat checks what was opened.
            check_regular(path, os.stat(path))
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise os_error(exc, path) from exc
        try:
            st = os.fstat(fd)
            check_regular(path, st)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        f = os.fdopen(fd, "rb")
        with self.lock:
            self.reads[req_id] = window
        spawn_thread(f"read-{req_id}", self.stream_file, req_id, conn, path, f, st)

    def stream_file(
        self, req_id: int, conn: str | None, path: str, f: Any, st: os.stat_result
    ) -> None:
        sha = hashlib.sha256()
        size = 0
        with self.lock:
            window = self.reads.get(req_id) or Window(0)
        try:
            with f:
                while True:
                    while window.full() and not window.cancelled and conn == self.host.conn:
                        window.wait(0.5)  # the host has not taken what was sent yet
                    if window.cancelled or conn != self.host.conn:
                        return  # the host that asked is gone: read no further
                    chunk = f.read(P.FILE_CHUNK)
                    if not chunk:
                        break
                    sha.update(chunk)
                    msg = {"id": req_id, "ev": P.EV_DATA, "offset": size, "data": b64e(chunk)}
                    size += len(chunk)
                    window.sent = size
                    self.host.send(msg, conn)
        except OSError as exc:
            self.host.fail(req_id, conn, os_error(exc, path))
            return
        finally:
            with self.lock:
                self.reads.pop(req_id, None)
        self.host.reply(
            req_id,
            conn,
            path=path,
            size=size,
            mode=stat.S_IMODE(st.st_mode),
            sha256=sha.hexdigest(),
        )

    def op_cancel(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """Stop the read ``req``: its host went away (1.3)."""
        target = msg.get("req")
        with self.lock:
            window = self.reads.get(target) if isinstance(target, int) else None
        if window is not None:
            window.cancel()
        self.host.reply(req_id, conn, cancelled=window is not None)


# --------------------------------------------------------------------------- identity


def machine_dir(sysroot: str | None) -> str:
    """`P.IDENTITY_DIR` (under ``sysroot`` in tests): identity, the API socket and key."""
    return os.path.join(sysroot or "/", P.IDENTITY_DIR.lstrip("/"))


def write_api_key(base: str, key: Any) -> None:
    """Check the machine's API credential (1.5) and write it, 0600, to ``base``."""
    if not isinstance(key, str) or not key or not key.isprintable() or len(key) > 256 \
            or " " in key:
        raise RequestError(P.ERR_INVALID, "the key must be a short printable string")
    os.makedirs(base, exist_ok=True)
    path = os.path.join(base, P.API_KEY_FILE)
    tmp = path + ".boxd-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (key + "\n").encode())
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    os.rename(tmp, path)


class IdentityArgs(NamedTuple):
    """An ``identity`` request's fields, checked; None (empty ``seed``) leaves one alone."""

    hostname: str | None
    machine_id: str | None
    seed: bytes
    now: float | None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> IdentityArgs:
        hostname = msg.get("hostname")
        machine_id = msg.get("machine_id")
        seed = b64d(msg.get("seed"))
        now = msg.get("now")
        if hostname is not None and (
            not isinstance(hostname, str) or not 0 < len(hostname) <= 64 or "/" in hostname
        ):
            raise RequestError(P.ERR_INVALID, f"bad hostname {hostname!r}")
        if machine_id is not None and (
            not isinstance(machine_id, str)
            or len(machine_id) != 32
            or any(c not in "0123456789abcdef" for c in machine_id)
        ):
            raise RequestError(P.ERR_INVALID, "machine_id must be 32 lowercase hex digits")
        if now is not None and not isinstance(now, int | float):
            raise RequestError(P.ERR_INVALID, "now must be a number (seconds since the epoch)")
        return cls(hostname, machine_id, seed, now)


class Identity:
    """The ``identity`` request: a fork's or restore's new clock, RNG seed, hostname,
    machine-id and API key. (Guests with boxd-init do identity in C; this is the
    standalone agent's path.)"""

    def __init__(self, host: HostLink, sysroot: str | None, host_clock: bool) -> None:
        self.host = host
        self.sysroot = sysroot  # tests: write files under it, skip kernel calls
        self.host_clock = host_clock  # gVisor: the clock is the host's, left alone

    def op_identity(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """New identity after a fork/restore. Touches kernel and /etc state, no process state."""
        args = IdentityArgs.parse(msg)
        api_key = msg.get("api_key")
        if api_key is not None:
            # 1.5: validated first, so nothing half-applied
            write_api_key(machine_dir(self.sysroot), api_key)
        done = self.apply(args)
        if api_key is not None:
            done.append("api_key")
        self.host.reply(req_id, conn, applied=done)

    def apply(self, args: IdentityArgs) -> list[str]:
        """Set what ``args`` names; the names of what was set, for the reply."""
        sysroot = self.sysroot
        done: list[str] = []
        if args.now is not None and not self.host_clock:
            if not sysroot:
                time.clock_settime(time.CLOCK_REALTIME, float(args.now))
            done.append("clock")
        if args.seed:
            self.reseed(args.seed, real=not sysroot)
            done.append("rng")
        if args.hostname is not None:
            if not sysroot:
                socket.sethostname(args.hostname)
            self.write_identity(sysroot, "hostname", args.hostname + "\n", 0o644)
            done.append("hostname")
        if args.machine_id is not None:
            self.write_identity(sysroot, "machine-id", args.machine_id + "\n", 0o444)
            done.append("machine_id")
        return done

    @staticmethod
    def reseed(seed: bytes, *, real: bool) -> None:
        """Mix the host's seed into the pool, then force the CRNG to reseed from it.

        A ready CRNG does not reseed when entropy is added, so without RNDRESEEDCRNG two
        forks of one moment read the same /dev/urandom bytes until its next scheduled
        reseed (up to 60 s of guest time). As init.c's reseed.
        """
        if not real:
            return
        fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
        try:
            added = False
            if os.geteuid() == 0:
                # struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
                padded = seed + b"\0" * (-len(seed) % 4)
                info = struct.pack("ii", len(seed) * 8, len(seed)) + padded
                try:
                    fcntl.ioctl(fd, RNDADDENTROPY, info)
                    added = True
                except OSError as exc:
                    log(f"RNDADDENTROPY failed ({exc}); mixing without credit")
            if not added:
                os.write(fd, seed)  # mixes into the pool without crediting entropy
            try:
                fcntl.ioctl(fd, RNDRESEEDCRNG)
            except OSError as exc:  # gVisor has no CRNG to reseed: ENOTTY is fine
                if exc.errno not in (errno.ENOTTY, errno.EINVAL):
                    log(f"RNDRESEEDCRNG failed ({exc})")
        finally:
            os.close(fd)

    @staticmethod
    def write_identity(sysroot: str | None, name: str, text: str, mode: int) -> None:
        """Replace one identity file: ``IDENTITY_DIR/name``, which /etc/name links to.

        Plain os calls on tmpfs: identity is on the fork's critical path, and a fresh
        child under TCG pays to translate every guest code path it runs first (an ext4
        create + rename-over costs ~8k translation blocks). A guest whose /etc/name is a
        regular file (an image from before protocol 1.1) gets that file replaced instead.
        """
        root = sysroot or "/"
        etc = os.path.join(root, "etc", name)
        linked = os.path.islink(etc)
        path = os.path.join(root, P.IDENTITY_DIR.lstrip("/"), name) if linked else etc
        tmp = path + ".boxd-tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            os.write(fd, text.encode())
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.rename(tmp, path)


# --------------------------------------------------------------------------- the in-guest API (1.5)


class RelayStream:
    """One connection to the in-guest API socket, relayed to the host (``relay_listen``)."""

    def __init__(self, relay_id: int, conn: str | None, stream_id: int,
                 sock: socket.socket) -> None:
        # The relay carrying it; a relay_listen with ``keep`` (the same guest under a new
        # VM process: a RAM swap) moves it to the new one.
        self.relay_id = relay_id
        self.conn = conn
        self.id = stream_id
        self.sock = sock
        self.outbox: queue.Queue[bytes | None] = queue.Queue()  # host -> guest; b"": EOF; None: end
        self.closed = False
        self.announced = False  # a host saw its relay_open

    def finish(self) -> None:
        """The host ended it: close it once what the host sent before is written (its
        ``close`` follows the response's last bytes, which may still be in ``outbox``)."""
        self.outbox.put(None)

    def close(self) -> None:
        """End it now (what is still in ``outbox`` is dropped)."""
        if self.closed:
            return
        self.closed = True
        self.outbox.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class ApiRelay:
    """The in-guest API socket (``relay_listen``, ``relay_send``): each guest process that
    connects to it becomes a stream relayed over the current relay request."""

    def __init__(self, host: HostLink, base: str) -> None:
        self.host = host
        self.base = base  # machine_dir: the socket and its key
        self.lock = threading.Lock()
        # The current relay request (id, connection), the listening socket and the
        # relayed streams of the current relay.
        self.relay: tuple[int, str | None] | None = None
        self.listener: socket.socket | None = None
        self.streams: dict[int, RelayStream] = {}
        self.next_id = 1

    def op_relay_listen(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """Serve the API socket for this connection, with a new credential (docs/lifecycle.md).

        Writes the key to tmpfs, (re)binds the socket once, ends every stream of an earlier
        relay (a fork child's or restored guest's copy of a call in flight) — or, with
        ``keep``, moves them to this one (the host replaced the VM process under the same
        guest) — and answers ``started``; the request then lasts as long as the host
        connection.
        """
        write_api_key(self.base, msg.get("key"))
        keep = msg.get("keep") or []
        if not isinstance(keep, list) or not all(isinstance(i, int) for i in keep):
            raise RequestError(P.ERR_INVALID, "keep must be a list of stream ids")
        listener = None
        if self.listener is None:  # bound before ``started``: the socket is there then
            listener = self.listener = self.listen()
        with self.lock:
            # Kept: those the host names (it saw them open) and those no host has seen (a
            # guest process that connected while no host served the socket).
            old = [st for st in self.streams.values() if st.id not in keep and st.announced]
            for stream in old:
                del self.streams[stream.id]
            for stream in self.streams.values():
                stream.relay_id, stream.conn = req_id, conn
            self.relay = (req_id, conn)
            # ``started`` goes first, still under the lock: a stream's events are sent
            # under the relay it reads under this lock (`event`), so none of this relay
            # can come before it (the host takes the first event as the answer: a
            # relay_open sent ahead of it was lost, and its guest connection hung).
            self.host.send({"id": req_id, "ev": P.EV_STARTED}, conn)
        for stream in old:
            stream.close()
        if listener is not None:  # what connected meanwhile waits in its backlog
            spawn_thread("relay-accept", self.accept, listener)

    def listen(self) -> socket.socket:
        """Bind the API socket afresh (a stale one from before is removed), 0600."""
        sock_path = os.path.join(self.base, P.API_SOCKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)  # born 0600: the guest's root only, like the key
        try:
            listener.bind(sock_path)
        finally:
            os.umask(old_umask)
        listener.listen(64)
        return listener

    def accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                log(f"API socket accept failed: {exc}")
                time.sleep(0.1)
                continue
            with self.lock:
                relay = self.relay
                stream: RelayStream | None = None
                if relay is not None:
                    stream = RelayStream(relay[0], relay[1], self.next_id, sock)
                    self.next_id += 1
                    self.streams[stream.id] = stream
            if stream is None:
                sock.close()
                continue
            if not self.event(stream, {"ev": P.EV_RELAY_OPEN}):
                self.end(stream)
                continue
            stream.announced = True
            spawn_thread("relay-in", self.from_client, stream)
            spawn_thread("relay-out", self.to_client, stream)

    def event(self, stream: RelayStream, msg: dict[str, Any]) -> bool:
        """Send one event of a stream on its relay's connection. While that connection is
        gone (a RAM swap: the host moves the stream to its next relay), wait a little."""
        deadline = time.monotonic() + RELAY_MOVE_WAIT
        while not stream.closed:
            with self.lock:  # its relay's id and connection together, never one of each
                relay_id, conn = stream.relay_id, stream.conn
            if self.host.send({"id": relay_id, "stream": stream.id, **msg}, conn):
                return True
            if time.monotonic() > deadline:
                break
            time.sleep(RETRY_SLEEP)
        return False

    def from_client(self, stream: RelayStream) -> None:
        """Guest client -> host: ``relay_data`` events, then ``relay_eof``."""
        while True:
            try:
                data = stream.sock.recv(P.EXEC_CHUNK)
            except OSError:
                data = b""
            if stream.closed:
                return
            if not data:
                self.event(stream, {"ev": P.EV_RELAY_EOF})
                return
            if not self.event(stream, {"ev": P.EV_RELAY_DATA, "data": b64e(data)}):
                self.end(stream)
                return

    def to_client(self, stream: RelayStream) -> None:
        """Host -> guest client, off the serve loop (a client that stops reading blocks
        only its own stream)."""
        while True:
            data = stream.outbox.get()
            if stream.closed:
                return
            if data is None:  # the host's close, after all it sent
                stream.close()
                return
            if not data:  # the host's end of the request stream
                with contextlib.suppress(OSError):
                    stream.sock.shutdown(socket.SHUT_WR)
                continue
            try:
                stream.sock.sendall(data)
            except OSError:
                self.end(stream)
                return

    def end(self, stream: RelayStream) -> None:
        with self.lock:
            if self.streams.get(stream.id) is stream:
                del self.streams[stream.id]
        stream.close()

    def op_relay_send(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """Host -> guest bytes of one stream (``data``), its EOF (``eof``) or its end
        (``close``). Carries the relay request's id; never answered."""
        with self.lock:
            stream = self.streams.get(msg.get("stream"))  # type: ignore[arg-type]
        if stream is None or stream.relay_id != req_id:
            return  # a stream that ended meanwhile, or of an older relay
        data = b64d(msg.get("data"))
        if data:
            stream.outbox.put(data)
        if msg.get("eof"):
            stream.outbox.put(b"")
        if msg.get("close"):
            with self.lock:
                if self.streams.get(stream.id) is stream:
                    del self.streams[stream.id]
            stream.finish()


# --------------------------------------------------------------------------- metrics


def process_ticks() -> int:
    """CPU clock ticks every process has used, summed from /proc/PID/stat: its own
    (utime, stime) and its waited-for children's (cutime, cstime), so the time of a
    process that ended counts once it is reaped (PID 1 reaps orphans)."""
    ticks = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # it ended meanwhile
        ticks += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return ticks


def read_metrics(root: str = "/") -> dict[str, int]:
    """``metrics`` (1.8): CPU time since boot (``cpu_busy`` of ``cpu_total`` clock ticks,
    summed over ``cpu_count`` CPUs: /proc/stat's ``cpu`` line, idle and iowait being
    idle), memory (/proc/meminfo: used is total minus available, as ``free`` says) and
    the root file system (statvfs, in bytes).

    gVisor's /proc/stat counts nothing (all zeros): there busy is every process's CPU
    time (`process_ticks`) and total the uptime times the CPUs."""
    cpu_count, busy, total = 0, 0, 0
    with open("/proc/stat") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name == "cpu":
                ticks = [int(v) for v in rest.split()[:8]]
                total = sum(ticks)
                busy = total - sum(ticks[3:5])  # idle, iowait
            elif name.startswith("cpu") and name[3:].isdigit():
                cpu_count += 1
    cpu_count = cpu_count or (os.cpu_count() or 1)
    if total == 0:
        hz = os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            total = int(float(f.read().split()[0]) * hz) * cpu_count
        busy = min(process_ticks(), total)
    mem: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                mem[key] = int(fields[0]) * 1024
    mem_total = mem.get("MemTotal", 0)
    available = mem.get("MemAvailable", mem.get("MemFree", 0))
    disk = os.statvfs(root)
    return {
        "cpu_count": cpu_count, "cpu_busy": busy, "cpu_total": total,
        "mem_total": mem_total, "mem_used": max(0, mem_total - available),
        "mem_cache": mem.get("Cached", 0),
        "disk_total": disk.f_blocks * disk.f_frsize,
        "disk_used": (disk.f_blocks - disk.f_bfree) * disk.f_frsize,
    }


# --------------------------------------------------------------------------- agent


class Agent:
    """Reads the host's requests off the channel and dispatches each, by its ``op``, to the
    handler of the collaborator that owns it; answers the connection-level ones itself
    (``hello``, ``ping``, ``sync``, and ``ack``, which spans execs and reads)."""

    def __init__(self, channel: Channel, args: argparse.Namespace) -> None:
        self.channel = channel
        self.started = time.time()
        self.host = HostLink(channel)
        self.execs = Execs(self.host, Reaper(), args.default_cwd)
        self.files = Files(self.host)
        identity = Identity(self.host, args.sysroot, args.host_clock)
        relay = ApiRelay(self.host, machine_dir(args.sysroot))
        self.handlers: dict[str, Handler] = {
            P.OP_HELLO: self.op_hello,
            P.OP_PING: self.op_ping,
            P.OP_SYNC: self.op_sync,
            P.OP_METRICS: self.op_metrics,
            P.OP_ACK: self.op_ack,
            P.OP_EXEC: self.execs.op_exec,
            P.OP_ATTACH: self.execs.op_attach,
            P.OP_STDIN: self.execs.op_stdin,
            P.OP_KILL: self.execs.op_kill,
            P.OP_RESIZE: self.execs.op_resize,
            P.OP_STAT: self.files.op_stat,
            P.OP_WRITE: self.files.op_write,
            P.OP_READ: self.files.op_read,
            P.OP_CANCEL: self.files.op_cancel,
            P.OP_IDENTITY: identity.op_identity,
            P.OP_RELAY_LISTEN: relay.op_relay_listen,
            P.OP_RELAY_SEND: relay.op_relay_send,
        }

    # ---- input

    def serve(self) -> None:
        buf = bytearray()
        while True:
            data = self.channel.read()
            if not data:
                # Host went away: a partial line can never complete; its requests are orphaned.
                buf.clear()
                self.host.conn = None
                self.files.abort_stale_writes()
                continue
            buf += data
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                line = bytes(buf[:nl])
                del buf[: nl + 1]
                if line.strip():
                    self.handle_line(line)
            if len(buf) > P.MAX_LINE:
                log("line too long; dropped")
                buf.clear()

    def handle_line(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError("not an object")
        except ValueError:
            log(f"ignoring malformed line ({len(line)} bytes): {line[:80]!r}")
            return
        req_id = msg.get("id")
        op = msg.get("op")
        if op == P.OP_HELLO:
            nonce = msg.get("nonce")
            if isinstance(nonce, str) and nonce != self.host.conn:
                self.host.conn = nonce
                self.files.abort_stale_writes()
        conn = self.host.conn
        handler = self.handlers.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise RequestError(P.ERR_UNKNOWN_OP, f"unknown operation {op!r}")
            if not isinstance(req_id, int):
                raise RequestError(P.ERR_INVALID, "request id must be an integer")
            handler(req_id, conn, msg)
        except RequestError as exc:
            self.host.fail(req_id, conn, exc)
        except OSError as exc:
            self.host.fail(req_id, conn, os_error(exc))
        except Exception as exc:
            log(f"{op} failed:\n{traceback.format_exc()}")
            self.host.fail(req_id, conn,
                           RequestError(P.ERR_INTERNAL, f"{type(exc).__name__}: {exc}"))

    # ---- hello / ping / sync / ack

    def op_hello(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        version = str(msg.get("version", ""))
        major = version.split(".", 1)[0]
        if major != str(P.PROTOCOL_MAJOR):
            raise RequestError(
                P.ERR_VERSION,
                f"host speaks agent protocol {version or '?'}, "
                f"this agent speaks {P.PROTOCOL_VERSION}",
                version=P.PROTOCOL_VERSION,
            )
        self.host.reply(
            req_id,
            conn,
            version=P.PROTOCOL_VERSION,
            nonce=msg.get("nonce"),
            started=self.started,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            time=time.time(),
        )

    def op_ping(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        self.host.reply(req_id, conn, time=time.time())

    def op_sync(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        # In this thread, not a `sync` process: a fork template captured right after
        # leaves no exiting process or thread behind for every child to finish.
        os.sync()
        self.host.reply(req_id, conn)

    def op_metrics(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """The guest's resource use now (1.8): raw counters, so the host computes CPU
        use between two samples and the agent keeps no state."""
        self.host.reply(req_id, conn, time=time.time(), **read_metrics())

    def op_ack(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """The host consumed ``bytes`` bytes of request ``req``'s output (1.3)."""
        target, total = msg.get("req"), msg.get("bytes")
        if not isinstance(target, int) or not isinstance(total, int):
            raise RequestError(P.ERR_INVALID, "ack needs integer req and bytes")
        window = self.execs.window(target) or self.files.read_window(target)
        if window is not None:
            window.ack(total)
        self.host.reply(req_id, conn, known=window is not None)


# --------------------------------------------------------------------------- main


def set_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    except Exception as exc:
        log(f"cannot become a child subreaper: {exc}")


def dial(port: int) -> int:
    """``agent.py --dial PORT``, as ``boxd-init --dial PORT`` (init.c's `dial_main`):
    connect to 127.0.0.1:PORT, say ``+``, relay stdin to the socket and the socket to
    stdout until the socket's reading half ends; 1 when the connect fails."""
    try:
        sock = socket.create_connection(("127.0.0.1", port))
    except OSError as exc:
        print(f"connect to 127.0.0.1:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    out = sys.stdout.fileno()
    os.write(out, b"+")
    watched = [0, sock.fileno()]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if 0 in ready:
            data = os.read(0, 65536)
            if data:
                try:
                    sock.sendall(data)
                except OSError:
                    return 0
            else:
                sock.shutdown(socket.SHUT_WR)
                watched.remove(0)
        if sock.fileno() in ready:
            data = sock.recv(65536)
            if not data:
                return 0
            try:
                while data:
                    data = data[os.write(out, data):]
            except OSError:
                return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="boxd guest agent")
    parser.add_argument("--connect", metavar="UNIX_SOCKET", help="serve over a unix socket (tests)")
    parser.add_argument(
        "--relay-fd", type=int, metavar="FD", help="serve behind boxd-init on this socket fd"
    )
    parser.add_argument("--port", default=P.PORT_NAME, help="virtio-serial port name")
    parser.add_argument("--stdio", action="store_true", help="serve on stdin/stdout (gVisor)")
    parser.add_argument(
        "--host-clock", action="store_true",
        help="the clock is the host's (gVisor): identity leaves it alone",
    )
    parser.add_argument("--default-cwd", default=P.DEFAULT_CWD)
    parser.add_argument(
        "--sysroot", help="tests: identity writes /etc files here, skips kernel calls"
    )
    return parser.parse_args(argv)


def secure_machine_dir() -> None:
    """The machine's own directory (identity, the API socket and credential, the client):
    0755 root. A gVisor sandbox makes it 0777 as the mount point of the client's bind
    mount, so any guest user could plant files in it. boxd-init does this first where it
    is PID 1; here for agent.py as PID 1 (no C compiler)."""
    try:
        if os.stat(P.IDENTITY_DIR).st_uid == 0:
            os.chmod(P.IDENTITY_DIR, 0o755)
    except OSError as exc:
        log(f"cannot make {P.IDENTITY_DIR} 0755: {exc}")


def open_channel(args: argparse.Namespace) -> Channel:
    """The channel to the host the arguments name (the virtio port by default)."""
    if args.relay_fd is not None:
        return RelayChannel(args.relay_fd)
    if args.stdio:
        return StdioChannel()
    if args.connect:
        return SocketChannel(args.connect)
    return VirtioChannel(args.port)


def main(argv: list[str] | None = None) -> None:
    args_in = sys.argv[1:] if argv is None else argv
    if len(args_in) == 2 and args_in[0] == "--dial" and args_in[1].isdigit():
        sys.exit(dial(int(args_in[1])))
    args = parse_args(argv)

    pid1 = os.getpid() == 1
    if pid1 or args.relay_fd is not None:
        # PID 1 (or the agent behind it) must survive stray TERM/INT (`pkill python3` in a
        # guest). A no-op handler (not SIG_IGN) so that commands we start get the default
        # disposition back on exec.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)
    if not pid1:
        set_subreaper()
    if args.sysroot is None and os.path.isdir(P.IDENTITY_DIR):
        secure_machine_dir()
    agent = Agent(open_channel(args), args)
    log(f"boxd agent {P.PROTOCOL_VERSION} started (pid {os.getpid()})")
    while True:
        try:
            agent.serve()
        except KeyboardInterrupt:
            if not pid1:
                raise
        except Exception:
            log(f"serve loop crashed; restarting:\n{traceback.format_exc()}")
            time.sleep(0.1)


if __name__ == "__main__":
    main()
