"""A non-isolated machine's network: one passt process per QEMU process, behind a filter.

QEMU's own user networking (slirp) maps the gateway 10.0.2.2 to the host's loopback,
so a guest reached every 127.0.0.1 service of the host: the daemon's API, other
machines' URL ports, anything else. Instead each QEMU process gets a passt process
(``passt --no-map-gw``): the two share a socketpair (``-netdev stream`` with
``addr.type=fd`` on QEMU's side, ``--fd`` on passt's), so nothing waits for a socket file
and the pair ends together (passt quits when QEMU closes its end). passt turns the
guest's connections into ordinary sockets of its own, which makes them subject to the
host's packet filter by the socket owner's uid.

When the daemon runs as root, passt runs as ``boxd-net`` (``BOXD_NET_USER``) and the
daemon installs an nftables table ``inet boxd_egress`` that rejects every *new*
connection of that user to a local address of the host (``fib daddr type local``:
loopback and every address of every interface), to private, shared, link-local,
multicast and reserved ranges (IPv4 and IPv6), except DNS to the host's own name
servers (passt forwards the guest's queries to them). Replies on connections the host
opened (the daemon's URL proxy into passt's forwarded port) are established traffic
and pass. Public addresses stay reachable: pip and DNS work.

The guest's view is the one slirp gave it (address 10.0.2.15/24, gateway 10.0.2.2, name
server 10.0.2.3), so images and forks need no change: the migration stream carries the
virtio-net device's state, not its backend, and a fork child gets its own passt.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import pwd
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from boxd import config as cfg
from boxd.errors import HostSetupError, MachineFailed
from boxd.net_policy import BLOCKED_V4, BLOCKED_V6
from boxd.storage.fds import OwnedFd

log = logging.getLogger("boxd.engine")

TABLE = "boxd_egress"
GUEST_ADDRESS = "10.0.2.15"
GUEST_GATEWAY = "10.0.2.2"
GUEST_DNS = "10.0.2.3"

@dataclass(frozen=True)
class NetUser:
    """The unprivileged user passt runs as when the daemon is root."""

    name: str
    uid: int


def resolvers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The host's IPv4 name servers (passt forwards the guest's DNS to the first)."""
    out: list[str] = []
    try:
        text = resolv_conf.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            try:
                addr = ipaddress.ip_address(words[1].split("%")[0])
            except ValueError:
                continue
            if addr.version == 4 and str(addr) not in out:
                out.append(str(addr))
    return out


def ruleset(uid: int, dns: list[str]) -> str:
    """The nftables script that (re)creates the filter table atomically."""
    dns_rule = ""
    if dns:
        dns_rule = (f"    ip daddr {{ {', '.join(dns)} }} meta l4proto {{ tcp, udp }} "
                    "th dport 53 accept\n")
    return (
        f"table inet {TABLE} {{}}\n"
        f"delete table inet {TABLE}\n"
        f"table inet {TABLE} {{\n"
        "  chain output {\n"
        "    type filter hook output priority 0; policy accept;\n"
        f"    meta skuid != {uid} accept\n"
        "    ct state established,related accept\n"
        f"{dns_rule}"
        "    fib daddr type local reject\n"
        f"    ip daddr {{ {', '.join(BLOCKED_V4)} }} reject\n"
        f"    ip6 daddr {{ {', '.join(BLOCKED_V6)} }} reject\n"
        "  }\n"
        "}\n"
    )


def install_filter(uid: int, dns: list[str] | None = None) -> None:
    """Install (or refresh) the egress filter for passt's user. Idempotent and atomic.

    Raises:
        HostSetupError: nft is missing or the kernel refused the table.
    """
    nft = shutil.which("nft")
    if nft is None:
        raise HostSetupError(
            "nft (nftables) is not installed: machines' network cannot be filtered",
            hint="run scripts/setup-host.sh (it installs nftables and passt), or create "
                 "machines with --isolated",
        )
    script = ruleset(uid, resolvers() if dns is None else dns)
    proc = subprocess.run([nft, "-f", "-"], input=script.encode(), capture_output=True,
                          check=False)
    if proc.returncode != 0:
        raise HostSetupError(
            f"installing the machine network filter failed: "
            f"{proc.stderr.decode(errors='replace').strip()[-400:]}",
            hint="the kernel needs nf_tables with fib and conntrack support; or create "
                 "machines with --isolated",
        )


def filter_installed(uid: int) -> bool:
    """True when this network namespace holds the filter table for ``uid``."""
    nft = shutil.which("nft")
    if nft is None:
        return False
    proc = subprocess.run([nft, "list", "table", "inet", TABLE], capture_output=True,
                          check=False)
    return proc.returncode == 0 and f"skuid != {uid}".encode() in proc.stdout


def resolve_net_user(name: str) -> NetUser | None:
    """passt's user when the daemon runs as root (None otherwise).

    Raises:
        HostSetupError: the daemon is root and the user does not exist.
    """
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise HostSetupError(
            f"no user {name!r} for machines' network (passt runs as it)",
            hint="run scripts/setup-host.sh (it adds the system user boxd-net), or set "
                 "BOXD_NET_USER to another unprivileged user of its own",
        ) from None
    if pw.pw_uid == 0:
        raise HostSetupError(f"BOXD_NET_USER={name!r} is root",
                             hint="use an unprivileged user of its own, like boxd-net")
    return NetUser(name, pw.pw_uid)


def passt_binary() -> str:
    """The passt executable.

    Raises:
        HostSetupError: passt is not installed.
    """
    passt = shutil.which("passt")
    if passt is None:
        raise HostSetupError(
            "passt is not installed (non-isolated machines' network runs through it)",
            hint="run scripts/setup-host.sh, or apt-get install passt",
        )
    return passt


