# Generated from _async.py by scripts/gen_sync.py: edit that file, then run it.
"""The synchronous client, ``Boxd``, generated from ``_async.py``.

The logic without I/O (requests, error mapping) lives in ``_base``.

One ``Boxd`` may be shared by many threads: ``httpx.Client`` is thread-safe, the pool
allows 64 concurrent connections, and the lazy connect (which may start the local
daemon) runs once under a lock.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, overload

import httpx

from boxd import errors
from boxd._lazy import LazyModule
from boxd.sdk import _base, _lineage, _local
from boxd.sdk._process_sync import ProcessHandle

if TYPE_CHECKING:
    from boxd import models
    from boxd import process_models as pm
else:  # built on first use: see boxd._lazy
    models = LazyModule("boxd.models")

__all__ = ["Boxd", "Checkpoints", "Files", "Keys", "Machines",
           "Snapshots"]

_CHUNK = 1 << 20


class Boxd:
    """Client of a boxd daemon.

    Args:
        api_key: API key; defaults to ``BOXD_API_KEY``, else the local daemon's key file.
        base_url: ``http://HOST:PORT`` of a daemon; defaults to ``BOXD_URL``, else the local
            daemon on its unix socket (started on first use if none runs).
        timeout: seconds for ordinary requests (exec has no read timeout; the command's
            own ``timeout`` applies). None waits forever.
        transport: an httpx transport to send every request through (e.g.
            ``httpx.ASGITransport(app)`` or ``httpx.MockTransport(handler)`` in tests);
            the local daemon is then neither started nor dialled. Process streams
            (``spawn``/``attach``) still open their WebSocket to ``base_url`` or the socket.

    Raises:
        InvalidRequest: ``base_url``/``BOXD_URL`` is not an http(s) URL.
    """

    def __init__(
        self,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: float | None = _base.DEFAULT_TIMEOUT,
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._target = _base.resolve_target(api_key, base_url)
        self._timeout = timeout
        self._transport = transport
        self._lock = threading.Lock()
        self._http: httpx.Client | None = None
        self._closed = False
        self.machines = Machines(self)
        self.snapshots = Snapshots(self)
        self.images = Images(self)
        self.keys = Keys(self)
        self.reports = Reports(self)
        self.accounts = Accounts(self)
        self.nodes = Nodes(self)

    def info(self) -> models.HostInfo:
        """Describe the host: engine, QEMU version, accelerator and why, data directory.

        Raises:
            BoxdError: the daemon refused the request; ConnectionError if unreachable.
        """
        return self._parse(models.HostInfo, _base.info())

    def close(self) -> None:
        """Close the connection pool. The daemon keeps running."""
        with self._lock:
            self._closed = True
            http, self._http = self._http, None
        if http is not None:
            http.close()

    def __enter__(self) -> Boxd:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Boxd({self._target.where!r})"

    # --- plumbing ---------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        http = self._http
        if http is not None:
            return http
        with self._lock:
            if self._closed:
                raise errors.ConnectionError("this Boxd client is closed")
            if self._http is None:
                t = self._target
                if self._dials_local():
                    _local.ensure_daemon(t.paths)
                key = t.api_key or (None if t.guest else _local.read_local_key(t.paths))
                transport = self._transport or httpx.HTTPTransport(
                    uds=str(t.uds) if t.uds is not None else None, limits=_base.limits()
                )
                self._http = httpx.Client(
                    base_url=t.base_url,
                    transport=transport,
                    headers=_base.headers(key),
                    auth=t.auth(),
                    timeout=_base.timeout_for(self._timeout, _base.DEFAULT),
                )
            return self._http

    def _dials_local(self) -> bool:
        """True when requests go to the local daemon's socket (which we may start)."""
        return self._target.local and self._transport is None

    def _build(
        self, req: _base.Req, content: Iterator[bytes] | None = None
    ) -> httpx.Request:
        return self._client().build_request(
            req.method,
            req.path,
            params=req.params or None,
            json=req.json,
            content=content if content is not None else req.content,
            timeout=_base.timeout_for(self._timeout, req.timeout),
            headers=req.headers or None,
        )

    def _send(
        self, req: _base.Req, *, stream: bool = False, content: Iterator[bytes] | None = None
    ) -> httpx.Response:
        try:
            try:
                request = self._build(req, content)
                return self._client().send(request, stream=stream)
            except httpx.ConnectError:
                # The local daemon may have stopped since we connected: start it and retry
                # once (safe: nothing was sent).
                if not self._dials_local() or content is not None:
                    raise
                _local.ensure_daemon(self._target.paths)
                request = self._build(req, content)
                return self._client().send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise _base.map_transport_error(exc, self._target) from exc

    def _call(self, req: _base.Req) -> bytes:
        resp = self._send(req)
        _base.raise_for_status(resp.status_code, resp.content)
        return resp.content

    def _parse(self, model: type[_base.M], req: _base.Req) -> _base.M:
        resp = self._send(req)
        return _base.parse(model, resp.status_code, resp.content)

    @contextlib.contextmanager
    def _stream(
        self, req: _base.Req, content: Iterator[bytes] | None = None
    ) -> Iterator[httpx.Response]:
        resp = self._send(req, stream=True, content=content)
        try:
            if not 200 <= resp.status_code < 300:
                try:
                    body = resp.read()
                except httpx.HTTPError as exc:
                    raise _base.map_transport_error(exc, self._target) from exc
                _base.raise_for_status(resp.status_code, body)
            yield resp
        finally:
            resp.close()


