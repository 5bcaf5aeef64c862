"""A machine's own network filter, for machines with ``expose_host`` or ``egress``.

Every other machine's passt (QEMU) or pasta (gVisor) runs as ``boxd-net`` and is judged
by the shared table ``inet boxd_egress`` (`boxd.engine.qemu._net`). A machine with a
policy of its own (`boxd.net_policy.NetPolicy`) gets an id of its own instead: its
passt or pasta runs as uid and gid ``base + slot`` (numeric, no account: a range that
no user, group or subordinate id range of the host overlaps, checked before use), and
the table ``inet boxd_machines`` judges that uid's new connections by the machine's own
chain ``m<uid>``:

- ``127.0.0.1`` on an exposed port: accepted. passt and pasta run without
  ``--no-map-gw`` for such a machine, so the guest's connections to its gateway
  (``host.boxd.internal``) become connections to the host's loopback, and only the
  exposed ports pass;
- DNS to the host's resolvers: accepted (as for every machine);
- any other address of the host, and the blocked ranges (private, link-local, ...):
  rejected, whatever the egress list says;
- then, with an egress list, its addresses (and ports) are accepted and everything else
  rejected; without one, everything else is accepted (the default policy).

``boxd_egress`` lets these uids through (its first rule accepts every uid but
``boxd-net``'s) and ``boxd_machines`` rejects a uid of the range that has no chain:
deleting or rebuilding the shared table cannot widen a machine's policy.

A slot is free when no process runs as its uid (passt and pasta are the only ones); its
chain is rewritten when it is next taken, so a chain left by a machine that ended (or a
daemon that died) does nothing. The rules of one machine are installed in one ``nft``
transaction with the table's own (idempotent) rules.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

from boxd.config import net_id_base
from boxd.errors import HostSetupError
from boxd.net_policy import BLOCKED_V4, BLOCKED_V6, NetPolicy, parse_rule

TABLE = "boxd_machines"
#: The first id of the range (``BOXD_NET_ID_BASE``): high, and below 2**31.
DEFAULT_BASE = 0x7A000000
SLOTS = 4096
#: Seconds a slot stays taken before its process shows in /proc.
_HOLD = 60.0


def id_base() -> int:
    """The first uid/gid of machines' own network ids (``BOXD_NET_ID_BASE``).

    Raises:
        HostSetupError: not an integer in 1000-(2**31 - SLOTS).
    """
    raw = net_id_base()
    try:
        base = int(raw, 0) if raw else DEFAULT_BASE
    except ValueError:
        base = -1
    if not 1000 <= base <= 2**31 - SLOTS:
        raise HostSetupError(f"BOXD_NET_ID_BASE={raw!r} is not an id in 1000-{2**31 - SLOTS}",
                             hint=f"unset it (default {DEFAULT_BASE})")
    return base


def check_ids(base: int, etc: Path = Path("/etc")) -> None:
    """Refuse a range that a user, group or subordinate id range of the host overlaps
    (a machine's network process would own their files).

    Raises:
        HostSetupError: an id of the range is in use.
    """
    end = base + SLOTS
    for name in ("passwd", "group"):
        for line in _lines(etc / name):
            fields = line.split(":")
            if len(fields) > 2 and fields[2].isdigit() and base <= int(fields[2]) < end:
                raise _overlap(base, f"{name} entry {fields[0]!r}")
    for name in ("subuid", "subgid"):
        for line in _lines(etc / name):
            fields = line.split(":")
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                lo, count = int(fields[1]), int(fields[2])
                if lo < end and base < lo + count:
                    raise _overlap(base, f"{name} range of {fields[0]!r}")


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _overlap(base: int, what: str) -> HostSetupError:
    return HostSetupError(
        f"machines' network ids {base}-{base + SLOTS - 1} overlap the {what}",
        hint="set BOXD_NET_ID_BASE to a free range of 4096 ids")


def running_ids(base: int, proc: Path = Path("/proc")) -> set[int]:
    """The uids of the range that a process runs as now."""
    out: set[int] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
                if base <= uid < base + SLOTS:
                    out.add(uid)
                break
    return out


class Slots:
    """Hands out the ids of machines' network processes."""

    def __init__(self, base: int) -> None:
        self.base = base
        self._lock = threading.Lock()
        self._taken: dict[int, float] = {}

    def take(self) -> int:
        """A uid no process runs as and none was given in the last minute.

        Raises:
            HostSetupError: every slot is in use.
        """
        with self._lock:
            now = time.monotonic()
            self._taken = {u: t for u, t in self._taken.items() if now - t < _HOLD}
            busy = running_ids(self.base) | set(self._taken)
            for uid in range(self.base, self.base + SLOTS):
                if uid not in busy:
                    self._taken[uid] = now
                    return uid
        raise HostSetupError(f"all {SLOTS} network ids for machines with a network policy "
                             "are in use", hint="delete machines with expose_host or egress")


def table_script(base: int) -> str:
    """The table, its map and its output chain (idempotent: existing machines' chains
    and map entries stay)."""
    t = f"inet {TABLE}"
    return (
        f"table {t} {{}}\n"
        f"add map {t} machines {{ typeof meta skuid : verdict; }}\n"
        f"add chain {t} output {{ type filter hook output priority 0; policy accept; }}\n"
        f"flush chain {t} output\n"
        f"add rule {t} output meta skuid != {base}-{base + SLOTS - 1} accept\n"
        f"add rule {t} output ct state established,related accept\n"
        f"add rule {t} output meta skuid vmap @machines\n"
        f"add rule {t} output reject\n"
    )


def machine_script(uid: int, policy: NetPolicy, dns: list[str]) -> str:
    """One machine's chain (rewritten whole) and its map entry."""
    t, c = f"inet {TABLE}", f"m{uid}"
    rules: list[str] = []
    if policy.expose_host:
        ports = ", ".join(str(p) for p in policy.expose_host)
        rules.append(f"ip daddr 127.0.0.1 tcp dport {{ {ports} }} accept")
    if dns:
        rules.append(f"ip daddr {{ {', '.join(dns)} }} meta l4proto {{ tcp, udp }} "
                     "th dport 53 accept")
    rules += ["fib daddr type local reject",
              f"ip daddr {{ {', '.join(BLOCKED_V4)} }} reject",
              f"ip6 daddr {{ {', '.join(BLOCKED_V6)} }} reject"]
    if policy.egress is None:
        rules.append("accept")
    else:
        for text in policy.egress:
            net, port = parse_rule(text)
            rules.append(f"ip daddr {net} accept" if port is None else
                         f"ip daddr {net} meta l4proto {{ tcp, udp }} th dport {port} accept")
        rules.append("reject")
    return (f"add chain {t} {c}\nflush chain {t} {c}\n"
            + "".join(f"add rule {t} {c} {r}\n" for r in rules)
            + f"add element {t} machines {{ {uid} : jump {c} }}\n")


def install(base: int, uid: int, policy: NetPolicy, dns: list[str]) -> None:
    """Install the table and the chain of the machine whose network runs as ``uid``.

    Raises:
        HostSetupError: nft is missing or refused the rules.
    """
    nft = shutil.which("nft")
    if nft is None:
        raise HostSetupError("nft (nftables) is not installed: a machine's network "
                             "policy cannot be enforced", hint="run scripts/setup-host.sh")
    script = table_script(base) + machine_script(uid, policy, dns)
    proc = subprocess.run([nft, "-f", "-"], input=script.encode(), capture_output=True,
                          check=False)
    if proc.returncode != 0:
        raise HostSetupError(
            "installing a machine's network policy failed: "
            f"{proc.stderr.decode(errors='replace').strip()[-400:]}",
            hint="the kernel needs nf_tables with fib and conntrack support")


class Policies:
    """The slots and rules of one engine's machines with a network policy."""

    def __init__(self) -> None:
        self._slots: Slots | None = None

    def prepare(self, policy: NetPolicy, filtered: bool, dns: list[str]) -> int:
        """Take a slot for a machine's network process and install its rules; its uid.

        Raises:
            HostSetupError: the daemon is not root (nothing is filtered), the id range
                overlaps the host's, every slot is taken, or nft failed.
        """
        if not filtered:
            raise HostSetupError(
                "expose_host and egress need the network filter, which a daemon that is "
                "not root cannot install", hint="run boxd serve as root (scripts/"
                "setup-host.sh), or create the machine without expose_host and egress")
        if self._slots is None:
            base = id_base()
            check_ids(base)
            self._slots = Slots(base)
        uid = self._slots.take()
        install(self._slots.base, uid, policy, dns)
        return uid


__all__ = ["DEFAULT_BASE", "SLOTS", "TABLE", "Policies", "Slots", "check_ids", "id_base",
           "install", "machine_script", "running_ids", "table_script"]
