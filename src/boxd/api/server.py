"""The daemon: one per data directory, serving the API on a unix socket (and maybe TCP).

``serve(paths)`` locks the data directory, opens the state database, builds the
services, writes the local key file (docs/auth.md) and runs uvicorn until SIGTERM or
SIGINT. Logs go to ``paths.log`` as JSON lines, never to the terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import uvicorn
from fastapi import FastAPI

from boxd import models
from boxd.api.app import create_app
from boxd.api.guest import GuestRelay
from boxd.api.routes.system import version
from boxd.api.services.images import ImageService
from boxd.api.services.keys import KeyService
from boxd.config import Paths, Settings
from boxd.console.app import create_console_app
from boxd.console.login import url_file as console_url_file
from boxd.control import build_services, netpolicy
from boxd.e2b.app import WS_MAX_MESSAGE, create_e2b_app
from boxd.e2b.env import url_file
from boxd.errors import Conflict, HostSetupError, InvalidRequest
from boxd.images import images_in_use
from boxd.services import HostInfoFn, MachineService, ProcessService, SnapshotService
from boxd.state import Database, Repos
from boxd.storage import SnapshotStore
from boxd.storage.fds import OwnedFd
from boxd.storage.reports import ReportStore

#: Seconds the daemon keeps an idle HTTP connection open. Longer than any client's own
#: idle expiry (the SDK's 5 s, browsers' 60 s), so the client always closes first: with
#: uvicorn's default of 5 s, both ends timed out together and a request sent on a pooled
#: connection as the daemon closed it got no answer ("Server disconnected").
KEEP_ALIVE_SECONDS = 75

__all__ = ["Daemon", "local_key_path", "serve", "write_local_key"]

log = logging.getLogger("boxd.daemon")

_LOGGERS = ("boxd", "uvicorn", "uvicorn.error", "uvicorn.access")
_RECORD_FIELDS = set(logging.makeLogRecord({}).__dict__) | {
    "message", "asctime", "color_message"
}


class JsonLineFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, extra fields, traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        # Structured fields passed with extra={...} go first after the header (machine id
        # first when present), then the message.
        extra = {k: v for k, v in record.__dict__.items() if k not in _RECORD_FIELDS}
        if "machine" in extra:
            line["machine"] = extra.pop("machine")
        line["msg"] = record.getMessage()
        line.update(extra)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


_SECRET_QUERY = re.compile(r"((?:^|[?&])token=)[^&\s\"]*")


class RedactTokens(logging.Filter):
    """Keep the console's one-time login tokens (``/login?token=...``) out of the access
    log: a request line's ``token=`` value is written as ``<redacted>``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.access" and isinstance(record.args, tuple):
            record.args = tuple(_SECRET_QUERY.sub(r"\1<redacted>", a)
                                if isinstance(a, str) else a for a in record.args)
        return True


def setup_logging(path: Path) -> logging.Handler:
    """Send boxd's and uvicorn's logs (access log included) to ``path`` only.

    Returns:
        The handler, so that the caller can remove it again.
    """
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(JsonLineFormatter())
    handler.addFilter(RedactTokens())
    # BOXD_LOG_LEVEL=debug adds per-phase timings (fork, start, capture) to the log.
    level = logging.getLevelName(Settings.from_env().log_level.upper())
    if not isinstance(level, int):
        level = logging.INFO
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [h for h in logger.handlers if not isinstance(h, logging.FileHandler)]
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False  # keep the terminal quiet
    return handler


def local_key_path(paths: Paths) -> Path:
    """Where the local account's default key lives: ``<data dir>/local.key``."""
    return paths.home / "local.key"