class Machines:
    """Machines: create, inspect, run commands in, fork and delete (``boxd.machines``)."""

    def __init__(self, client: Boxd) -> None:
        self._c = client
        self.files = Files(client)
        self.checkpoints = Checkpoints(client)

    def new(
        self,
        name: str | None = None,
        *,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        disk_gib: int | None = None,
        isolated: bool = False,
        from_snapshot: str | None = None,
        engine: str | None = None,
        suspend_after: float | None = None,
        hibernate_after: float | None = None,
        node: str | None = None,
        public: bool = False,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        timeout: int | None = None,
        on_timeout: str = "delete",
        image: str | None = None,
        wait: float = 0.0,
        service: bool = True,
        expose_host: Sequence[int] = (), egress: Sequence[str] | None = None,
    ) -> models.Machine:
        """Create and boot a machine; returns while it starts (see ``wait_until_ready``).

        Args:
            name: DNS-label name, unique per account; generated if None.
            vcpus, memory_mib, disk_gib: CPUs, MiB, GiB (None: the daemon's default).
            isolated: no network at all.
            from_snapshot: start from a snapshot (``NAME``, ``NAME@N`` or ``sha256:...``).
            engine: ``qemu`` or ``gvisor`` (the daemon's default if None; a snapshot
                starts on the engine it was saved on). ``info().engines`` lists them.
            suspend_after, hibernate_after: idle seconds before its vCPUs stop, before it
                goes to disk (0: never; None: the daemon's default).
            node: the cluster node to place it on (``nodes.list()``; None: most free).
            public: its URL needs no token: every local user reaches its port 8080.
            labels: to find it by (``list(labels=)``); its forks inherit them.
            idempotency_key: one per logical request, the same on its retries: a retry
                within 24 h returns the first request's machine; a failure frees it.
            timeout: its lifetime, whole seconds from now (1 to 30 days; ``end_at``,
                ``set_timeout``); kept across daemon restarts. None: until deleted.
            on_timeout: what its end does: ``"delete"`` or ``"hibernate"``.
            image: an image imported for this account (``NAME[:TAG]``, ``sha256:DIGEST``):
                its files are the root, its ENV, WORKDIR, USER exec's defaults (gVisor).
            wait: seconds to wait in the account's queue when its quota or the nodes'
                room is used up, instead of failing at once (docs/lifecycle.md).
            service: with ``image``, start its ENTRYPOINT + CMD (``logs`` reads it).
            expose_host: host loopback ports it reaches at ``host.boxd.internal:PORT``.
            egress: allow-list of its outbound connections (CIDRs, addresses, names, with
                ``:PORT``; ``[]``: none; None: public addresses). Both: docs/security.md.

        Raises:
            InvalidRequest, AlreadyExists, SnapshotNotFound, HostSetupError; NotFound
            (``image``); IdempotencyKeyReused (the key came with another request);
            QuotaExceeded: no room (after ``wait``: ``retry_after`` says when to retry).
        """
        return self._c._parse(models.Machine, _base.machine_create(
            name, vcpus, memory_mib, disk_gib, isolated, from_snapshot, engine,
            suspend_after, hibernate_after, node, public, labels, idempotency_key, timeout,
            on_timeout, image, wait, service, expose_host, egress))

    def set_timeout(
        self, ref: str, timeout: int | None, *, on_timeout: str | None = None,
    ) -> models.Machine:
        """Give a machine a new end, ``timeout`` whole seconds from now (1 to 30 days),
        extending or shortening its lifetime; None clears it (it runs until deleted).

        Args:
            ref: the machine's name or id.
            timeout: seconds from now, or None for no lifetime. 0 is refused, not taken
                as "never" or "now": delete it for that.
            on_timeout: ``"delete"`` or ``"hibernate"``; None keeps what its end did
                (``"delete"`` if it had no lifetime).

        Raises:
            InvalidRequest: ``timeout`` is not an int of 1 to 30 days of seconds, or a
                bad ``on_timeout``.
            MachineNotFound: no such machine.
        """
        return self._c._parse(models.Machine,
                                    _base.machine_set_timeout(ref, timeout, on_timeout))

    def get(self, ref: str) -> models.Machine:
        """The machine with this name or id.

        Raises:
            MachineNotFound: no such machine.
        """
        return self._c._parse(models.Machine, _base.machine_get(ref))

    def url(self, ref: str, port: int = 8080) -> str:
        """The machine's URL for a guest TCP port (`Machine.url_for`): its ``url`` for
        8080, ``http://127.0.0.1:PORT/TOKEN.N`` for port N. Any HTTP or WebSocket client
        uses it as given; a request through it wakes the machine and keeps it awake.

        Raises:
            MachineNotFound: no such machine.
            InvalidRequest: a port that is not an int or is outside 1-65535 (checked
                before the machine is looked up), an isolated machine, or another port
                of a public machine.
        """
        models.tcp_port(port)
        return (self.get(ref)).url_for(port)

    def list(
        self, *, labels: Mapping[str, str] | None = None, state: str | None = None,
    ) -> builtins.list[models.Machine]:
        """Every machine of this account (oldest first) that carries all of ``labels``
        and is in ``state`` (a `MachineState` value) if given; the pages are followed
        (`list_page` takes one at a time).

        Raises:
            InvalidRequest: a bad label or state.
            BoxdError: the daemon refused the request.
        """
        out: builtins.list[models.Machine] = []
        cursor: str | None = None
        while True:
            page = self.list_page(labels=labels, state=state, cursor=cursor)
            out.extend(page.machines)
            if page.next_cursor is None:
                return out
            cursor = page.next_cursor

    def list_page(
        self, *, labels: Mapping[str, str] | None = None, state: str | None = None,
        limit: int | None = None, cursor: str | None = None,
    ) -> models.MachineList:
        """One page of `list`: up to ``limit`` machines (the daemon's default if None,
        at most 1000) after ``cursor``, and ``next_cursor`` (None on the last page).

        Raises:
            InvalidRequest: a bad label, state, limit or cursor.
        """
        return self._c._parse(models.MachineList,
                                    _base.machine_list(labels, state, limit, cursor))

    def delete_many(
        self, labels: Mapping[str, str], *, state: str | None = None,
    ) -> models.MachinesDeleted:
        """Delete every machine that carries all of ``labels`` (and is in ``state`` if
        given): a crashed run's cleanup. One failure does not stop the others.

        Returns:
            ``MachinesDeleted``: ``deleted`` (id and name of each) and ``errors`` (each
            machine that could not be deleted, with its error).

        Raises:
            InvalidRequest: no label (an empty selector is refused), or a bad one.
        """
        return self._c._parse(models.MachinesDeleted,
                                    _base.machine_delete_many(labels, state))

    def lineage(self, ref: str | None = None) -> _lineage.Lineage:
        """Fork trees and snapshot lineage, built from the machine and snapshot lists.

        Args:
            ref: a machine name or id: only its subtree (and the snapshots saved from it
                or that it started from). None: every machine of this account.

        Returns:
            ``Lineage``: ``machines`` (root ``MachineNode``s, each with ``children``, the
            ``snapshots`` saved from it and the snapshot it started from) and
            ``snapshots`` (``SnapshotNode``s: version, source machine, machines started
            from it).

        Raises:
            MachineNotFound: no machine ``ref``.
        """
        machines, snapshots = self.list(), self._c.snapshots.list()
        if ref is None:
            return _lineage.build(machines, snapshots)
        target = self.get(ref)
        if target.id not in {m.id for m in machines}:  # made after the list: list again
            machines = self.list()
        return _lineage.build(machines, snapshots, target.id)

    def delete(self, ref: str) -> None:
        """Stop the machine and remove its files (its checkpoints die with it).

        Raises:
            MachineNotFound: no such machine.
        """
        self._c._call(_base.machine_delete(ref))

    def suspend(self, ref: str) -> models.Machine:
        """Stop the machine's vCPUs; memory stays resident; any request wakes it.

        Raises:
            MachineNotFound: no such machine.
            StateError: it is not running (hibernated, failed, ...).
        """
        return self._c._parse(models.Machine, _base.machine_lifecycle(ref, "suspend"))

    def hibernate(self, ref: str) -> models.Machine:
        """Write the machine's memory to disk and end its VM; any request wakes it.

        Raises:
            MachineNotFound: no such machine.
            StateError: it is neither running nor suspended.
        """
        return self._c._parse(models.Machine, _base.machine_lifecycle(ref, "hibernate"))

    def resume(self, ref: str) -> models.Machine:
        """Wake a suspended or hibernated machine (running: nothing to do).

        Raises:
            MachineNotFound: no such machine.
            MachineFailed: its image did not load (it is failed now).
            QuotaExceeded: waking a hibernated machine would exceed the account's limit.
        """
        return self._c._parse(models.Machine, _base.machine_lifecycle(ref, "resume"))

    def wait_until_ready(self, ref: str, timeout: float = 120.0) -> models.Machine:
        """Block until the machine's agent answers, then return the machine.

        Raises:
            MachineNotFound: no such machine.
            MachineFailed: the machine died or did not become ready within ``timeout``.
        """
        return self._c._parse(models.Machine, _base.machine_wait(ref, timeout))

    def exec(
        self,
        ref: str,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
        user: str | None = None,
        exec_id: str | None = None,
    ) -> models.ExecResult:
        """Run a command to completion and return its output and exit code.

        A non-zero exit code is a normal result, not an exception; a failure of the
        machine, its engine, agent or node is never an exit code but an
        `InfrastructureError`. The command runs on even if this call's connection is
        lost: pass ``exec_id`` to read its result later with :meth:`exec_result` (the
        result carries the id, generated when absent). A call with the id of an exec
        the machine still keeps does not run it again: it waits for that exec and
        returns its result.

        Args:
            ref: machine name or id.
            command: a shell string (run by ``/bin/sh -c``) or an argv list.
            env: extra environment variables.
            cwd: working directory in the guest.
            timeout: seconds after which the command is killed.
            stdin: text fed to the command's standard input.
            user: ``NAME[:GROUP]`` or ``UID[:GID]`` to run it as (the machine's
                /etc/passwd names it); default: the image's USER, else root.
            exec_id: the exec's id on the machine (letters, digits, ``_.-``, at most 128).

        Raises:
            ExecTimeout: the command ran past ``timeout`` (it got SIGTERM, then SIGKILL
                after a grace period); ``.stdout``/``.stderr`` hold the partial output.
            ExecIdConflict: ``exec_id`` is kept for another command on this machine.
            MachineNotFound.
            InfrastructureError: the machine, its engine, agent or node failed during
                the command (`MachineFailed`, `AgentLost`, `NodeLost`), or the daemon's
                connection was lost (`ConnectionError`): there is no exit status.
        """
        return self._c._parse(
            models.ExecResult,
            _base.machine_exec(ref, command, env, cwd, timeout, stdin, user, exec_id),
        )

    def exec_result(self, ref: str, exec_id: str, *, wait: float = 0.0) -> models.ExecStatus:
        """The output and exit status of an exec started with :meth:`exec`, running or
        finished, also after the connection that started it was lost.

        A running exec is waited for up to ``wait`` seconds; if it still runs, the answer
        has ``running=True`` and its output so far. Only the last MiB of each stream is
        kept (``stdout_truncated`` / ``stderr_truncated`` say when earlier output was
        dropped). Results are kept 15 minutes after the exec ends, the last 64 per
        machine, also across a daemon restart. An exec that failed without an exit
        status (its machine died) has ``error`` set; one that still ran when the daemon
        died has ``error`` with code ``agent_lost`` (its exit never reached the daemon).

        Raises:
            ExecNotFound: no exec of that id is kept for the machine.
            MachineNotFound.
        """
        return self._c._parse(
            models.ExecStatus, _base.machine_exec_result(ref, exec_id, wait))

    def execs(self, ref: str, *, limit: int = 20,
                    ) -> builtins.list[models.ExecSummary]:
        """The machine's last ``limit`` (at most 64) kept execs, newest first: each one's
        id, command, exit code (or ``running``, or ``error``), start and duration,
        without output (read that with :meth:`exec_result`). Execs are kept as
        :meth:`exec_result` says; an :meth:`exec_stream` is not kept.

        Raises:
            MachineNotFound; InvalidRequest: ``limit`` outside 1-64.
        """
        listed = self._c._parse(models.ExecList, _base.machine_exec_list(ref, limit))
        return listed.execs

    def logs(self, ref: str, *, after: int | None = None,
                   wait: float = 0.0) -> models.ServiceLog:
        """The machine's service output (its image's ENTRYPOINT + CMD) after offset
        ``after`` (None: the last 64 KiB the node keeps), waiting up to ``wait`` seconds
        (at most 60) for more; follow it by asking again with ``after=log.end``.

        Raises:
            MachineNotFound; NotFound: the machine has no service.
        """
        return self._c._parse(models.ServiceLog, _base.machine_logs(ref, after, wait))

    def metrics(self, ref: str, *, start: float | None = None,
                      end: float | None = None) -> models.MachineMetrics:
        """The machine's recent CPU, memory and disk samples (oldest first) from ``start``
        to ``end`` (Unix times; None: no bound), read inside its guest. Asking takes a
        sample now if the machine runs and samples it every 5 s for the next 5 minutes;
        the node keeps the last 120. A sleeping machine is not woken (its kept samples,
        maybe none, with its ``state``).

        Raises:
            MachineNotFound; InvalidRequest: ``start`` after ``end``, or the machine's
            agent is older than this boxd (create it again).
        """
        return self._c._parse(models.MachineMetrics,
                                    _base.machine_metrics(ref, start, end))

    def exec_stream(
        self,
        ref: str,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
        user: str | None = None,
    ) -> Iterator[models.ExecEvent]:
        """Run a command, yielding ``stdout``/``stderr`` events as they arrive, then ``exit``.

        Arguments are those of :meth:`exec`. The final event has ``type == "exit"`` with
        ``exit_code``, ``signal`` and ``timed_out``.

        Raises:
            MachineNotFound.
            InfrastructureError: the machine, its engine, agent or node failed during
                the command (`MachineFailed`, `AgentLost`, `NodeLost`), or the daemon's
                connection was lost (`ConnectionError`): there is no exit status.
        """
        req = _base.machine_exec_stream(ref, command, env, cwd, timeout, stdin, user)
        with self._c._stream(req) as resp:
            try:
                for line in resp.iter_lines():
                    event = _base.parse_event(line)
                    if event is not None:
                        yield event
                        if event.type == "exit":
                            return
            except httpx.HTTPError as exc:
                raise _base.map_transport_error(exc, self._c._target) from exc
        raise _base.stream_cut(ref)

    @overload
    def fork(
        self, src: str, name: str | None = None, *, node: str | None = None,
        labels: Mapping[str, str] | None = None, idempotency_key: str | None = None,
        timeout: int | None = None, on_timeout: str = "delete", wait: float = 0.0,
    ) -> models.Machine: ...

    @overload
    def fork(
        self, src: str, name: None = None, *, count: int,
        names: builtins.list[str] | None = None, node: str | None = None,
        labels: Mapping[str, str] | None = None, idempotency_key: str | None = None,
        timeout: int | None = None, on_timeout: str = "delete", wait: float = 0.0,
    ) -> builtins.list[models.Machine | errors.BoxdError]: ...

    @overload
    def fork(
        self, src: str, name: None = None, *, count: int | None = None,
        names: builtins.list[str], node: str | None = None,
        labels: Mapping[str, str] | None = None, idempotency_key: str | None = None,
        timeout: int | None = None, on_timeout: str = "delete", wait: float = 0.0,
    ) -> builtins.list[models.Machine | errors.BoxdError]: ...

    def fork(
        self,
        src: str,
        name: str | None = None,
        *,
        count: int | None = None,
        names: builtins.list[str] | None = None,
        node: str | None = None,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        timeout: int | None = None,
        on_timeout: str = "delete",
        wait: float = 0.0,
    ) -> models.Machine | builtins.list[models.Machine | errors.BoxdError]:
        """Fork a running machine: the child continues from the same instruction.

        With ``count`` or ``names``, fork several children in one call and return one
        entry per child: its ``Machine`` or the ``BoxdError`` that stopped it (one failure
        doesn't sink the batch). Otherwise return the single child. ``node`` puts the
        children on that cluster node (`nodes.list`); by default they go to the
        source's node while it has room, then to the others. The children carry the
        source's labels merged with ``labels``. With ``idempotency_key`` (the same on
        each retry of this request), a retry within 24 h returns the first request's
        children, never new ones; a request that made no child frees its key.
        ``timeout`` gives each child a lifetime of that many whole seconds from now
        (deleted at its end, or hibernated with ``on_timeout="hibernate"``; see
        ``new``); a child never inherits its source's lifetime. Children without room
        wait up to ``wait`` seconds for it (see ``new``).

        Raises:
            MachineNotFound, StateError, AlreadyExists, QuotaExceeded (single fork; a
            batch raises only for errors that concern the whole request).
            NotFound: no such node. InvalidRequest: ``node`` is not the source's node
            and the source cannot leave it (a gVisor machine, or no cluster).
            IdempotencyKeyReused: the key was sent with a different request.
        """
        if count is None and names is None:
            return self._c._parse(
                models.Machine, _base.machine_fork(src, name, node, labels, idempotency_key,
                                                   timeout, on_timeout, wait))
        if name is not None:
            raise errors.InvalidRequest("pass either name or count/names", field="name")
        result = self._c._parse(
            models.ForkResult,
            _base.machine_fork_batch(src, count, names, node, labels, idempotency_key,
                                     timeout, on_timeout, wait),
        )
        return _base.fork_items(result)

    def warm(self, ref: str, forks: int) -> models.Standby:
        """Prepare ``forks`` standby forks of the machine's current state; return once
        they are ready. The next ``forks`` forks of the unchanged machine (one
        ``fork(count=N)`` or N concurrent ``fork`` calls) claim them instead of starting
        children. They use no CPU while they wait; ``Standby.memory_bytes`` (and
        ``info()``) says the host memory they hold. A change to the machine (an exec, an
        upload, a restore) discards them; ``warm(ref, 0)`` releases them. They are not
        the account's machines and count against no quota until claimed, but an
        account holds no more of them than its quota would let it claim, and at most its
        share of the node's (docs/fork.md).

        Raises:
            MachineNotFound, StateError, InvalidRequest (forks outside 0-64),
            ResourceExhausted (past a bound on standby forks, or fewer could be
            prepared: the message says which and why, the hint what to do).
        """
        return self._c._parse(models.Standby, _base.machine_warm(ref, forks))


    # --- processes with a framed stream (boxd.rl) ------------------------------------

    def spawn(
        self,
        ref: str,
        argv: builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
    ) -> ProcessHandle:
        """Start a long-lived process whose stdin and stdout carry framed messages.

        Each message is one frame on the process's side: a 4-byte big-endian length,
        then that many bytes. The handle's ``send(bytes)`` writes one, ``recv()``
        returns the next one the process wrote. A fork of the machine runs its own
        copy of the process (same id): ``attach`` the child's with ``processes`` or
        ``attach(child, handle.id)``.

        Raises:
            InvalidRequest, MachineNotFound, MachineFailed, GuestFileNotFound (cwd).
        """
        from boxd import process_models as pm

        info = self._c._parse(pm.Process,
                                    _base.machine_spawn(ref, argv, env, cwd, user))
        return ProcessHandle(self._c, ref, info)

    def processes(self, ref: str) -> builtins.list[pm.Process]:
        """The machine's processes (a fork child lists its copies of its source's).

        Raises:
            MachineNotFound.
        """
        from boxd import process_models as pm

        return (self._c._parse(pm.ProcessList, _base.machine_processes(ref))).processes

    def attach(self, ref: str, process_id: str) -> ProcessHandle:
        """A handle on a process of ``ref`` (e.g. a fork child's copy), its stream open.

        Raises:
            MachineNotFound, NotFound (no such process), Conflict (already attached).
        """
        found = [p for p in self.processes(ref) if p.id == process_id]
        if not found:
            raise errors.NotFound(f"no process {process_id!r} in machine {ref!r}",
                                  hint="machines.processes(ref) lists them")
        handle = ProcessHandle(self._c, ref, found[0])
        handle.attach()
        return handle


