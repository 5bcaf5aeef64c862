"""A non-isolated gVisor machine's network: a namespace of its own, connected by pasta.

runsc's own user-space network stack (``--network=sandbox``) takes the interfaces of
the network namespace the sandbox starts in. Each machine gets a fresh one from
``pasta --no-map-gw`` (the passt package): pasta creates a user, network and PID
namespace around a holder process (``sleep infinity``), puts a tap device ``eth0`` in
it with the view a QEMU guest has (10.0.2.15/24, gateway 10.0.2.2, name server
10.0.2.3) and turns the sandbox's connections into ordinary sockets of its own. pasta
runs as ``boxd-net`` when the daemon is root, so the same nftables table as QEMU's
passt (``inet boxd_egress``, see `boxd.engine.qemu._net`) rejects its new connections
to the host's own addresses (loopback included), private, link-local and reserved
ranges; DNS to the host's resolvers passes. With ``--no-map-gw`` the gateway is not the
host: nothing in the namespace reaches the host's 127.0.0.1.

Two host details:

- pasta opens ``/dev/net/tun`` after dropping to ``boxd-net``; where the device is
  root-only (0600, as on this host) the engine gives the ``boxd-net`` group read-write
  access to it (the device only makes taps in namespaces a user already controls).
- runsc 20240729 decides it is in the host's root namespace when
  ``/proc/sys/net/core/rmem_default`` exists, and newer kernels show that file in
  every namespace, so runsc is started inside the machine's namespace in a private
  mount namespace with an empty tmpfs over ``/proc/sys/net/core``.

A restored copy (a fork child) gets a namespace and a pasta of its own; the restored
sandbox takes the interfaces of its new namespace. The holder is the namespace's
life: killing it ends pasta too.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import signal
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from boxd.engine.netpolicy import Policies
from boxd.engine.qemu import _net as passt_net
from boxd.errors import HostSetupError, MachineFailed
from boxd.net_policy import NetPolicy

TUN = Path("/dev/net/tun")
GUEST_ADDRESS = passt_net.GUEST_ADDRESS
GUEST_GATEWAY = passt_net.GUEST_GATEWAY
GUEST_DNS = passt_net.GUEST_DNS
HOLDER = ["/bin/sleep", "infinity"]
READY_TIMEOUT = 10.0
# The shell that hides /proc/sys/net/core from runsc (see the module docstring).
_HIDE_CORE = 'mount -t tmpfs -o size=4k,mode=555 boxd-netcore /proc/sys/net/core && exec "$@"'


@dataclass(frozen=True)
class GvisorNet:
    """How non-isolated gVisor machines get their network."""

    pasta: str
    user: passt_net.NetUser | None
    filtered: bool
    policies: Policies = field(default_factory=Policies)

    @classmethod
    def detect(cls, user_name: str = "boxd-net") -> GvisorNet:
        """Find pasta; as root, resolve its user, open the tap device to it and install
        the egress filter.

        Raises:
            HostSetupError: pasta, nft or the user are missing, or the filter failed.
        """
        pasta = _pasta_binary()
        user = passt_net.resolve_net_user(user_name)
        if user is not None:
            ensure_tun_access(user)
            passt_net.install_filter(user.uid)
        return cls(pasta, user, filtered=user is not None)


def _pasta_binary() -> str:
    passt = Path(passt_net.passt_binary())
    pasta = passt.with_name("pasta")
    if not pasta.exists():
        raise HostSetupError("pasta is not installed (non-isolated gVisor machines' "
                             "network runs through it)",
                             hint="run scripts/setup-host.sh, or apt-get install passt")
    return str(pasta)


def ensure_tun_access(user: passt_net.NetUser, tun: Path = TUN) -> None:
    """Let ``user``'s group open the tap device when only root may (0600).

    Raises:
        HostSetupError: there is no tap device.
    """
    try:
        st = tun.stat()
    except OSError as exc:
        raise HostSetupError(f"{tun} is missing: gVisor machines' network needs it",
                             hint="load the tun module, or create machines with "
                                  "--isolated") from exc
    if st.st_mode & 0o006 == 0o006:
        return
    try:
        gid = grp.getgrnam(user.name).gr_gid
    except KeyError:
        import pwd

        gid = pwd.getpwnam(user.name).pw_gid
    if st.st_gid != gid:
        os.chown(tun, -1, gid)
    os.chmod(tun, stat.S_IMODE(st.st_mode) | 0o060)


def pasta_argv(pasta: str, map_gw: bool = False) -> list[str]:
    """pasta's command line: a new namespace around the holder, no ports forwarded;
    ``map_gw``: the gateway is the host's loopback (``expose_host``: the machine's own
    filter passes its exposed ports only, see `boxd.engine.netpolicy`)."""
    return [
        pasta, "--foreground", "--quiet", "--config-net",
        *([] if map_gw else ["--no-map-gw"]), "--ipv4-only",
        "--no-dhcp", "--no-ndp", "--no-dhcpv6", "--no-ra", "--ns-ifname", "eth0",
        "--address", GUEST_ADDRESS, "--netmask", "24", "--gateway", GUEST_GATEWAY,
        "--dns-forward", GUEST_DNS,
        "--tcp-ports", "none", "--udp-ports", "none", "--tcp-ns", "none", "--udp-ns", "none",
        "--", *HOLDER,
    ]


@dataclass(frozen=True)
class Namespace:
    """One machine's network namespace: pasta and the holder process inside it."""

    pasta_pid: int
    holder_pid: int

    @property
    def path(self) -> str:
        return f"/proc/{self.holder_pid}/ns/net"

    def to_json(self) -> dict[str, int]:
        return {"pasta": self.pasta_pid, "holder": self.holder_pid}

    def runsc_prefix(self) -> list[str]:
        """What runsc runs under: the namespace, a private mount namespace, the tmpfs."""
        return ["nsenter", f"--net={self.path}", "unshare", "--mount", "--propagation",
                "private", "/bin/sh", "-c", _HIDE_CORE, "boxd-runsc"]

    def signal_end(self) -> None:
        """SIGKILL the namespace's holder and pasta, if they are still these processes
        (at once; `kill` also waits to reap pasta)."""
        for pid, name in ((self.holder_pid, b"sleep"), (self.pasta_pid, b"pasta")):
            if _is(pid, name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def kill(self) -> None:
        """End the namespace (the holder) and pasta, if they are still these processes,
        and reap pasta when this process started it (blocks up to 2 s: call it from a
        thread in async code)."""
        self.signal_end()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(self.pasta_pid, os.WNOHANG)
            except ChildProcessError:
                return  # not our child (a daemon restart): its parent reaps it
            if done:
                return
            time.sleep(0.005)


def _is(pid: int, name: bytes) -> bool:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return argv0.endswith(name)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _has_default_route(pid: int) -> bool:
    try:
        lines = Path(f"/proc/{pid}/net/route").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(len(f := line.split()) > 2 and f[1] == "00000000" for line in lines)


def start(net: GvisorNet, run_dir: Path, machine: str,
          policy: NetPolicy | None = None) -> Namespace:
    """A new namespace for one sandbox, configured and connected; its pids go to
    ``run_dir/net.json`` (so a daemon restart can end them). A machine with a network
    policy of its own gets a pasta with its own uid and gid and its rules installed.

    Raises:
        HostSetupError: pasta could not be started, or the policy cannot be enforced.
        MachineFailed: the namespace was not ready in time.
    """
    log_file = run_dir / "pasta.log"
    uid = gid = None
    groups: list[int] | None = None
    policy = policy or NetPolicy()
    if policy.restricted:  # the tap device is open to boxd-net's group (ensure_tun_access)
        uid = gid = net.policies.prepare(policy, net.filtered, passt_net.resolvers())
        groups = [_gid(net.user)] if net.user is not None else []
    elif net.user is not None:
        uid, gid, groups = net.user.uid, _gid(net.user), []
    try:
        with open(log_file, "ab") as err:
            popen = subprocess.Popen(
                pasta_argv(net.pasta, map_gw=bool(policy.expose_host)),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                start_new_session=True, cwd="/", user=uid, group=gid, extra_groups=groups,
            )
    except OSError as exc:
        raise HostSetupError(f"cannot start pasta: {exc}",
                             hint="run scripts/setup-host.sh") from exc
    deadline = time.monotonic() + READY_TIMEOUT
    holder = None
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            break
        kids = [c for c in _children(popen.pid) if _is(c, b"sleep")]
        if kids and _has_default_route(kids[0]):
            holder = kids[0]
            break
        time.sleep(0.005)
    if holder is None:
        with contextlib.suppress(ProcessLookupError):
            popen.kill()
        popen.wait()
        tail = log_file.read_text(errors="replace").strip()[-300:] if log_file.exists() else ""
        how = "hung" if popen.returncode is None else f"exited {popen.returncode}"
        raise MachineFailed(
            f"the network namespace of {machine} was not ready within {READY_TIMEOUT:.0f}s"
            f" (pasta {how}{': ' + tail if tail else ''})",
            hint="see pasta.log in the machine's run directory; or create it with --isolated",
            machine=machine)
    ns = Namespace(popen.pid, holder)
    (run_dir / "net.json").write_text(json.dumps(ns.to_json()))
    return ns


def _gid(user: passt_net.NetUser) -> int:
    import pwd

    return pwd.getpwnam(user.name).pw_gid


#: /proc/net/tcp's states of a connection whose handshake is under way.
_HANDSHAKE_STATES = {"02", "03"}  # SYN_SENT, SYN_RECV


def handshakes(proc_net_tcp: str) -> int:
    """How many sockets of a /proc/net/tcp or tcp6 table are in a handshake with a
    peer outside the guest (a loopback connection is saved whatever its state)."""
    count = 0
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] not in _HANDSHAKE_STATES:
            continue
        local = fields[1].split(":")[0]
        if local.endswith("7F") or local == "0" * 24 + "01000000":  # 127/8, ::1
            continue
        count += 1
    return count


def load(run_dir: Path) -> Namespace | None:
    """The namespace a machine's run directory records, if any."""
    try:
        data = json.loads((run_dir / "net.json").read_text())
        return Namespace(int(data["pasta"]), int(data["holder"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def end_recorded(machines: Path) -> None:
    """End the namespace (pasta and its holder) each run directory under ``machines``
    records, where they are still those processes: the clean-up after a daemon or node
    that is gone (their command lines name none of its directories)."""
    for run_dir in machines.glob("*/"):
        if (ns := load(run_dir)) is not None:
            ns.signal_end()


__all__ = ["GvisorNet", "Namespace", "end_recorded", "ensure_tun_access", "handshakes",
           "load", "pasta_argv", "start"]
