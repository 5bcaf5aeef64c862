"""E2B's sandbox operations over boxd's machine service (no HTTP here).

A sandbox is a machine named by its sandbox id, plus a `SandboxRecord`. Create waits
until the machine runs a command (a warm template's create is a fork of its source
machine, `boxd.e2b.env.source_labels`, claiming a standby fork); pause is boxd's
hibernate and connect wakes it; fork is boxd's copy-on-write fork batch. Each
sandbox's end of life is kept by `Sandboxes.reap`, which the app runs as a task: at its
end a sandbox is killed, or hibernated if it was created with ``autoPause``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace

from boxd import models
from boxd.e2b._ids import is_sandbox_id, new_sandbox_id
from boxd.e2b._store import SandboxRecord, SandboxStore, now
from boxd.e2b._users import DEFAULT_USER, ROOT, is_unknown_user
from boxd.e2b.env import ROLE_LABEL, SANDBOX_LABELS, source_labels
from boxd.errors import (
    BoxdError,
    InvalidRequest,
    MachineNotFound,
    NotFound,
    SnapshotNotFound,
    StateError,
)
from boxd.services import MachineService

__all__ = ["BASE_TEMPLATE", "HOME", "MAX_FORKS", "BuiltTemplate", "Sandbox", "Sandboxes"]

log = logging.getLogger("boxd.e2b")

#: E2B's default template: boxd's default image.
BASE_TEMPLATE = "base"
#: The working directory of commands and of relative paths, as on E2B's base template.
HOME = "/home/user"
#: Children one fork request may ask for (E2B's limit).
MAX_FORKS = 100
#: Longest sandbox lifetime accepted, in seconds (E2B's longest: 24 hours).
MAX_TIMEOUT = 24 * 3600
_READY_TIMEOUT = 120.0
#: Warm sources of one template a create looks through for one of its network.
WARM_SOURCES = 8
#: Warm sources whose sandboxes' default user is remembered (`Sandboxes.default_user`).
WARM_SOURCE_USERS = 1024
#: Idempotency keys remembered (the newest; in memory: a daemon restart forgets them).
IDEMPOTENCY_KEYS = 4096
#: The end of life of a paused sandbox: none (on E2B a paused sandbox's timeout stops;
#: it lives until killed or woken).
NEVER = float("inf")
#: A woken sandbox's lifetime when connect names none (E2B's SDK default).
WOKEN_TIMEOUT = 300
_PAUSED = (models.MachineState.HIBERNATED, models.MachineState.HIBERNATING)

#: Makes sure an account has the snapshot a built template names (building it if not).
BuiltTemplate = Callable[[str], Awaitable[None]]


@dataclass(frozen=True)
class Sandbox:
    """A sandbox as E2B shows it: its record and its machine."""

    record: SandboxRecord
    machine: models.Machine

    @property
    def state(self) -> str:
        return "paused" if self.machine.state in _PAUSED else "running"


def check_timeout(value: object, field: str = "timeout") -> int:
    """A lifetime in whole seconds, 0..`MAX_TIMEOUT`.

    Raises:
        InvalidRequest: not an integer in range.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TIMEOUT:
        raise InvalidRequest(f"{field} must be whole seconds from 0 to {MAX_TIMEOUT}, not "
                             f"{value!r}", field=field)
    return value