class Files:
    """Files inside a machine (``boxd.machines.files``)."""

    def __init__(self, client: Boxd) -> None:
        self._c = client

    def upload(
        self, ref: str, path: str, data: str | bytes, mode: int = 0o644,
        user: str | None = None,
    ) -> models.FileInfo:
        """Write a file in the machine (parent directories are created).

        Args:
            ref: machine name or id.
            path: absolute path in the guest.
            data: the content; ``str`` is encoded as UTF-8.
            mode: permission bits.
            user: the file's owner, ``NAME[:GROUP]`` or ``UID[:GID]`` from the guest's
                /etc/passwd and /etc/group (the parents the upload makes are theirs
                too); default: root.

        Raises:
            MachineNotFound, InvalidRequest (a user the guest does not have).
        """
        return self._c._parse(models.FileInfo,
                                    _base.file_upload(ref, path, data, mode, user))

    def download(self, ref: str, path: str) -> bytes:
        """Read a file from the machine.

        Raises:
            MachineNotFound, GuestFileNotFound.
        """
        return self._c._call(_base.file_download(ref, path))


class Checkpoints:
    """Per-machine checkpoints: rewind one machine in place (``boxd.machines.checkpoints``)."""

    def __init__(self, client: Boxd) -> None:
        self._c = client

    def save(self, ref: str, name: str) -> models.Checkpoint:
        """Capture the machine's memory and disk under ``name``.

        Raises:
            MachineNotFound, AlreadyExists, StateError.
        """
        return self._c._parse(models.Checkpoint, _base.checkpoint_save(ref, name))

    def restore(self, ref: str, name: str) -> models.Machine:
        """Rewind the machine in place to the checkpoint (same id, name and URL).

        Raises:
            MachineNotFound, CheckpointNotFound.
        """
        return self._c._parse(models.Machine, _base.checkpoint_restore(ref, name))

    def list(self, ref: str) -> list[models.Checkpoint]:
        """The machine's checkpoints.

        Raises:
            MachineNotFound: no such machine.
        """
        return (self._c._parse(models.CheckpointList, _base.checkpoint_list(ref))).checkpoints

    def delete(self, ref: str, name: str) -> None:
        """Delete one checkpoint.

        Raises:
            MachineNotFound, CheckpointNotFound.
        """
        self._c._call(_base.checkpoint_delete(ref, name))