def write_local_key(path: Path, secret: str) -> None:
    """Write a secret to ``path`` atomically (temp file, fsync, rename) with mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with OwnedFd.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) as fd:
        os.fchmod(fd.fd, 0o600)  # in case the file existed with wider bits
        os.write(fd.fd, (secret + "\n").encode())
        os.fsync(fd.fd)
    os.replace(tmp, path)
    with OwnedFd.open(path.parent, os.O_RDONLY) as dir_fd:
        os.fsync(dir_fd.fd)


def _read_local_key(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except (FileNotFoundError, PermissionError, UnicodeDecodeError):
        return None


def _image_service(paths: Paths, machines: object) -> ImageService:
    """The image store; with the control plane's records, removing an image also
    collects its unpacked trees and disks once no machine or snapshot runs it."""
    repos, store = getattr(machines, "repos", None), getattr(machines, "store", None)
    if not isinstance(repos, Repos) or not isinstance(store, SnapshotStore):
        return ImageService(paths.images_store)  # a test's stand-in service

    def in_use() -> set[str]:
        return images_in_use(repos, store)

    async def on_nodes(keep: Callable[[], set[str]]) -> int:
        """On a cluster: each live node collects its copies of images ``keep()`` does
        not name (`ClusterNode.collect_images`)."""
        cluster = getattr(machines, "cluster", None)
        if cluster is None:
            return 0
        removed = 0
        for node in [n for n in cluster.nodes.values() if n.alive]:
            try:
                removed += await node.collect_images(keep)
            except Exception as exc:  # the name is gone: the node collects at the next one
                log.warning("node=%s event=images_not_collected error=%r", node.id, exc)
        return removed

    return ImageService(paths.images_store, in_use=in_use, on_nodes=on_nodes,
                        unpacked=(paths.image_roots, paths.image_disks))


def _fallback_host_info(paths: Paths) -> Callable[[], models.HostInfo]:
    def host_info() -> models.HostInfo:
        return models.HostInfo(
            version=version(), engine="none", qemu="", qemu_version="", accelerator="none",
            accelerator_reason="no engine is wired into this daemon", cpu_model="",
            data_dir=str(paths.home),
        )

    return host_info


def _parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidRequest(
            f"cannot listen on {listen!r}", hint="use HOST:PORT, e.g. 127.0.0.1:7070",
            field="listen",
        )
    return host.strip("[]"), int(port)


# Connections the kernel queues before the daemon accepts them (capped by
# net.core.somaxconn). 128 was too few: 300 clients connecting at once while the event
# loop was busy overflowed it, and then a unix-socket connect fails at once (EAGAIN) and
# a TCP one has its handshake dropped: retried after 1, 3, 7, 15, 31 s (the p99 of 52 s)
# or reset once the client had sent its request.
BACKLOG = 4096


def _unix_socket(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # stale: we hold the data directory's lock, so nobody serves it
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # born 0600: no window where others could connect
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def _tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit these: a client whose host vanished without closing
    # (no FIN, no RST) is dropped after ~60 s of silence, its process streams freed.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    netpolicy.LISTENING.add(sock.getsockname()[1])  # never a machine's expose_host port
    return sock


def _lock_data_dir(paths: Paths) -> OwnedFd:
    """Take the data directory's lock; the lock file's descriptor, which holds it.

    Raises:
        Conflict: another daemon holds it.
    """
    fd = OwnedFd.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        fd.close()
        raise Conflict(
            "a boxd daemon already serves this data directory",
            hint=f"use it (socket {paths.socket}) or stop it; pid in {paths.lock}",
        ) from exc
    return fd


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the caught signal at exit.

    uvicorn re-raises SIGTERM/SIGINT after shutting down, which would kill the process
    before the daemon detaches from its machines; we exit normally instead.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT,
                                                                     signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _uvicorn_server(app: FastAPI) -> _Server:
    """The HTTP server for ``app`` (its sockets are given to it when it runs)."""
    return _Server(
        uvicorn.Config(
            app, log_config=None, access_log=True, proxy_headers=False,
            timeout_graceful_shutdown=10, timeout_keep_alive=KEEP_ALIVE_SECONDS,
            # Fixed, whatever else is installed: h11 for HTTP, websockets'
            # Sans-I/O protocol for WebSockets. No keepalive pings: the Python
            # SDK drives a process stream from the caller's thread and answers
            # only while it reads (an idle RL env would be dropped after 40 s);
            # a vanished client is seen by its socket closing, or over TCP by
            # the listening socket's keepalive (`_tcp_socket`).
            http="h11", ws="websockets-sansio", ws_ping_interval=None,
        )
    )


class _QuietServer(_Server):
    """A second server in the same process (the E2B listener): the first one handles
    the signals and stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _side_listen(value: str, env: str) -> tuple[str, int] | None:
    """Where a second listener (``BOXD_E2B_LISTEN``, ``BOXD_CONSOLE_LISTEN``) listens,
    or None when it is ``off``."""
    if value.lower() == "off":
        return None
    try:
        return _parse_listen(value)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{env}: {exc.message}", hint="use HOST:PORT (port 0: "
                             "any free one) or off", field=env) from exc


def _side_config(app: Any, ws: str) -> uvicorn.Config:
    # WebSockets (the E2B side's, relayed to guest ports): websockets' Sans-I/O protocol
    # as the main API's; no keepalive pings of the listener's own (the relay answers
    # each side's pings where they arrive); messages up to the relay's bound; and no
    # permessage-deflate: the relay passes what the guest's server sends (which
    # compresses what it wants: noVNC's encodings do), and compressing it again would
    # run zlib over every message in the daemon's event loop.
    return uvicorn.Config(
        app, log_config=None, access_log=True, proxy_headers=False,
        timeout_graceful_shutdown=10, timeout_keep_alive=KEEP_ALIVE_SECONDS,
        http="h11", ws=ws, ws_ping_interval=None, ws_max_size=WS_MAX_MESSAGE,
        ws_per_message_deflate=False,
    )