class Sandboxes:
    """Create, find, list, time out, pause, wake, fork and kill sandboxes."""

    def __init__(self, machines: MachineService, store: SandboxStore,
                 built: Mapping[str, BuiltTemplate] | None = None) -> None:
        self.machines = machines
        self.store = store
        # Templates boxd builds on an account's first use, by name (code-interpreter-v1)
        self.built = dict(built or {})
        self._wakeup = asyncio.Event()
        # (account, Idempotency-Key) -> the create it started; the newest IDEMPOTENCY_KEYS
        self._creates: OrderedDict[tuple[str, str], asyncio.Task[Sandbox]] = OrderedDict()
        # warm source machine id -> the default user its sandboxes were found to have
        self._source_users: dict[str, str] = {}

    # -- lookup -------------------------------------------------------------------------

    def record(self, account: str, sandbox_id: str) -> SandboxRecord:
        """The record of one of ``account``'s sandboxes.

        Raises:
            MachineNotFound: no such sandbox for this account (another's looks the same).
        """
        rec = self.store.get(sandbox_id) if is_sandbox_id(sandbox_id) else None
        if rec is None or rec.account != account:
            raise MachineNotFound(f"sandbox {sandbox_id!r} not found", machine=sandbox_id)
        return rec

    async def get(self, account: str, sandbox_id: str) -> Sandbox:
        """Raises: MachineNotFound (its machine gone too: the record is dropped)."""
        rec = self.record(account, sandbox_id)
        try:
            machine = await self.machines.get(account, sandbox_id)
        except MachineNotFound:
            self.store.remove(sandbox_id)  # deleted through boxd's own API
            raise
        return Sandbox(rec, machine)

    async def list(self, account: str) -> builtins.list[Sandbox]:
        """The account's sandboxes whose machines still exist, oldest first."""
        machines = {m.name: m for m in await self.machines.list(account)}
        found = []
        for rec in self.store.all():
            if rec.account == account and rec.sandbox_id in machines:
                found.append(Sandbox(rec, machines[rec.sandbox_id]))
        return sorted(found, key=lambda s: (s.record.started_at, s.record.sandbox_id))

    async def metrics(self, account: str, sandbox_id: str) -> models.MachineMetrics:
        """The sandbox machine's kept samples, one taken now if it runs (a paused one is
        not woken). Raises: MachineNotFound (also another account's sandbox)."""
        self.record(account, sandbox_id)
        return await self.machines.metrics(account, sandbox_id)

    # -- create, fork -------------------------------------------------------------------

    async def create(
        self, account: str, template: str, timeout: int, *, metadata: dict[str, str],
        env_vars: dict[str, str], auto_pause: bool, isolated: bool,
        egress: builtins.list[str] | None = None, idempotency_key: str | None = None,
    ) -> Sandbox:
        """Create a sandbox and return once it runs a command. A create repeated with the
        same ``idempotency_key`` (E2B's ``Idempotency-Key``) returns the same sandbox while
        it exists, and waits for the first one if it is still being made; the create goes
        on when its client goes, so a retry after a lost reply finds it.

        Raises:
            InvalidRequest, QuotaExceeded, SnapshotNotFound (a template that is no
            snapshot and no image), MachineFailed, HostSetupError.
        """
        make = self._create(account, template, timeout, metadata=metadata,
                            env_vars=env_vars, auto_pause=auto_pause, isolated=isolated,
                            egress=egress)
        if idempotency_key is None:
            return await make
        key = (account, idempotency_key)
        task = self._creates.get(key)
        if task is not None and task.done() and (
                task.cancelled() or task.exception() is not None
                or self.store.get(task.result().record.sandbox_id) is None):
            task = None  # failed, or made and since killed: a new create
        if task is not None:
            make.close()
            made = await asyncio.shield(task)
            return await self.get(account, made.record.sandbox_id)
        task = asyncio.create_task(make)
        self._creates[key] = task
        self._creates.move_to_end(key)
        while len(self._creates) > IDEMPOTENCY_KEYS:
            self._creates.popitem(last=False)
        return await asyncio.shield(task)

    async def _create(
        self, account: str, template: str, timeout: int, *, metadata: dict[str, str],
        env_vars: dict[str, str], auto_pause: bool, isolated: bool,
        egress: builtins.list[str] | None = None,
    ) -> Sandbox:
        sandbox_id = new_sandbox_id()
        req = models.MachineCreate.model_validate({
            "name": sandbox_id, "isolated": isolated, "egress": egress,
            "from_snapshot": None if template == BASE_TEMPLATE else template,
            # It lives until its timeout, as on E2B: no idle suspend in between.
            "suspend_after": 0, "hibernate_after": 0,
        })
        start = now()
        rec = SandboxRecord(
            sandbox_id=sandbox_id, account=account, template=template,
            token=secrets.token_hex(16), started_at=start, end_at=start + timeout,
            auto_pause=auto_pause, metadata=metadata, env_vars=env_vars,
        )
        self.store.put(rec)
        try:
            # A fork keeps its source's network: an egress policy needs a machine of its own
            machine = None if egress is not None else await self._fork_warm(
                account, template, sandbox_id, isolated)
            if machine is not None:
                user = self._source_users.get(machine.parent_id or "")
            else:
                if template in self.built:  # a snapshot of the template's name, made once
                    await self.built[template](account)
                await self._boot(account, req)
                machine, user = await self._ready(account, sandbox_id)
        except BaseException:
            self.store.remove(sandbox_id)
            with contextlib.suppress(Exception):
                await self.machines.delete(account, sandbox_id)
            raise
        if user is not None:
            rec = replace(rec, user=user)
            self.store.put(rec)
        self._wakeup.set()
        return Sandbox(rec, machine)

    async def _boot(self, account: str, req: models.MachineCreate) -> None:
        """Create the sandbox's machine: of boxd's default image for `BASE_TEMPLATE`,
        else from the snapshot the template names, else from the account's image of
        that name (``NAME[:TAG]``: its root and its service, docs/images.md).

        Raises:
            SnapshotNotFound: the template is neither a snapshot nor an image.
        """
        try:
            await self.machines.create(account, req)
            return
        except SnapshotNotFound:
            pass
        template = req.from_snapshot
        try:
            await self.machines.create(account, req.model_copy(
                update={"from_snapshot": None, "image": template}))
        except NotFound:  # the image's: no such image either
            raise SnapshotNotFound(
                f"template {template!r} not found: no snapshot and no image has that name",
                snapshot=template,
                hint="`boxd snapshots list` and `boxd image list` show what there is") \
                from None

    async def _fork_warm(self, account: str, template: str, sandbox_id: str,
                         isolated: bool) -> models.Machine | None:
        """The sandbox forked of ``template``'s warm source (a running machine labelled
        `source_labels` whose network is the one asked for: a fork keeps its source's),
        or None when the template has none (or it went meanwhile). The source ran a
        command already, and the child is the running copy of it."""
        page = await self.machines.list_page(
            account, labels=source_labels(template), state=models.MachineState.RUNNING,
            limit=WARM_SOURCES)
        source = next((m for m in page.machines if m.isolated == isolated), None)
        if source is None:
            return None
        try:
            (item,) = await self.machines.fork(account, source.id, [sandbox_id],
                                               labels=SANDBOX_LABELS)
        except MachineNotFound:
            return None  # deleted since it was listed: a create as without it
        if isinstance(item, BaseException):
            raise item
        return item

    async def _ready(self, account: str, sandbox_id: str) -> tuple[models.Machine, str]:
        """The machine once it runs a command, and its default user (`default_user`):
        the one command makes sure of /home/user as that user, which proves both."""
        machine = await self.machines.wait_until_ready(account, sandbox_id, _READY_TIMEOUT)
        # E2B's base template works in /home/user; this also proves a command runs.
        user = "" if machine.image is not None else DEFAULT_USER
        mkdir = models.ExecRequest(command=["mkdir", "-p", HOME], timeout=60)
        try:
            done = await self.machines.exec(account, sandbox_id,
                                            mkdir.model_copy(update={"user": user or None}))
        except InvalidRequest as exc:
            if not user or not is_unknown_user(exc):
                raise
            user = ROOT  # a guest without the account (an older guest image's snapshot)
            done = await self.machines.exec(account, sandbox_id, mkdir)
        if done.exit_code != 0 and user == DEFAULT_USER:  # no /home/user it may make
            await self.machines.exec(account, sandbox_id, mkdir)
        return machine, user

    async def default_user(self, rec: SandboxRecord) -> str | None:
        """Who the sandbox's commands and files are for when a call names no user:
        ``user`` (E2B's default, which boxd's guest image has), ``root`` when its guest
        lacks that account, None for a container image's sandbox (the image's USER).
        Known from the create, or found out here once (a sandbox forked of a warm
        source, a record from before boxd knew) and kept in the record.

        Raises:
            MachineNotFound, MachineFailed: the sandbox cannot say.
        """
        user = rec.user
        if user is None:
            machine = await self.machines.get(rec.account, rec.sandbox_id)
            user = "" if machine.image is not None else DEFAULT_USER
            if user and not await self.has_user(rec, user):
                user = ROOT
            current = self.store.get(rec.sandbox_id)
            if current is not None:
                self.store.put(replace(current, user=user))
            if machine.parent_id is not None and machine.labels.get(ROLE_LABEL) == "sandbox":
                # a warm source's next sandboxes need not find out again
                if len(self._source_users) >= WARM_SOURCE_USERS:
                    self._source_users.clear()
                self._source_users[machine.parent_id] = user
        return user or None

    async def has_user(self, rec: SandboxRecord, user: str) -> bool:
        """Whether the sandbox's guest has ``user`` (a command runs as it).

        Raises:
            MachineNotFound, MachineFailed: the sandbox cannot say.
        """
        try:
            await self.machines.exec(rec.account, rec.sandbox_id, models.ExecRequest(
                command=["true"], user=user, timeout=30))
        except InvalidRequest as exc:
            if is_unknown_user(exc):
                return False
            raise
        return True

    async def fork(
        self, account: str, sandbox_id: str, count: int, timeout: int | None
    ) -> builtins.list[Sandbox | BoxdError]:
        """Fork a running sandbox into ``count`` children (boxd's copy-on-write fork:
        the source keeps running); one result per child.

        Raises:
            MachineNotFound: no such sandbox.
        """
        parent = self.record(account, sandbox_id)
        ids = [new_sandbox_id() for _ in range(count)]
        start = now()
        life = timeout if timeout is not None else round(parent.end_at - parent.started_at)
        results: builtins.list[Sandbox | BoxdError] = []
        items = await self.machines.fork(account, sandbox_id, list[str | None](ids))
        for child_id, item in zip(ids, items, strict=True):
            if isinstance(item, BoxdError):
                results.append(item)
                continue
            if isinstance(item, Exception):
                log.error("fork child failed", exc_info=item)
                results.append(BoxdError("the fork child failed to start"))
                continue
            rec = replace(parent, sandbox_id=child_id, token=secrets.token_hex(16),
                          started_at=start, end_at=start + life)
            self.store.put(rec)
            results.append(Sandbox(rec, item))
        self._wakeup.set()
        return results

    # -- lifetime -----------------------------------------------------------------------

    async def set_timeout(self, account: str, sandbox_id: str, timeout: int) -> None:
        """The sandbox now ends ``timeout`` seconds from now. Raises: MachineNotFound."""
        sandbox = await self.get(account, sandbox_id)
        self.store.put(sandbox.record.with_end(now() + timeout))
        self._wakeup.set()

    async def kill(self, account: str, sandbox_id: str) -> None:
        """Delete the sandbox's machine and record. Raises: MachineNotFound."""
        self.record(account, sandbox_id)
        try:
            await self.machines.delete(account, sandbox_id)
        finally:
            self.store.remove(sandbox_id)

    async def pause(self, account: str, sandbox_id: str) -> None:
        """Hibernate it (memory to disk; it no longer counts against the quota).

        Raises:
            MachineNotFound; StateError when it is already paused.
        """
        sandbox = await self.get(account, sandbox_id)
        if sandbox.state == "paused":
            raise StateError(f"sandbox {sandbox_id} is already paused", machine=sandbox_id,
                             state=sandbox.machine.state.value, required="running")
        await self.machines.hibernate(account, sandbox_id)
        self.store.put(sandbox.record.with_end(NEVER))

    async def connect(self, account: str, sandbox_id: str, timeout: int | None) -> tuple[
            Sandbox, bool]:
        """Wake a paused sandbox (or find a running one) and extend its life to at least
        ``timeout`` seconds from now; the sandbox and whether it was woken.

        Raises:
            MachineNotFound, MachineFailed, QuotaExceeded.
        """
        sandbox = await self.get(account, sandbox_id)
        woken = sandbox.state == "paused"
        machine = sandbox.machine
        if woken:
            machine = await self.machines.resume(account, sandbox_id)
        rec = sandbox.record
        if woken or rec.end_at == NEVER:  # a new life from now
            rec = rec.with_end(now() + (timeout if timeout is not None else WOKEN_TIMEOUT))
        elif timeout is not None and now() + timeout > rec.end_at:
            rec = rec.with_end(now() + timeout)
        self.store.put(rec)
        self._wakeup.set()
        return Sandbox(rec, machine), woken

    async def reap(self) -> None:
        """Forever: end each sandbox at its end of life (kill, or hibernate with
        ``autoPause``). Runs in the daemon; records outlive restarts, so a sandbox whose
        end passed while the daemon was down is ended when it starts again."""
        while True:
            due = sorted(self.store.all(), key=lambda r: r.end_at)
            wait = 60.0
            for rec in due:
                left = rec.end_at - now()
                if left > 0:
                    wait = min(wait, left)
                    break
                await self._end(rec)
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=max(wait, 0.05))

    async def _end(self, rec: SandboxRecord) -> None:
        try:
            if rec.auto_pause:
                machine = await self.machines.get(rec.account, rec.sandbox_id)
                if machine.state not in _PAUSED:
                    await self.machines.hibernate(rec.account, rec.sandbox_id)
                self.store.put(rec.with_end(NEVER))
                log.info("sandbox paused at its timeout", extra={"machine": rec.sandbox_id})
            else:
                await self.kill(rec.account, rec.sandbox_id)
                log.info("sandbox killed at its timeout", extra={"machine": rec.sandbox_id})
        except MachineNotFound:
            self.store.remove(rec.sandbox_id)
        except Exception:
            # Tried again at the next pass, a minute on, rather than in a tight loop.
            log.exception("ending sandbox %s at its timeout failed", rec.sandbox_id)
            self.store.put(rec.with_end(now() + 60))