class Snapshots:
    """Durable, named, versioned machine images (``boxd.snapshots``)."""

    def __init__(self, client: Boxd) -> None:
        self._c = client

    def save(self, machine: str, name: str, *, new_version: bool = False) -> models.Snapshot:
        """Save a machine as snapshot ``name`` (the machine keeps running).

        Args:
            machine: machine name or id.
            name: snapshot name.
            new_version: add a version when ``name`` exists (else that is an error).

        Raises:
            MachineNotFound, AlreadyExists.
        """
        return self._c._parse(
            models.Snapshot, _base.snapshot_save(machine, name, new_version)
        )

    def get(self, ref: str) -> models.Snapshot:
        """The snapshot ``NAME`` (latest version), ``NAME@N`` or ``sha256:DIGEST``.

        Raises:
            SnapshotNotFound: no match.
        """
        return self._c._parse(models.Snapshot, _base.snapshot_get(ref))

    def list(self) -> list[models.Snapshot]:
        """Every snapshot version of this account.

        Raises:
            BoxdError: the daemon refused the request.
        """
        return (self._c._parse(models.SnapshotList, _base.snapshot_list())).snapshots

    def delete(self, ref: str) -> None:
        """Delete a snapshot version.

        Raises:
            SnapshotNotFound: no match.
        """
        self._c._call(_base.snapshot_delete(ref))

    def export(
        self,
        ref: str,
        path: str | os.PathLike[str],
        *,
        progress: _base.TransferProgress | None = None,
    ) -> Path:
        """Stream the snapshot into one file at ``path`` (written atomically).

        Args:
            ref: snapshot ``NAME``, ``NAME@N`` or ``sha256:DIGEST``.
            path: the file to write.
            progress: called as ``progress(bytes_written, total_or_None)`` per chunk.

        Raises:
            SnapshotNotFound: no match.
            InvalidRequest: ``path`` cannot be written.
        """
        dest = Path(path)
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            with self._c._stream(_base.snapshot_export(ref)) as resp:
                total = _base.content_length(resp.headers)
                done = 0
                with open(tmp, "wb") as f:
                    try:
                        for chunk in resp.iter_bytes(_CHUNK):
                            f.write(chunk)
                            done += len(chunk)
                            if progress is not None:
                                progress(done, total)
                    except httpx.HTTPError as exc:
                        raise _base.map_transport_error(exc, self._c._target) from exc
            os.replace(tmp, dest)
        except OSError as exc:
            raise errors.InvalidRequest(
                f"cannot write {dest}: {exc.strerror or exc}", field="path"
            ) from exc
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return dest

    def import_(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        *,
        progress: _base.TransferProgress | None = None,
    ) -> models.Snapshot:
        """Import a file written by :meth:`export`.

        Args:
            path: the file.
            name: import under this name (the file's own name if None).
            progress: called as ``progress(bytes_sent, file_size)`` per chunk.

        Raises:
            CorruptData: the file is corrupt or lacks blobs its manifest names.
            InvalidRequest: not a snapshot file, or ``path`` cannot be read.
        """
        src = Path(path)
        try:
            with open(src, "rb") as f:
                resp = self._c._send(
                    _base.snapshot_import(name), content=_read_chunks(f, progress)
                )
        except OSError as exc:
            raise errors.InvalidRequest(
                f"cannot read {src}: {exc.strerror or exc}", field="path"
            ) from exc
        return _base.parse(models.Snapshot, resp.status_code, resp.content)