@dataclass
class _Side:
    """A second front door on its own loopback TCP listener (E2B's API, the console)."""

    what: str
    env: str
    listen: tuple[str, int] | None
    url_path: Path
    server: _QuietServer
    before_stop: Callable[[], None] | None = None


@dataclass
class _Running:
    side: _Side
    task: asyncio.Task[None]
    sock: socket.socket


class Daemon:
    """A prepared daemon: data directory locked, services built, key file written.

    ``serve()`` is ``Daemon(...).run()``; tests build one directly to stop it by hand.
    """

    def __init__(
        self,
        paths: Paths,
        *,
        listen: str | None = None,
        machines: MachineService | None = None,
        snapshots: SnapshotService | None = None,
        host_info: HostInfoFn | None = None,
    ) -> None:
        """Lock the data directory and prepare everything short of listening.

        Raises:
            Conflict: another daemon serves this data directory.
            InvalidRequest: ``listen`` is not ``HOST:PORT``.
        """
        self.paths = paths
        self.tcp = _parse_listen(listen) if listen else None
        paths.ensure()
        self._lock_fd = _lock_data_dir(paths)
        try:
            os.ftruncate(self._lock_fd.fd, 0)
            os.write(self._lock_fd.fd, f"{os.getpid()}\n".encode())
            self._log_handler = setup_logging(paths.log)
            self.db = Database(paths.db)
            self.keys = KeyService(self.db)
            settings = Settings.from_env()
            if machines is None or snapshots is None:
                built_m, built_s, built_info = build_services(paths, self.db)
                machines = machines or built_m
                snapshots = snapshots or built_s
                host_info = host_info or built_info
            self.machines = machines
            self.snapshots = snapshots
            self.reports = ReportStore(paths.home / "reports")
            self.images = _image_service(paths, machines)
            key_file = local_key_path(paths)
            secret = self.keys.ensure_default_local_key(os.getuid(), _read_local_key(key_file))
            write_local_key(key_file, secret)
            self.app = self._create_app(settings, host_info or _fallback_host_info(paths))
            self.server = _uvicorn_server(self.app)
            # E2B's API (docs/e2b.md) and the web console (docs/console.md), each on its
            # own loopback TCP listener, over the same services.
            self.e2b = self._e2b_side(settings)
            self.console = self._console_side(settings)
            # Each non-isolated machine's /run/boxd/boxd.sock, relayed to this app.
            serve_guests = getattr(machines, "serve_guests", None)
            if serve_guests is not None:
                serve_guests(GuestRelay(self.server))
        except BaseException:
            self._unlock()
            raise

    def _e2b_side(self, settings: Settings) -> _Side:
        listen = _side_listen(settings.e2b_listen, "BOXD_E2B_LISTEN")
        app = create_e2b_app(self.machines, self.keys.authenticate, self.paths.home / "e2b",
                             self.snapshots, domain=settings.e2b_domain or None)
        return _Side("e2b api", "BOXD_E2B_LISTEN", listen, url_file(self.paths.home),
                     _QuietServer(_side_config(app, ws="websockets-sansio")))

    def _console_side(self, settings: Settings) -> _Side:
        listen = _side_listen(settings.console_listen, "BOXD_CONSOLE_LISTEN")
        # The machine service serves processes too (as the API's process routes take it).
        processes = cast(ProcessService, self.machines)
        app = create_console_app(self.machines, self.snapshots, self.keys.authenticate,
                                 reports=self.reports, processes=processes,
                                 account_name=self.keys.account_name)
        console = app.state.console

        def end_streams() -> None:
            console.stopping = True  # live streams end, so its server stops at once

        return _Side("web console", "BOXD_CONSOLE_LISTEN", listen,
                     console_url_file(self.paths.home),
                     _QuietServer(_side_config(app, ws="none")), end_streams)

    def _create_app(self, settings: Settings, host_info: HostInfoFn) -> FastAPI:
        """The API over this daemon's services, with the limits ``settings`` give."""
        paths = self.paths
        return create_app(
            machines=self.machines,
            snapshots=self.snapshots,
            keys=self.keys,
            host_info=host_info,
            upload_dir=paths.home / "uploads",
            private_dirs=(paths.home, paths.shm),
            images=self.images,
            reports=self.reports,
            max_body=settings.max_body,
            max_upload=settings.max_upload,
            body_timeout=settings.body_timeout,
        )

    async def _start_side(self, side: _Side | None) -> _Running | None:
        """Bind a second listener (E2B, console), write its URL file and serve it."""
        if side is None:
            return None
        with contextlib.suppress(FileNotFoundError):
            side.url_path.unlink()
        if side.listen is None:
            return None
        try:
            sock = _tcp_socket(*side.listen)
        except OSError as exc:
            # boxd's own API still serves; the URL file's absence says this one is not.
            log.error("cannot listen for the %s on %s:%s (%s): %s", side.what,
                      *side.listen, side.env, exc)
            return None
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        write_local_key(side.url_path, url)  # atomic, 0600: the same as the key file
        log.info("%s listening", side.what, extra={"url": url})
        task = asyncio.create_task(side.server.serve(sockets=[sock]))
        return _Running(side, task, sock)

    async def _stop_side(self, running: _Running | None) -> None:
        if running is None:
            return
        side = running.side
        with contextlib.suppress(FileNotFoundError):
            side.url_path.unlink()
        if side.before_stop is not None:
            side.before_stop()
        side.server.should_exit = True
        try:
            await running.task
        except Exception:
            log.exception("the %s listener failed", side.what)
        finally:
            running.sock.close()

    def _unlock(self) -> None:
        with contextlib.suppress(OSError):
            self._lock_fd.close()  # once, however often the daemon stops

    def stop(self) -> None:
        """Ask a running daemon to shut down (thread-safe)."""
        self.server.should_exit = True

    async def run_async(self) -> None:
        """Serve until stopped, then detach from machines (they keep running)."""
        sockets = [_unix_socket(self.paths.socket)]
        if self.tcp:
            sockets.append(_tcp_socket(*self.tcp))
        log.info("daemon started", extra={"pid": os.getpid(), "socket": str(self.paths.socket),
                                          "tcp": self.tcp, "home": str(self.paths.home)})
        started = time.monotonic()
        running: list[_Running | None] = []
        collecting: asyncio.Task[int] | None = None
        try:
            # Find the VMs of machines recorded before a restart (they kept running).
            await self.machines.recover()
            # Unpacked images that machines deleted while it was down no longer need.
            collecting = asyncio.create_task(self.images.collect())
            for side in (self.e2b, self.console):
                running.append(await self._start_side(side))
            await self.server.serve(sockets=sockets)
        finally:
            if collecting is not None:
                collecting.cancel()
            for r in running:
                await self._stop_side(r)
            try:
                await self.machines.close()
            except Exception:
                log.exception("closing the machine service failed")
            for s in sockets:
                s.close()
            with contextlib.suppress(FileNotFoundError):
                self.paths.socket.unlink()
            self.db.close()
            log.info("daemon stopped", extra={"uptime": round(time.monotonic() - started, 3)})
            for name in _LOGGERS:
                logging.getLogger(name).removeHandler(self._log_handler)
            self._log_handler.close()
            self._unlock()

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT (uvicorn handles both)."""
        with event_loop_runner() as runner:
            runner.run(self.run_async())


def event_loop_runner(env: Mapping[str, str] | None = None) -> asyncio.Runner:
    """The daemon's event loop: uvloop where it is installed (the server extra brings
    it), else asyncio's own. ``BOXD_EVENT_LOOP=asyncio`` forces the latter.

    uvloop (libuv) takes about half the per-message cost off the daemon's sockets: a
    process stream's frame crosses two of them each way (docs/design.md).
    """
    choice = Settings.from_env(env).event_loop
    if choice not in ("auto", "uvloop", "asyncio"):
        raise InvalidRequest(f"BOXD_EVENT_LOOP={choice!r} is not auto, uvloop or asyncio",
                             field="BOXD_EVENT_LOOP")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise HostSetupError("BOXD_EVENT_LOOP=uvloop but uvloop is not installed",
                                     hint="pip install 'boxd[server]'") from None
        else:
            return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


def serve(
    paths: Paths,
    *,
    listen: str | None = None,
    machines: MachineService | None = None,
    snapshots: SnapshotService | None = None,
) -> None:
    """Run the boxd daemon for a data directory until SIGTERM or SIGINT.

    Args:
        paths: the data directory.
        listen: also serve on TCP at ``HOST:PORT`` (e.g. ``127.0.0.1:7070``).
        machines: the machine service (default: `boxd.control.build_services`).
        snapshots: the snapshot service (default: `boxd.control.build_services`).

    Raises:
        Conflict: another daemon serves this data directory.
        InvalidRequest: ``listen`` is not ``HOST:PORT``.
    """
    Daemon(paths, listen=listen, machines=machines, snapshots=snapshots).run()