def passt_argv(passt: str, *, fd: int, port: int | None, user: NetUser | None,
               log_file: Path, own_id: int | None = None,
               map_gw: bool = False) -> list[str]:
    """passt's command line for one QEMU process (its end of the socketpair is ``fd``).

    ``own_id``: the uid and gid of a machine with a network policy of its own (see
    `_policy`), else it runs as ``user``; ``map_gw``: the guest's gateway is the host's
    loopback (``expose_host``: the policy's filter passes the exposed ports only)."""
    argv = [
        passt, "--foreground", "--quiet", "--one-off", "--fd", str(fd),
        *([] if map_gw else ["--no-map-gw"]),
        "--ipv4-only", "--no-dhcp", "--no-ndp", "--no-dhcpv6", "--no-ra",
        "--address", GUEST_ADDRESS, "--netmask", "24", "--gateway", GUEST_GATEWAY,
        "--dns-forward", GUEST_DNS,
        "--udp-ports", "none",
        "--tcp-ports", f"127.0.0.1/{port}:{cfg.GUEST_HTTP_PORT}" if port else "none",
        "--log-file", str(log_file),
    ]
    if own_id is not None:
        argv += ["--runas", f"{own_id}:{own_id}"]
    elif user is not None:
        argv += ["--runas", user.name]
    return argv


def _stderr_file(log_file: Path) -> Path:
    return log_file.with_name(log_file.name + ".stderr")


def spawn_passt(passt: str, *, port: int | None, user: NetUser | None,
                log_file: Path, own_id: int | None = None,
                map_gw: bool = False) -> tuple[subprocess.Popen[bytes], OwnedFd]:
    """Start passt on one end of a new socketpair; returns it and QEMU's end (which the
    caller passes to QEMU and then closes).

    Raises:
        HostSetupError: passt could not be started.
    """
    # passt opens its log at once: the machine's log directory must exist before it
    # starts (QEMU's start creates it too, a moment later: passt lost that race now and
    # then and quit, leaving a running machine with no network and a URL answering 502).
    log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    qemu_end, passt_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        log_file.unlink(missing_ok=True)
        argv = passt_argv(passt, fd=passt_end.fileno(), port=port, user=user,
                          log_file=log_file, own_id=own_id, map_gw=map_gw)
        try:
            # What passt says before its log is open (a bad option, the user switch) goes
            # to stderr: keep it beside the log.
            with OwnedFd.open(_stderr_file(log_file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                              0o600) as fd:  # the machine's files are the daemon's
                os.fchmod(fd.fd, 0o600)
                popen = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=fd.fd, start_new_session=True, pass_fds=(passt_end.fileno(),),
                )
        except OSError as exc:
            raise HostSetupError(f"cannot start passt: {exc}",
                                 hint="run scripts/setup-host.sh") from exc
    except BaseException:
        qemu_end.close()
        raise
    finally:
        passt_end.close()
    return popen, OwnedFd(qemu_end.detach())


def _listeners(port: int, table: Path = Path("/proc/net/tcp")) -> set[str]:
    """The socket inodes listening on 127.0.0.1:``port`` (or on any address)."""
    want = (f"0100007F:{port:04X}", f"00000000:{port:04X}")
    found: set[str] = set()
    with contextlib.suppress(OSError), open(table) as f:
        next(f, None)  # the header
        for line in f:
            fields = line.split()
            if len(fields) > 9 and fields[1] in want and fields[3] == "0A":  # LISTEN
                found.add(fields[9])
    return found


def _holds(pid: int, inodes: set[str]) -> bool:
    """True when process ``pid`` holds one of the socket ``inodes``."""
    fds = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fds.iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


async def wait_forward(popen: subprocess.Popen[bytes], port: int, log_file: Path,
                       machine: str, timeout: float = 20.0) -> None:
    """Wait until passt listens on the machine's forward port.

    passt exits when it cannot bind the port (another process took it after it was
    picked); the machine would then run with no network at all, and its URL answer 502
    for ever, so that is a launch failure.

    Raises:
        MachineFailed: passt exited, or did not listen within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        code = popen.poll()
        if code is not None:
            tail: list[str] = []
            for f in (log_file, _stderr_file(log_file)):
                with contextlib.suppress(OSError):
                    tail += [line for line in f.read_text(errors="replace").splitlines()
                             if line.strip() and "syslog" not in line][-2:]
            said = " | ".join(dict.fromkeys(tail))  # its log and stderr say it twice
            if "routable interface" in said or "interface not usable" in said:
                hint = ("the host has no default route for passt to use: create the "
                        "machine --isolated, or give the host a route")
            elif "bind" in said:
                hint = f"another process took its forward port {port}: try again"
            else:
                hint = f"see {log_file}"
            raise MachineFailed(
                f"the machine's network did not start: passt exited with status {code}"
                + (f" ({said})" if said else ""), hint=hint, machine=machine,
            )
        inodes = _listeners(port)
        if inodes and _holds(popen.pid, inodes):  # passt's own socket, not another's
            return
        if time.monotonic() > deadline:
            raise MachineFailed(
                f"the machine's network did not start: passt did not listen on port {port} "
                f"within {timeout:.0f} s", hint=f"see {log_file}", machine=machine,
            )
        await asyncio.sleep(0.002)


__all__ = ["BLOCKED_V4", "BLOCKED_V6", "NetUser", "filter_installed", "install_filter",
           "passt_argv", "passt_binary", "resolve_net_user", "resolvers", "ruleset",
           "spawn_passt", "wait_forward"]