def _read_chunks(
    f: BinaryIO, progress: _base.TransferProgress | None = None
) -> Iterator[bytes]:
    total, done = os.fstat(f.fileno()).st_size, 0
    while chunk := f.read(_CHUNK):
        yield chunk
        done += len(chunk)
        if progress is not None:
            progress(done, total)


class Keys:
    """API keys (``boxd.keys``)."""

    def __init__(self, client: Boxd) -> None:
        self._c = client

    def create(self, name: str, account: str | None = None) -> models.ApiKeyCreated:
        """Create an API key; its ``secret`` is shown only in this result.

        Args:
            name: a label for the key.
            account: the account the key acts for (admin only); the caller's if None.

        Raises:
            AuthError, InvalidRequest.
        """
        return self._c._parse(models.ApiKeyCreated, _base.key_create(name, account))

    def list(self) -> list[models.ApiKey]:
        """The keys visible to this key.

        Raises:
            AuthError: the key is not allowed to list keys.
        """
        return (self._c._parse(models.ApiKeyList, _base.key_list())).keys

    def revoke(self, key_id: str) -> None:
        """Revoke a key; requests with it fail from now on.

        Raises:
            NotFound: no such key.
        """
        self._c._call(_base.key_revoke(key_id))


class Reports:
    """Reproducibility reports kept by the daemon (``boxd.reports``): ``boxd rl verify
    --save NAME`` saves one; the console draws them (docs/console.md)."""

    def __init__(self, client: Boxd) -> None:
        self._c = client

    def save(self, name: str, report: Mapping[str, Any]) -> models.Report:
        """Save a report under ``name`` (replacing the report of that name, if any).

        Args:
            name: the report's name (the machine name rule).
            report: a `boxd.rl.SweepReport`'s ``to_json()``, with its ``causes``.

        Raises:
            InvalidRequest: a bad name, or not a report.
        """
        return self._c._parse(models.Report, _base.report_save(name, report))

    def list(self) -> list[models.Report]:
        """The account's reports (their verdicts), newest first."""
        return (self._c._parse(models.ReportList, _base.report_list())).reports

    def get(self, name: str) -> models.ReportData:
        """A report whole, as it was saved.

        Raises:
            NotFound: no such report.
        """
        return self._c._parse(models.ReportData, _base.report_get(name))

    def delete(self, name: str) -> None:
        """Delete a report.

        Raises:
            NotFound: no such report.
        """
        self._c._call(_base.report_delete(name))


