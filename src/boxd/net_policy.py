"""A machine's network policy: host loopback ports it may reach, and where else it may go.

``expose_host`` lists TCP ports of the host's loopback (127.0.0.1) that the machine
reaches at ``host.boxd.internal:PORT`` (the guest's gateway address, `GATEWAY`), and
nothing else of the host. ``egress`` is an allow-list of the machine's outbound
connections (None: the default, every public address). Both are fixed when the machine
is created and inherited by its forks; the engines enforce them (docs/security.md, "A
guest's route to the host").

This module is the I/O-free part (syntax, normal form, the ranges no machine reaches)
plus `resolve_egress`, which turns host names into addresses once, at create time.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from boxd.errors import InvalidRequest

#: The name a machine reaches the host's exposed ports at, and the address it maps to
#: (the guest's gateway: passt and pasta map it to the host's loopback when asked).
HOST_NAME = "host.boxd.internal"
GATEWAY = "10.0.2.2"
MAX_EXPOSED = 16
MAX_EGRESS = 64
#: Addresses resolved from egress names, at most (a name with many A records).
MAX_RULES = 256

#: Destinations no machine may open a connection to (besides the host's own addresses).
BLOCKED_V4 = (
    "0.0.0.0/8",        # "this network"
    "10.0.0.0/8",       # private (RFC 1918)
    "100.64.0.0/10",    # shared address space (carrier-grade NAT)
    "127.0.0.0/8",      # loopback
    "169.254.0.0/16",   # link-local (cloud metadata services live here)
    "172.16.0.0/12",    # private
    "192.0.0.0/24",     # IETF protocol assignments
    "192.168.0.0/16",   # private
    "198.18.0.0/15",    # benchmarking
    "224.0.0.0/3",      # multicast and reserved, broadcast
)
BLOCKED_V6 = (
    "::/127",           # unspecified, loopback
    "::ffff:0:0/96",    # IPv4-mapped (would bypass the IPv4 list)
    "64:ff9b::/96",     # NAT64 (idem)
    "fc00::/7",         # unique local
    "fe80::/10",        # link-local
    "ff00::/8",         # multicast
)
_BLOCKED = tuple(ipaddress.IPv4Network(n) for n in BLOCKED_V4)
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?$")


@dataclass(frozen=True)
class NetPolicy:
    """What a machine's network reaches beyond the default (docs/security.md).

    ``egress`` holds resolved rules, ``A.B.C.D/N`` or ``A.B.C.D/N:PORT`` (TCP and UDP to
    that port); None is the default policy, ``()`` no destination at all (DNS to the
    host's resolvers and the exposed host ports stay).
    """

    expose_host: tuple[int, ...] = ()
    egress: tuple[str, ...] | None = None

    @property
    def restricted(self) -> bool:
        """True when the machine needs a filter of its own (anything but the default)."""
        return bool(self.expose_host) or self.egress is not None

    def to_json(self) -> dict[str, Any] | None:
        """The record's column (None for the default policy)."""
        if not self.restricted:
            return None
        return {"expose_host": list(self.expose_host),
                "egress": list(self.egress) if self.egress is not None else None}

    @classmethod
    def from_json(cls, data: object) -> NetPolicy:
        """The policy a record's column holds (the default for None)."""
        if not isinstance(data, dict):
            return cls()
        egress = data.get("egress")
        return cls(tuple(int(p) for p in data.get("expose_host") or ()),
                   tuple(str(e) for e in egress) if egress is not None else None)


#: The default policy: no host port, every public address.
DEFAULT = NetPolicy()


def check_expose_host(ports: Iterable[object], reserved: Callable[[int], str | None]
                      = lambda _p: None) -> tuple[int, ...]:
    """``ports`` as sorted unique TCP ports of the host's loopback.

    ``reserved(port)`` says why a port may not be exposed (the daemon's own), or None.

    Raises:
        InvalidRequest: not ints in 1-65535, too many, or a reserved port.
    """
    out: set[int] = set()
    for p in ports:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535:
            raise InvalidRequest(f"expose_host: {p!r} is not a TCP port (1-65535)",
                                 field="expose_host")
        if why := reserved(p):
            raise InvalidRequest(f"expose_host: port {p} cannot be exposed: {why}",
                                 field="expose_host",
                                 hint="serve it on another loopback port, e.g. 8000")
        out.add(p)
    if len(out) > MAX_EXPOSED:
        raise InvalidRequest(f"expose_host: at most {MAX_EXPOSED} ports", field="expose_host")
    return tuple(sorted(out))


@dataclass(frozen=True)
class EgressEntry:
    """One parsed egress entry: a network or a host name, and an optional port."""

    network: ipaddress.IPv4Network | None
    name: str | None
    port: int | None


def _bad(entry: str, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"egress: {entry!r} {why}", field="egress",
        hint="use CIDRs (203.0.113.0/24), addresses, host names, or any of them with "
             ":PORT (example.com:443); the host's loopback is expose_host's")


def parse_egress_entry(entry: object) -> EgressEntry:
    """Parse one egress entry (no I/O).

    Raises:
        InvalidRequest: not a CIDR, an IPv4 address or a host name, each with an optional
            ``:PORT``; an IPv6 address (machines are IPv4 only); a range no machine
            reaches (private, loopback, link-local, ...).
    """
    if not isinstance(entry, str) or not 0 < len(entry) <= 260:
        raise _bad(str(entry)[:80], "is not a string of 1-260 characters")
    host, port = entry, None
    if entry.count(":") == 1:
        host, _, digits = entry.partition(":")
        if not digits.isdigit() or not 1 <= int(digits) <= 65535:
            raise _bad(entry, "has no port in 1-65535 after ':'")
        port = int(digits)
    elif ":" in entry:
        raise _bad(entry, "is IPv6: machines' network is IPv4 only")
    try:
        net = ipaddress.IPv4Network(host, strict=False)
    except ValueError:
        if "/" in host or re.fullmatch(r"[0-9.]+", host):
            raise _bad(entry, "is not a valid IPv4 address or CIDR") from None
        if not _NAME.match(host):
            raise _bad(entry, "is not an address, CIDR or host name") from None
        return EgressEntry(None, host.rstrip(".").lower(), port)
    check_reachable(net, entry)
    return EgressEntry(net, None, port)


def check_reachable(net: ipaddress.IPv4Network, entry: str) -> None:
    """Refuse a network wholly inside a range no machine reaches: it could never work.

    A wider one (0.0.0.0/0) is fine: the blocked ranges are rejected before it.

    Raises:
        InvalidRequest: ``net`` lies inside a blocked range.
    """
    for blocked in _BLOCKED:
        if net.subnet_of(blocked):
            where = ("the host's loopback: list its ports in expose_host"
                     if blocked.network_address.is_loopback
                     else f"inside {blocked}, which no machine reaches")
            raise _bad(entry, f"is {where}")


def rule(net: ipaddress.IPv4Network, port: int | None) -> str:
    """One resolved egress rule in its stored form."""
    return f"{net}" + (f":{port}" if port is not None else "")


def parse_rule(text: str) -> tuple[ipaddress.IPv4Network, int | None]:
    """A stored rule back into its network and port."""
    net, _, port = text.partition(":")
    return ipaddress.IPv4Network(net), int(port) if port else None


def _lookup(name: str) -> list[str]:
    infos = socket.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def resolve_egress(entries: Sequence[object],
                   lookup: Callable[[str], list[str]] = _lookup) -> tuple[str, ...]:
    """The stored rules of an egress list: names resolved now, once (blocking: call it in
    a thread). A name's addresses in blocked ranges are kept out.

    Raises:
        InvalidRequest: a bad entry, too many, or a name that does not resolve to a
            reachable address.
    """
    if len(entries) > MAX_EGRESS:
        raise InvalidRequest(f"egress: at most {MAX_EGRESS} entries", field="egress")
    rules: list[str] = []
    for entry in entries:
        parsed = parse_egress_entry(entry)
        if parsed.network is not None:
            rules.append(rule(parsed.network, parsed.port))
            continue
        assert parsed.name is not None
        try:
            addrs = lookup(parsed.name)
        except (OSError, UnicodeError) as exc:
            raise _bad(str(entry), f"does not resolve ({exc})") from None
        nets = [ipaddress.IPv4Network(a) for a in addrs]
        usable = [n for n in nets if not any(n.subnet_of(b) for b in _BLOCKED)]
        if not usable:
            raise _bad(str(entry), f"resolves to no address a machine reaches ({addrs})")
        rules += [rule(n, parsed.port) for n in usable]
    out = tuple(dict.fromkeys(rules))
    if len(out) > MAX_RULES:
        raise InvalidRequest(f"egress: its names resolve to over {MAX_RULES} addresses",
                             field="egress")
    return out


__all__ = ["BLOCKED_V4", "BLOCKED_V6", "DEFAULT", "GATEWAY", "HOST_NAME", "MAX_EGRESS",
           "MAX_EXPOSED", "EgressEntry", "NetPolicy", "check_expose_host", "check_reachable",
           "parse_egress_entry", "parse_rule", "resolve_egress", "rule"]
