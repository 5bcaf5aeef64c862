"""A new machine's network policy from its request: host ports checked against the
daemon's own, egress names resolved (once, now). See `boxd.net_policy`."""

from __future__ import annotations

import asyncio

from boxd import models
from boxd.errors import InvalidRequest
from boxd.net_policy import DEFAULT, NetPolicy, check_expose_host, resolve_egress
from boxd.node._ports import bands, ephemeral_range

#: Loopback ports the daemon itself listens on (its TCP API, E2B's, the console's):
#: registered by the server as it binds them; never exposed to a machine.
LISTENING: set[int] = set()


def reserved(port: int) -> str | None:
    """Why a host loopback port may not be exposed to a machine, or None.

    The daemon's own listeners, and the bands boxd picks machines' URL ports and VM
    forwards from (`boxd.node._ports`): exposing one would let a machine reach another
    machine's guest (a forward needs no token) or URL.
    """
    if port in LISTENING:
        return "the daemon listens on it"
    for band in bands(ephemeral_range()):
        if port in band:
            return (f"boxd gives machines' URL and forward ports from {band.start}-"
                    f"{band.stop - 1}")
    return None


async def policy_for(req: models.MachineCreate) -> NetPolicy:
    """The policy ``req`` asks for (egress names resolved in a thread).

    Raises:
        InvalidRequest: a bad or reserved port, a bad egress entry or a name that does
            not resolve, or a policy on an isolated machine.
    """
    if not req.expose_host and req.egress is None:
        return DEFAULT
    policy = NetPolicy(
        check_expose_host(req.expose_host, reserved),
        await asyncio.to_thread(resolve_egress, req.egress) if req.egress is not None
        else None)
    check_isolated(req.isolated, policy)
    return policy


def check_isolated(isolated: bool, policy: NetPolicy) -> None:
    """Refuse a policy for a machine with no network.

    Raises:
        InvalidRequest: ``isolated`` with ``expose_host`` or ``egress``.
    """
    if isolated and policy.restricted:
        raise InvalidRequest(
            "an isolated machine has no network: expose_host and egress need one",
            field="expose_host" if policy.expose_host else "egress",
            hint="create it without isolated, or without expose_host and egress")


__all__ = ["LISTENING", "check_isolated", "policy_for", "reserved"]
