"""Loopback ports for machine URLs and VM forwards.

A port is picked here and bound a moment later by another process (passt binds a VM's
forward; the daemon binds a URL). Two things can take it in between:

- this process handing the same port out again (a URL and a forward picked a moment
  apart): ports given recently are never given again;
- any process on the host: a ``bind(("127.0.0.1", 0))`` elsewhere, or the source port of
  an outgoing connection, both drawn from the kernel's ephemeral range. Ports are
  therefore picked *outside* that range (``net.ipv4.ip_local_port_range``), at random in
  20000 to (first ephemeral - 1) and (last ephemeral + 1) to 65535, and checked free with a
  bind. 20000 stays clear of Ray's worker ports (10002 to 19999 by default).

A host whose ephemeral range covers both bands falls back to the kernel's choice.
"""

from __future__ import annotations

import collections
import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000
_TRIES = 64

_given: collections.deque[int] = collections.deque(maxlen=4096)
_rng = random.SystemRandom()


def ephemeral_range(path: Path = _RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default when it cannot be read)."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


def bands(ephemeral: tuple[int, int]) -> list[range]:
    """The port ranges outside ``ephemeral`` that boxd picks from."""
    lo, hi = ephemeral
    out = [range(_LOWEST, min(lo, 65536)), range(max(hi + 1, _LOWEST), 65536)]
    return [r for r in out if len(r) > 0]


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def free_port() -> int:
    """A free loopback port outside the ephemeral range, never one given recently."""
    choices = bands(ephemeral_range())
    weights = [len(r) for r in choices]
    port = 0
    for _ in range(_TRIES):
        port = _rng.choice(_rng.choices(choices, weights)[0]) if choices else _kernel_port()
        if port not in _given and _is_free(port):
            break
    _given.append(port)
    return port


__all__ = ["bands", "ephemeral_range", "free_port"]
