"""A container image's service: its ENTRYPOINT + CMD, started once a machine of the
image has booted, and the readiness its HEALTHCHECK (else its first EXPOSEd TCP port)
decides.

The service is a spawned process of the machine (`boxd.node._processes`) with the id
`SERVICE_ID` whose stdout and stderr are its log (not frames): `boxd machine logs` reads
the node's last `LOG_TAIL` bytes of it by offset. It runs with the image's ENV, WORKDIR
and USER, as exec does. A fork child runs its source's copy (the guest's memory has
it); its log follows once something reads it (a re-attach on the child's connection).

Readiness (`wait_ready`): with a HEALTHCHECK (``CMD`` argv or ``CMD-SHELL`` string), the
machine is ready once the check exits 0; without one, once the first EXPOSEd TCP port
accepts a connection in the guest; with neither, once the agent answers (as before).
``NONE`` turns the check off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from boxd.engine.base import Agent, MachineHandle
from boxd.errors import BoxdError, StateError
from boxd.state import MachineRecord, RunImage

log = logging.getLogger("boxd.node")

#: The process id of a machine's service in its process table.
SERVICE_ID = "service"
#: Seconds between two readiness checks, and the longest one check may run.
CHECK_EVERY = 0.5
CHECK_TIMEOUT = 10.0


def service_argv(run: RunImage | None) -> list[str] | None:
    """What the image's service runs (ENTRYPOINT then CMD), or None: none, or turned
    off (``service=False``)."""
    if run is None or not run.service:
        return None
    argv = [*run.entrypoint, *run.cmd]
    return argv or None


def health_argv(run: RunImage) -> list[str] | None:
    """The HEALTHCHECK as an argv (``CMD-SHELL`` runs ``/bin/sh -c``), or None."""
    test = list(run.healthcheck)
    if not test or test[0] == "NONE":
        return None
    if test[0] == "CMD":
        return test[1:] or None
    if test[0] == "CMD-SHELL":
        return ["/bin/sh", "-c", " ".join(test[1:])] if len(test) > 1 else None
    return test  # a bare argv (an image writer's own form)


def ready_port(run: RunImage) -> int | None:
    """The first EXPOSEd TCP port (``8000/tcp``, ``8000``), or None."""
    for spec in run.exposed_ports:
        port, _, proto = spec.partition("/")
        if proto in ("", "tcp") and port.isdigit() and 0 < int(port) < 65536:
            return int(port)
    return None


async def _check_once(agent: Agent, handle: MachineHandle, run: RunImage,
                      defaults: dict[str, Any]) -> str | None:
    """One readiness check: None when ready, else why not (for the timeout's message)."""
    argv = health_argv(run)
    if argv is not None:
        try:
            out = await agent.run(argv, timeout=CHECK_TIMEOUT, max_output=4096, **defaults)
        except BoxdError as exc:
            return f"its HEALTHCHECK {argv} could not run: {exc.message}"
        if out.exit_code == 0 and not out.timed_out:
            return None
        said = (out.stdout + out.stderr).decode(errors="replace").strip()[-300:]
        return (f"its HEALTHCHECK {argv} "
                + ("timed out" if out.timed_out else f"exited {out.exit_code}")
                + (f": {said}" if said else ""))
    port = ready_port(run)
    if port is None:
        return None
    try:
        _reader, writer = await handle.open_http(port)
    except OSError as exc:
        return f"nothing accepts connections on its EXPOSEd port {port} ({exc})"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def wait_ready(rec: MachineRecord, handle: MachineHandle, agent: Agent,
                     defaults: dict[str, Any], timeout: float) -> None:
    """Until the machine's image says its service is ready (see the module).

    Raises:
        StateError: not ready within ``timeout`` seconds (the message says what the
            last check saw).
    """
    run = rec.run_image
    if run is None or service_argv(run) is None or (
            health_argv(run) is None and ready_port(run) is None):
        return  # no service (or not started): ready once the agent answers
    deadline = time.monotonic() + timeout
    while True:
        why = await _check_once(agent, handle, run, defaults)
        if why is None:
            return
        if time.monotonic() + CHECK_EVERY > deadline:
            raise StateError(
                f"machine {rec.name!r} runs but its service is not ready after "
                f"{timeout:.0f} s: {why}", machine=rec.name,
                hint=f"`boxd machine logs {rec.name}` shows the service's output")
        await asyncio.sleep(CHECK_EVERY)


__all__ = ["SERVICE_ID", "health_argv", "ready_port", "service_argv", "wait_ready"]
