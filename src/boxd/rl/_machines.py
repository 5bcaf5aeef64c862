"""`MachineHome`: env servers in forks of a source machine, over ``machines.spawn``.

Opening a slot forks ``source``, uploads the env server (``boxd/rl/_server.py``) and
spawns it with the machine's ``python3``, then sends the env factory. When the agent
can re-attach a process's stream after a fork or restore (``machines.attach``), a
slot's machine is forked from a *built template* instead: one fork of ``source`` per
distinct factory in which the env was built once; each slot is a fork of it and
re-attaches to its copy of the server (no interpreter start, no imports, no build).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from boxd import errors
from boxd.rl._channel import GUEST_SERVER, REWIND_CHECKPOINT, SERVER_FILE, MakeRequest, Rpc
from boxd.rl._cleanup import CREATIONS, delete_labelled, run_labels

if TYPE_CHECKING:
    from boxd.sdk._process_sync import ProcessHandle
    from boxd.sdk._sync import Boxd

#: The checkpoint taken before the server starts: it gives a fork child RAM of its own
#: (a VM swap) while no process stream is open yet.
OWN_RAM_CHECKPOINT = "boxd-rl-own-ram"
#: Seconds to wait for a fork to answer.
READY_TIMEOUT = 300.0
#: Seconds for the server to start and build the env (imports under TCG are slow).
BUILD_TIMEOUT = 600.0


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


class MachineSlot:
    """One env's machine: a fork of the source with a running env server."""

    def __init__(self, home: MachineHome, make: MakeRequest, rewindable: bool,
                 index: int | None, shared: bool = False) -> None:
        self._home = home
        self._shared = shared
        self._make = make
        self._rewindable = rewindable
        self._index = index
        self._machine: str | None = None
        self._proc: ProcessHandle | None = None
        self._info: dict[str, Any] = {}
        self._proc_id: str | None = None
        self._build()

    # -- the Slot protocol

    @property
    def channel(self) -> ProcessHandle:
        assert self._proc is not None
        return self._proc

    @property
    def machine(self) -> str | None:
        return self._machine

    @property
    def info(self) -> dict[str, Any]:
        return self._info

    def rewind(self) -> None:
        """Restore the machine to the checkpoint taken when its env was built."""
        assert self._machine is not None
        if not self._rewindable:
            raise errors.InvalidRequest("this env was not built for rewinding",
                                        field="reset_mode")
        c = self._home.boxd
        self._detach()
        c.machines.checkpoints.restore(self._machine, REWIND_CHECKPOINT)
        self._start_server(rebuild_if_lost=True)

    def refork(self) -> None:
        """A fresh fork of the moment the env was built (of the built template when the
        agent can re-attach, else of the source with the env built anew)."""
        self.close()
        self._shared = True
        self._build()

    def close(self) -> None:
        self._detach()
        machine, self._machine = self._machine, None
        if machine is not None:
            with contextlib.suppress(errors.NotFound):
                self._home.boxd.machines.delete(machine)

    # -- building

    def _build(self) -> None:
        tpl = self._home.template(self._make, self._index) if self._shared else None
        if tpl is not None and self._from_template(tpl):
            return
        c = self._home.boxd
        with CREATIONS.creating():
            fork = c.machines.fork(self._home.source, _name("rl"), node=self._home.node,
                                   labels=self._home.labels)
        self._machine = fork.id
        try:
            c.machines.wait_until_ready(fork.id, timeout=READY_TIMEOUT)
            if self._rewindable:
                c.machines.checkpoints.save(fork.id, OWN_RAM_CHECKPOINT)
            c.machines.files.upload(fork.id, GUEST_SERVER, SERVER_FILE.read_bytes())
            self._start_server(rebuild_if_lost=False)
            if self._rewindable:
                c.machines.checkpoints.save(fork.id, REWIND_CHECKPOINT)
        except BaseException:
            self.close()
            raise

    def _from_template(self, tpl: _Template) -> bool:
        """Fork the built template and re-attach to the child's copy of its server;
        False (nothing left behind) when the agent cannot re-attach."""
        c = self._home.boxd
        with CREATIONS.creating():  # the template's labels are the home's: inherited
            fork = c.machines.fork(tpl.machine, _name("rl"))
        self._machine = fork.id
        try:
            c.machines.wait_until_ready(fork.id, timeout=READY_TIMEOUT)
            if self._rewindable:  # before attaching: it gives the child RAM of its own
                c.machines.checkpoints.save(fork.id, REWIND_CHECKPOINT)
            try:
                self._proc = c.machines.attach(fork.id, tpl.process)
            except errors.BoxdError:
                if self._home.can_attach:
                    raise
                self._home.can_attach = False
                self.close()
                return False
            self._home.can_attach = True
            self._proc_id = tpl.process
            self._info = tpl.info
            return True
        except BaseException:
            self.close()
            raise

    def _start_server(self, *, rebuild_if_lost: bool) -> None:
        """Re-attach to the server the machine runs, or spawn one and build the env."""
        c = self._home.boxd
        assert self._machine is not None
        if rebuild_if_lost and self._proc_id is not None:
            try:
                self._proc = c.machines.attach(self._machine, self._proc_id)
                return
            except errors.BoxdError:
                pass  # the agent cannot re-attach: start a new server below
        self._proc = c.machines.spawn(self._machine, ["python3", "-u", GUEST_SERVER],
                                      env={"PYTHONHASHSEED": "0"})
        self._proc_id = self._proc.id
        self._proc.send(self._make.message())
        self._info = Rpc(self, self._index).reply(BUILD_TIMEOUT)

    def _detach(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.close()


@dataclass(frozen=True)
class _Template:
    """A fork of the source in which one env factory was built, never stepped."""

    machine: str
    process: str
    info: dict[str, Any]


class MachineHome:
    """Env servers in forks of ``source`` (a machine name or id), or of a baseline
    machine it starts from the boxd image ``image`` (deleted with the home).

    With ``shared`` slots (a factory several sub-envs share, or ``reset_mode="refork"``)
    the env is built once in a template machine and each slot forks it; `close`
    deletes the templates. With ``node``, the forks of ``source`` go to that cluster
    node (``machines.fork(..., node=)``).

    Every machine it makes carries ``labels`` (by default a new run's:
    ``boxd.rl/run=<id>``, ``boxd.rl/owner=env``; `boxd.rl._cleanup`), and `close`
    deletes every machine that carries them: those whose creation answered and those
    whose answer was lost (a crash, a branch that failed partway).
    """

    def __init__(self, source: str | None, boxd: Boxd | None = None, *,
                 node: str | None = None, labels: dict[str, str] | None = None,
                 image: str | None = None) -> None:
        if (source is None) == (image is None):
            raise errors.InvalidRequest("give a source machine or an image, not both "
                                        "and not neither", field="image")
        if boxd is None:
            from boxd.sdk._sync import Boxd

            boxd = Boxd()
            self._owns = True
        else:
            self._owns = False
        self.node = node
        self.labels = dict(labels) if labels is not None else run_labels("env")
        self.boxd = boxd
        self.can_attach: bool | None = None  # learnt from the first attempt
        self._lock = threading.Lock()
        self._building: dict[bytes, threading.Lock] = {}
        self._templates: dict[bytes, _Template] = {}
        try:
            if image is not None:
                source = self._start_image(image)
            else:  # fail early, with the SDK's own error, when the source does not exist
                assert source is not None
                boxd.machines.get(source)
        except BaseException:
            if self._owns:
                boxd.close()
            raise
        self.source: str = source

    def _start_image(self, image: str) -> str:
        """The id of a running machine of ``image`` (its service ready) that the slots
        fork; it carries the home's labels, so `close` deletes it."""
        c = self.boxd
        with CREATIONS.creating():
            base = c.machines.new(_name("rl-image"), image=image, node=self.node,
                                  labels=self.labels)
        try:
            c.machines.wait_until_ready(base.id, timeout=READY_TIMEOUT)
        except BaseException:
            with contextlib.suppress(errors.NotFound):
                c.machines.delete(base.id)
            raise
        return base.id

    def open(self, make: MakeRequest, *, rewindable: bool, index: int | None = None,
             shared: bool = False) -> MachineSlot:
        return MachineSlot(self, make, rewindable, index, shared)

    def template(self, make: MakeRequest, index: int | None) -> _Template | None:
        """The built template of ``make`` (built on first use), or None when the agent
        cannot re-attach processes (then templates are useless)."""
        if self.can_attach is False:
            return None
        key = make.message()
        with self._lock:
            lock = self._building.setdefault(key, threading.Lock())
        with lock:
            tpl = self._templates.get(key)
            if tpl is None:
                tpl = self._build_template(make, index)
                self._templates[key] = tpl
            return tpl

    def _build_template(self, make: MakeRequest, index: int | None) -> _Template:
        c = self.boxd
        with CREATIONS.creating():
            fork = c.machines.fork(self.source, _name("rl-template"), node=self.node,
                                   labels=self.labels)
        try:
            c.machines.wait_until_ready(fork.id, timeout=READY_TIMEOUT)
            c.machines.files.upload(fork.id, GUEST_SERVER, SERVER_FILE.read_bytes())
            proc = c.machines.spawn(fork.id, ["python3", "-u", GUEST_SERVER],
                                    env={"PYTHONHASHSEED": "0"})
            try:
                proc.send(make.message())
                info = Rpc(_Bare(proc, fork.id), index).reply(BUILD_TIMEOUT)
            finally:
                proc.close()
            return _Template(fork.id, proc.id, info)
        except BaseException:
            with contextlib.suppress(errors.NotFound):
                c.machines.delete(fork.id)
            raise

    def close(self) -> None:
        """Delete the templates, then every machine that carries this home's labels
        (and close the client if this home made it)."""
        templates, self._templates = list(self._templates.values()), {}
        for tpl in templates:
            with contextlib.suppress(errors.BoxdError):
                self.boxd.machines.delete(tpl.machine)
        delete_labelled(self.boxd, self.labels)
        if self._owns:
            self.boxd.close()


class _Bare:
    """A `Slot` view of a process handle, for one `Rpc` reply."""

    def __init__(self, proc: ProcessHandle, machine: str) -> None:
        self.channel = proc
        self.machine = machine
        self.info: dict[str, Any] = {}

    def rewind(self) -> None:  # pragma: no cover - never called
        raise NotImplementedError

    def refork(self) -> None:  # pragma: no cover - never called
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - never called
        raise NotImplementedError


__all__ = ["MachineHome", "MachineSlot"]