class Images:
    """Container images machines can start from (``boxd.images``): imported from an OCI
    layout, an archive or a registry; layers are stored once."""

    def __init__(self, client: Boxd) -> None:
        self._c = client

    def import_(self, source: str, name: str, *, creds: str | None = None,
                      insecure: bool = False,
                      progress: _base.StepProgress | None = None,
                      ) -> models.Image:
        """Import ``source`` as ``name`` (``NAME[:TAG]``).

        Args:
            source: ``oci:DIR[:REF]``, ``oci-archive:FILE[:REF]``,
                ``docker-archive:FILE`` or ``docker://HOST[:PORT]/REPO[:TAG|@DIGEST]``
                (paths are on the daemon's host).
            name: the name to store it under; the tag is ``latest`` when absent.
            creds: ``USER:PASSWORD`` for the registry (default: the daemon user's
                ``~/.docker/config.json``).
            insecure: allow a registry on plain HTTP.
            progress: called as ``progress(step, fraction_or_None)`` while blobs arrive.

        Raises:
            InvalidRequest, NotFound, AuthError, IntegrityError (a blob does not match its
            digest: nothing is named).
        """
        if progress is None:
            return self._c._parse(models.Image,
                                        _base.image_import(source, name, creds, insecure))
        req = _base.image_import(source, name, creds, insecure, progress=True)
        with self._c._stream(req) as resp:
            try:
                for line in resp.iter_lines():
                    image = _base.parse_progress_line(line, progress)
                    if image is not None:
                        return models.Image.model_validate(image)
            except httpx.HTTPError as exc:
                raise _base.map_transport_error(exc, self._c._target) from exc
        raise errors.InternalError("the import's progress stream ended without its image")

    def build(self, context: str | os.PathLike[str], name: str, *,
                    dockerfile: str = "Dockerfile", build_args: dict[str, str] | None = None,
                    target: str | None = None) -> models.Image:
        """Build the Dockerfile in ``context`` (a directory, sent to the daemon as a tar)
        and store the result as ``name``.

        Args:
            context: the build context directory (``.dockerignore`` is honoured).
            name: ``NAME[:TAG]``.
            dockerfile: its path inside the context.
            build_args: ``ARG`` values.
            target: the stage to build (default: the last).

        Raises:
            InvalidRequest: an instruction boxd does not support (its line is named), or
                a step that failed (the error ends with the build's output).
        """
        src = Path(context)
        if not src.is_dir():
            raise errors.InvalidRequest(f"the build context {src} is not a directory",
                                        field="context")
        with tempfile.TemporaryFile() as f:
            _base.tar_context(src, f)
            f.seek(0)
            resp = self._c._send(_base.image_build(name, dockerfile, build_args, target),
                                       content=_read_chunks(f))
        return _base.parse(models.Image, resp.status_code, resp.content)

    def get(self, name: str) -> models.Image:
        """One image: digest, layers and run config.

        Raises:
            NotFound: no such image.
        """
        return self._c._parse(models.Image, _base.image_get(name))

    def list(self) -> list[models.Image]:
        """This account's images, by name."""
        return (self._c._parse(models.ImageList, _base.image_list())).images

    def remove(self, name: str) -> models.Image:
        """Remove an image's name; layers no other image holds are freed.

        Raises:
            NotFound: no such image.
        """
        return self._c._parse(models.Image, _base.image_remove(name))


class Nodes:
    """The nodes machines run on (``boxd.nodes``): this host, or a Ray cluster's."""

    def __init__(self, client: Boxd) -> None:
        self._c = client

    def list(self) -> list[models.NodeInfo]:
        """Each node: id, address, health, machines, cap and free memory."""
        return (self._c._parse(models.NodeList, _base.node_list())).nodes


class Accounts:
    """Accounts and their machine limits (``boxd.accounts``)."""

    def __init__(self, client: Boxd) -> None:
        self._c = client

    def list(self) -> list[models.Account]:
        """Every account (the operator's key), else only the caller's own."""
        return (self._c._parse(models.AccountList, _base.account_list())).accounts

    def get(self, name: str) -> models.Account:
        """One account: its limit and the machines counting against it.

        Raises:
            NotFound: no such account visible to this key.
        """
        return self._c._parse(models.Account, _base.account_get(name))

    def update(self, name: str, *, max_machines: int) -> models.Account:
        """Change an account's concurrent-machine limit.

        Raises:
            AuthError: only the operator (the local account) changes limits.
            NotFound: no such account.
        """
        return self._c._parse(models.Account, _base.account_update(name, max_machines))
