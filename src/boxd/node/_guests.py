"""The in-guest API relay: each machine's credential and the task serving its socket.

A non-isolated machine's agent serves an API socket in the guest; each connection a
guest process makes there is relayed to the daemon's handler (`serve_guests`) with
the machine's identity. Every VM process (boot, fork child, restore, wake, a RAM swap,
a daemon restart) gets a new credential, in the guest before its start answers; only
its sha256 is kept here. A RAM swap keeps the relayed connections (`keep`): the guest,
the fork call it made included, runs on in the new VM process.

The relay needs one thing of its node: which VM process is a machine's now
(`CurrentVm`); a relay ends once its VM process is no longer the machine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import secrets
from collections.abc import Callable

from boxd.engine.base import GuestStream, MachineHandle
from boxd.errors import BoxdError
from boxd.services import GuestApi, GuestCaller
from boxd.state import MachineRecord

log = logging.getLogger("boxd.node")

# The agent protocol minor version that serves the in-guest API socket.
GUEST_API_MINOR = 5
# A machine's in-guest API credential (docs/lifecycle.md#in-machine-auth): told apart from
# account keys, which are "boxd_" + 32 characters.
GUEST_KEY_PREFIX = "boxdm_"
# Seconds a cold boot waits for the in-guest API socket before it answers.
GUEST_API_WAIT = 30.0
# Seconds a fork child, restored or woken machine waits before serving its API socket
# unless a guest process connects sooner (`GuestRelay.serve`).
GUEST_API_DELAY = 2.0

# A machine's VM process now (None: it has none).
CurrentVm = Callable[[str], MachineHandle | None]


class GuestRelay:
    """The in-guest API of every machine of one node."""

    def __init__(self, current: CurrentVm) -> None:
        self._current = current
        # The handler the daemon serves relayed guest connections with, each machine's
        # current credential (sha256) and relay task.
        self.handler: GuestApi | None = None
        self._keys: dict[str, str] = {}
        self._relays: dict[str, asyncio.Task[None]] = {}
        # Relayed guest connections by machine; a RAM swap moves them to the new VM
        # process (`keep`).
        self._streams: dict[str, dict[int, GuestStream]] = {}
        self._keep: set[str] = set()

    def key_hash(self, machine_id: str) -> str | None:
        """The sha256 of a machine's current in-guest credential (None: it has none)."""
        return self._keys.get(machine_id)

    def new_key(self, rec: MachineRecord) -> str | None:
        """A new credential for the machine's new VM process (None: it gets none)."""
        if self.handler is None or rec.isolated:
            return None  # an isolated machine gets no credential and no route
        secret = GUEST_KEY_PREFIX + secrets.token_urlsafe(24)
        self._keys[rec.id] = hashlib.sha256(secret.encode()).hexdigest()
        return secret

    def serve(
        self, rec: MachineRecord, handle: MachineHandle, secret: str | None, *,
        lazy: bool = False,
    ) -> asyncio.Future[None] | None:
        """Serve the machine's API socket on its (new) VM process, in the background; the
        future is done once the agent serves it.

        ``lazy`` (a fork child, a restore, a wake): the guest holds its credential
        already; serving the socket runs Python in the guest, which a fresh VM process
        under TCG pays for in translation, so it waits until a guest process connects or
        `GUEST_API_DELAY` has passed (which also cuts copies of calls in flight then)."""
        if secret is None or self.handler is None:
            return None
        task = self._relays.pop(rec.id, None)
        if task is not None:
            task.cancel()
        if rec.id in self._keep:
            self._keep.discard(rec.id)
            lazy = not self._streams.get(rec.id)  # calls in flight wait for it
        else:
            self.end_streams(rec.id)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._relays[rec.id] = asyncio.create_task(
            self._relay(rec.id, rec.account_id, handle, started, secret,
                        GUEST_API_DELAY if lazy else 0.0),
            name=f"guest-api {rec.id}")
        return started

    @staticmethod
    async def started(started: asyncio.Future[None] | None) -> None:
        """Wait (briefly) until the agent serves the socket."""
        if started is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(started), GUEST_API_WAIT)

    def stop(self, machine_id: str) -> None:
        """Revoke the machine's credential and stop serving its socket."""
        self._keys.pop(machine_id, None)
        task = self._relays.pop(machine_id, None)
        if task is not None:
            task.cancel()
        if machine_id not in self._keep:
            self.end_streams(machine_id)

    def keep(self, machine_id: str) -> None:
        """The same guest runs on in a new VM process (a RAM swap): so do its calls."""
        self._keep.add(machine_id)

    def drop_kept(self, machine_id: str) -> None:
        """The new VM process of a swap did not start: end the calls kept for it."""
        if machine_id in self._keep:
            self._keep.discard(machine_id)
            self.end_streams(machine_id)

    def end_streams(self, machine_id: str) -> None:
        for stream in self._streams.pop(machine_id, {}).values():
            stream.end()

    def close(self) -> None:
        for task in self._relays.values():
            task.cancel()
        self._relays.clear()
        self._keys.clear()
        self._keep.clear()
        for mid in list(self._streams):
            self.end_streams(mid)

    async def _relay(self, machine_id: str, account_id: str, handle: MachineHandle,
                     started: asyncio.Future[None], secret: str, delay: float) -> None:
        """Serve one VM's API socket, with its credential, on each of its agent
        connections while that VM is the machine's (after ``delay``, or sooner when a
        guest process connects)."""
        if delay > 0:
            await self._wait_for_guest(handle, delay)
        streams = self._streams.setdefault(machine_id, {})
        caller = GuestCaller(machine_id, account_id, functools.partial(self.key_hash, machine_id))

        def on_started() -> None:
            if not started.done():
                started.set_result(None)

        try:
            while self._current(machine_id) is handle and self.handler is not None:
                try:
                    agent = await handle.agent(timeout=60.0)
                    if not agent.supports(GUEST_API_MINOR):
                        log.info("machine=%s event=no_guest_api reason=old_agent", machine_id)
                        return
                    await agent.serve_relay(secret, functools.partial(self.handler, caller),
                                            streams=streams, on_started=on_started)
                except BoxdError as exc:
                    log.info("machine=%s event=guest_api_stopped reason=%r", machine_id,
                             exc.message)
                    if not handle.alive():
                        return
                await asyncio.sleep(0.5)  # the connection broke: serve the next one
        finally:
            on_started()  # nobody waits for a relay that is not coming

    @staticmethod
    async def _wait_for_guest(handle: MachineHandle, delay: float) -> None:
        wanted = asyncio.Event()
        try:
            (await handle.agent(timeout=60.0)).on_guest_connect(wanted.set)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wanted.wait(), delay)
        except BoxdError:
            pass  # the relay's loop finds out


__all__ = ["GUEST_API_DELAY", "GUEST_API_MINOR", "GUEST_KEY_PREFIX", "GuestRelay"]
