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
import hashlib
import json
import os
import queue
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

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


# --------------------------------------------------------------------------- agent


class Exec:
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
        self.outbox: queue.Queue[bytes | None] = queue.Queue()  # host -> guest; None: EOF
        self.closed = False
        self.announced = False  # a host saw its relay_open

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.outbox.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class Agent:
    def __init__(self, channel: Channel, args: argparse.Namespace) -> None:
        self.channel = channel
        self.args = args
        self.started = time.time()
        self.conn: str | None = None  # nonce of the current host connection
        self.reaper = Reaper()
        self.lock = threading.Lock()
        self.execs: dict[int, Exec] = {}
        self.writes: dict[int, FileWrite] = {}
        self.reads: dict[int, Window] = {}
        # The in-guest API socket (1.5): the current relay request (id, connection), the
        # listening socket and the relayed streams of the current relay.
        self.relay: tuple[int, str | None] | None = None
        self.relay_listener: socket.socket | None = None
        self.relay_streams: dict[int, RelayStream] = {}
        self.relay_next = 1

    # ---- output

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

    # ---- input

    def serve(self) -> None:
        buf = bytearray()
        while True:
            data = self.channel.read()
            if not data:
                # Host went away: a partial line can never complete; its requests are orphaned.
                buf.clear()
                self.conn = None
                self.abort_stale_writes()
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
            if isinstance(nonce, str) and nonce != self.conn:
                self.conn = nonce
                self.abort_stale_writes()
        conn = self.conn
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        try:
            if handler is None:
                raise RequestError(P.ERR_UNKNOWN_OP, f"unknown operation {op!r}")
            if not isinstance(req_id, int):
                raise RequestError(P.ERR_INVALID, "request id must be an integer")
            handler(req_id, conn, msg)
        except RequestError as exc:
            self.fail(req_id, conn, exc)
        except OSError as exc:
            self.fail(req_id, conn, os_error(exc))
        except Exception as exc:
            log(f"{op} failed:\n{traceback.format_exc()}")
            self.fail(req_id, conn, RequestError(P.ERR_INTERNAL, f"{type(exc).__name__}: {exc}"))

    def spawn_thread(self, name: str, fn: Any, *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            except Exception:
                log(f"{name} thread crashed:\n{traceback.format_exc()}")

        threading.Thread(target=run, name=name, daemon=True).start()

    # ---- hello / ping

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
        self.reply(
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
        self.reply(req_id, conn, time=time.time())

    def op_sync(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        # In this thread, not a `sync` process: a fork template captured right after
        # leaves no exiting process or thread behind for every child to finish.
        os.sync()
        self.reply(req_id, conn)

    # ---- exec

    def op_exec(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
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
        cwd = msg.get("cwd")
        if isinstance(cwd, str) and "\0" in cwd:
            raise RequestError(P.ERR_INVALID, "cwd must not contain NUL bytes", field="cwd")
        if cwd is None:
            cwd = self.args.default_cwd
            try:
                os.makedirs(cwd, exist_ok=True)
            except OSError as exc:
                log(f"cannot create default cwd {cwd}: {exc}")
                cwd = "/"
        elif not isinstance(cwd, str):
            raise RequestError(P.ERR_INVALID, "cwd must be a string")
        elif not os.path.isdir(cwd):
            code = P.ERR_NOT_DIR if os.path.exists(cwd) else P.ERR_NOT_FOUND
            raise RequestError(code, f"working directory does not exist: {cwd}", path=cwd)
        timeout = msg.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise RequestError(P.ERR_INVALID, "timeout must be a positive number")
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
        self.spawn_thread(
            f"exec-{req_id}",
            self.run_exec,
            ex,
            argv,
            env,
            cwd,
            timeout,
            stdin_data is not None or ex.stream_stdin,
        )

    def run_exec(
        self,
        ex: Exec,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        timeout: float | None,
        want_stdin: bool,
    ) -> None:
        try:
            self._run_exec(ex, argv, env, cwd, timeout, want_stdin)
        except Exception as exc:
            # Never leave the host waiting: an exec that fails before its result is
            # answered with an error (after a result, the failure is only logged).
            log(f"exec {ex.id} failed:\n{traceback.format_exc()}")
            if not ex.done:
                ex.done = True
                self.fail(ex.id, ex.conn, RequestError(
                    P.ERR_INVALID if isinstance(exc, ValueError) else P.ERR_INTERNAL,
                    f"{type(exc).__name__}: {exc}"))
        finally:
            ex.done = True
            with self.lock:
                self.execs.pop(ex.id, None)

    def _run_exec(
        self,
        ex: Exec,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        timeout: float | None,
        want_stdin: bool,
    ) -> None:
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if want_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            # Behave like a shell: 127 for "not found", 126 for "cannot execute".
            code = 127 if exc.errno == errno.ENOENT else 126
            text = f"boxd-agent: {argv[0]}: {exc.strerror}\n".encode()
            self.send({"id": ex.id, "ev": P.EV_STDERR, "data": b64e(text)}, ex.conn)
            self.reply(
                ex.id,
                ex.conn,
                exit_code=code,
                signal=None,
                timed_out=False,
                duration=time.monotonic() - start,
            )
            return
        done_event, status_box = self.reaper.register(proc.pid, start)
        ex.proc = proc
        with self.lock:
            ex.pgid = proc.pid
            early_signal = ex.pending_signal
        if early_signal:
            self.killpg(ex.pgid, early_signal)
        self.send({"id": ex.id, "ev": P.EV_STARTED, "pid": proc.pid}, ex.conn)
        if proc.stdin is not None:
            self.spawn_thread(f"stdin-{ex.id}", self.feed_stdin, ex, proc.stdin)

        assert proc.stdout is not None and proc.stderr is not None
        pipes = {proc.stdout.fileno(): P.EV_STDOUT, proc.stderr.fileno(): P.EV_STDERR}
        for fd in pipes:
            os.set_blocking(fd, False)
        poller = select.poll()
        for fd in pipes:
            poller.register(fd, select.POLLIN)
        deadline = start + timeout if timeout is not None else None
        timed_out = False
        exited_at: float | None = None
        last_data = time.monotonic()
        while pipes:
            now = time.monotonic()
            if exited_at is None and done_event.is_set():
                exited_at = now
            if exited_at is not None and drain_over(now, last_data, exited_at):
                break  # background children still hold the pipes: don't wait for them
            if deadline is not None and not timed_out and now >= deadline:
                timed_out = True
                self.killpg(ex.pgid, signal.SIGKILL)
            if ex.stream_stdin and ex.conn != self.conn:
                # Nobody follows it (a fork child, a restore, a reconnect): its output
                # waits in the pipes for the host that re-attaches (1.4; the command
                # waits too once a pipe is full). Other execs are read and dropped.
                done_event.wait(0.05)
                continue
            wait = 0.05 if exited_at is not None or deadline is not None else 0.2
            if ex.window.full():
                # The host has not taken what was sent: stop reading the pipes (the
                # command blocks on a full pipe) until it acknowledges. A pause is not
                # silence: the drain limits after the exit count from its end.
                ex.window.wait(wait)
                last_data = time.monotonic()
                if exited_at is not None:
                    exited_at = last_data
                if ex.conn != self.conn:
                    # Its host is gone: nobody will acknowledge. Stop waiting for acks
                    # (output is dropped from now on, as for any gone connection).
                    ex.window.size = 0
                continue
            for fd, _ in poller.poll(wait * 1000):
                try:
                    data = os.read(fd, P.EXEC_CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    poller.unregister(fd)
                    del pipes[fd]
                    continue
                last_data = time.monotonic()
                ex.window.sent += len(data)
                self.send({"id": ex.id, "ev": pipes[fd], "data": b64e(data)}, ex.conn)
        # Pipes closed (or given up on): now wait for the exit status, still honouring timeout.
        while not done_event.wait(0.05):
            if deadline is not None and not timed_out and time.monotonic() >= deadline:
                timed_out = True
                self.killpg(ex.pgid, signal.SIGKILL)
        if timed_out:
            # The whole group dies, not only the leader.
            self.killpg(ex.pgid, signal.SIGKILL)
        status = status_box[0]
        # The reaper collected the status; tell Popen so it never waits on its own.
        proc.returncode = os.waitstatus_to_exitcode(status)
        for f in (proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                f.close()
        ex.stdin_q.put(None)
        sig: int | None = None
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            exit_code = 128 + sig
        else:
            exit_code = os.WEXITSTATUS(status)
        ex.done = True  # before the reply: a stdin/kill sent right after it gets ESRCH
        self.reply(
            ex.id,
            ex.conn,
            exit_code=exit_code,
            signal=sig,
            timed_out=timed_out,
            duration=round(time.monotonic() - start, 6),
        )

    @staticmethod
    def killpg(pgid: int, sig: int) -> bool:
        try:
            os.killpg(pgid, sig)
            return True
        except OSError:
            return False

    def feed_stdin(self, ex: Exec, pipe: Any) -> None:
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
        self.send({"id": req_id, "ev": P.EV_STARTED, "pid": pid, "attached": True}, conn)

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
            self.reply(req_id, conn, size=len(data))

    def op_kill(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        ex = self.find_exec(msg)
        sig = msg.get("signal", signal.SIGKILL)
        if not isinstance(sig, int):
            raise RequestError(P.ERR_INVALID, "signal must be an integer")
        with self.lock:
            pgid = ex.pgid
            if not pgid:
                ex.pending_signal = sig  # delivered as soon as the process exists
        delivered = self.killpg(pgid, sig) if pgid else True
        self.reply(req_id, conn, delivered=delivered)

    def op_ack(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """The host consumed ``bytes`` bytes of request ``req``'s output (1.3)."""
        target, total = msg.get("req"), msg.get("bytes")
        if not isinstance(target, int) or not isinstance(total, int):
            raise RequestError(P.ERR_INVALID, "ack needs integer req and bytes")
        with self.lock:
            ex = self.execs.get(target)
            window = ex.window if ex is not None else self.reads.get(target)
        if window is not None:
            window.ack(total)
        self.reply(req_id, conn, known=window is not None)

    def op_cancel(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """Stop the read ``req``: its host went away (1.3)."""
        target = msg.get("req")
        with self.lock:
            window = self.reads.get(target) if isinstance(target, int) else None
        if window is not None:
            window.cancel()
        self.reply(req_id, conn, cancelled=window is not None)

    # ---- files

    def op_stat(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        path = self.path_arg(msg)
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
        self.reply(
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

    @staticmethod
    def path_arg(msg: dict[str, Any]) -> str:
        path = msg.get("path")
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
            raise RequestError(P.ERR_INVALID, f"path must be absolute: {path!r}", path=path)
        return path

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
        path = self.path_arg(msg)
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
        parent = os.path.dirname(path) or "/"
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f".{os.path.basename(path)}.boxd-{os.getpid()}-{req_id}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
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
        self.reply(
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
        with self.lock:
            stale = [(k, w) for k, w in self.writes.items() if w.conn != self.conn]
            for k, _ in stale:
                del self.writes[k]
        for _, w in stale:
            if not w.failed:
                w.failed = True
                with contextlib.suppress(OSError):
                    os.close(w.fd)
                with contextlib.suppress(OSError):
                    os.unlink(w.tmp)

    @staticmethod
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

    def op_read(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        path = self.path_arg(msg)
        window = window_arg(msg)
        try:
            # Refuse devices and fifos before opening them: /dev/zero never ends, and
            # opening a fifo blocks until a writer comes. O_NONBLOCK covers a swap
            # between the stat and the open; fstat checks what was opened.
            self.check_regular(path, os.stat(path))
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise os_error(exc, path) from exc
        try:
            st = os.fstat(fd)
            self.check_regular(path, st)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        f = os.fdopen(fd, "rb")
        with self.lock:
            self.reads[req_id] = window
        self.spawn_thread(f"read-{req_id}", self.stream_file, req_id, conn, path, f, st)

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
                    while window.full() and not window.cancelled and conn == self.conn:
                        window.wait(0.5)  # the host has not taken what was sent yet
                    if window.cancelled or conn != self.conn:
                        return  # the host that asked is gone: read no further
                    chunk = f.read(P.FILE_CHUNK)
                    if not chunk:
                        break
                    sha.update(chunk)
                    msg = {"id": req_id, "ev": P.EV_DATA, "offset": size, "data": b64e(chunk)}
                    size += len(chunk)
                    window.sent = size
                    self.send(msg, conn)
        except OSError as exc:
            self.fail(req_id, conn, os_error(exc, path))
            return
        finally:
            with self.lock:
                self.reads.pop(req_id, None)
        self.reply(
            req_id,
            conn,
            path=path,
            size=size,
            mode=stat.S_IMODE(st.st_mode),
            sha256=sha.hexdigest(),
        )

    # ---- identity

    def op_identity(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """New identity after a fork/restore. Touches kernel and /etc state, no process state."""
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
        api_key = msg.get("api_key")
        if api_key is not None:
            self.write_api_key(api_key)  # 1.5: validated first, so nothing half-applied
        sysroot = self.args.sysroot  # tests: write files under it, skip kernel calls
        done: list[str] = []
        if now is not None and not self.args.host_clock:
            if not sysroot:
                time.clock_settime(time.CLOCK_REALTIME, float(now))
            done.append("clock")
        if seed:
            self.reseed(seed, real=not sysroot)
            done.append("rng")
        if hostname is not None:
            if not sysroot:
                socket.sethostname(hostname)
            self.write_identity(sysroot, "hostname", hostname + "\n", 0o644)
            done.append("hostname")
        if machine_id is not None:
            self.write_identity(sysroot, "machine-id", machine_id + "\n", 0o444)
            done.append("machine_id")
        if api_key is not None:
            done.append("api_key")
        self.reply(req_id, conn, applied=done)

    # ---- the in-guest API socket (1.5)

    def relay_dir(self) -> str:
        return os.path.join(self.args.sysroot or "/", P.IDENTITY_DIR.lstrip("/"))

    def write_api_key(self, key: Any) -> None:
        if not isinstance(key, str) or not key or not key.isprintable() or len(key) > 256 \
                or " " in key:
            raise RequestError(P.ERR_INVALID, "the key must be a short printable string")
        base = self.relay_dir()
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

    def op_relay_listen(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """Serve the API socket for this connection, with a new credential (docs/lifecycle.md).

        Writes the key to tmpfs, (re)binds the socket once, ends every stream of an earlier
        relay (a fork child's or restored guest's copy of a call in flight) — or, with
        ``keep``, moves them to this one (the host replaced the VM process under the same
        guest) — and answers ``started``; the request then lasts as long as the host
        connection.
        """
        base = self.relay_dir()
        self.write_api_key(msg.get("key"))
        keep = msg.get("keep") or []
        if not isinstance(keep, list) or not all(isinstance(i, int) for i in keep):
            raise RequestError(P.ERR_INVALID, "keep must be a list of stream ids")
        with self.lock:
            # Kept: those the host names (it saw them open) and those no host has seen (a
            # guest process that connected while no host served the socket).
            old = [st for st in self.relay_streams.values()
                   if st.id not in keep and st.announced]
            for stream in old:
                del self.relay_streams[stream.id]
            for stream in self.relay_streams.values():
                stream.relay_id, stream.conn = req_id, conn
            self.relay = (req_id, conn)
        for stream in old:
            stream.close()
        if self.relay_listener is None:
            sock_path = os.path.join(base, P.API_SOCKET)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock_path)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            old_umask = os.umask(0o177)  # born 0600: the guest's root only, like the key
            try:
                listener.bind(sock_path)
            finally:
                os.umask(old_umask)
            listener.listen(64)
            self.relay_listener = listener
            self.spawn_thread("relay-accept", self.relay_accept, listener)
        self.send({"id": req_id, "ev": P.EV_STARTED}, conn)

    def relay_accept(self, listener: socket.socket) -> None:
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
                    stream = RelayStream(relay[0], relay[1], self.relay_next, sock)
                    self.relay_next += 1
                    self.relay_streams[stream.id] = stream
            if stream is None:
                sock.close()
                continue
            if not self.relay_event(stream, {"ev": P.EV_RELAY_OPEN}):
                self.relay_end(stream)
                continue
            stream.announced = True
            self.spawn_thread("relay-in", self.relay_reader, stream)
            self.spawn_thread("relay-out", self.relay_writer, stream)

    def relay_event(self, stream: RelayStream, msg: dict[str, Any]) -> bool:
        """Send one event of a stream on its relay's connection. While that connection is
        gone (a RAM swap: the host moves the stream to its next relay), wait a little."""
        deadline = time.monotonic() + RELAY_MOVE_WAIT
        while not stream.closed:
            if self.send({"id": stream.relay_id, "stream": stream.id, **msg}, stream.conn):
                return True
            if time.monotonic() > deadline:
                break
            time.sleep(RETRY_SLEEP)
        return False

    def relay_reader(self, stream: RelayStream) -> None:
        """Guest client -> host: ``relay_data`` events, then ``relay_eof``."""
        while True:
            try:
                data = stream.sock.recv(P.EXEC_CHUNK)
            except OSError:
                data = b""
            if stream.closed:
                return
            if not data:
                self.relay_event(stream, {"ev": P.EV_RELAY_EOF})
                return
            if not self.relay_event(stream, {"ev": P.EV_RELAY_DATA, "data": b64e(data)}):
                self.relay_end(stream)
                return

    def relay_writer(self, stream: RelayStream) -> None:
        """Host -> guest client, off the serve loop (a client that stops reading blocks
        only its own stream)."""
        while True:
            data = stream.outbox.get()
            if data is None or stream.closed:
                return
            if not data:  # the host's end of the request stream
                with contextlib.suppress(OSError):
                    stream.sock.shutdown(socket.SHUT_WR)
                continue
            try:
                stream.sock.sendall(data)
            except OSError:
                self.relay_end(stream)
                return

    def relay_end(self, stream: RelayStream) -> None:
        with self.lock:
            if self.relay_streams.get(stream.id) is stream:
                del self.relay_streams[stream.id]
        stream.close()

    def op_relay_send(self, req_id: int, conn: str | None, msg: dict[str, Any]) -> None:
        """Host -> guest bytes of one stream (``data``), its EOF (``eof``) or its end
        (``close``). Carries the relay request's id; never answered."""
        with self.lock:
            stream = self.relay_streams.get(msg.get("stream"))  # type: ignore[arg-type]
        if stream is None or stream.relay_id != req_id:
            return  # a stream that ended meanwhile, or of an older relay
        data = b64d(msg.get("data"))
        if data:
            stream.outbox.put(data)
        if msg.get("eof"):
            stream.outbox.put(b"")
        if msg.get("close"):
            self.relay_end(stream)

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
        (Guests with boxd-init do identity in C; this is the standalone agent's path.)
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


def main(argv: list[str] | None = None) -> None:
    args_in = sys.argv[1:] if argv is None else argv
    if len(args_in) == 2 and args_in[0] == "--dial" and args_in[1].isdigit():
        sys.exit(dial(int(args_in[1])))
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
    args = parser.parse_args(argv)

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
        # The machine's own directory (identity, the API socket and credential, the
        # client): 0755 root. A gVisor sandbox makes it 0777 as the mount point of the
        # client's bind mount, so any guest user could plant files in it. boxd-init does
        # this first where it is PID 1; here for agent.py as PID 1 (no C compiler).
        try:
            if os.stat(P.IDENTITY_DIR).st_uid == 0:
                os.chmod(P.IDENTITY_DIR, 0o755)
        except OSError as exc:
            log(f"cannot make {P.IDENTITY_DIR} 0755: {exc}")
    channel: Channel
    if args.relay_fd is not None:
        channel = RelayChannel(args.relay_fd)
    elif args.stdio:
        channel = StdioChannel()
    elif args.connect:
        channel = SocketChannel(args.connect)
    else:
        channel = VirtioChannel(args.port)
    agent = Agent(channel, args)
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
