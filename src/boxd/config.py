"""Where boxd keeps its files, and every setting read from the environment.

Every ``BOXD_*`` variable is read here and nowhere else (`Settings.from_env`); the
README's settings table lists them.

Layout of the data directory (``$BOXD_HOME``; default ``/var/lib/boxd`` for root,
else ``$XDG_DATA_HOME/boxd`` or ``~/.local/share/boxd``)::

    boxd.sock            the daemon's unix socket
    daemon.lock          one daemon per data directory
    daemon.log           structured log, one line per event
    state.db             SQLite (WAL)
    host.json            cached accelerator probe
    images/<hash>/       guest kernel, initramfs, rootfs (one per recipe)
    oci/                 imported container images: an OCI layout (blobs/, index.json)
    oci-roots/chains/<chain>/  images unpacked, one tree per layer chain (hard links to
                         the chain below); oci-roots/<digest> names an image's (gVisor)
                         (<chain>.below: a link naming the chain under it)
    oci-disks/<chain>.ext4|.qcow2  an image's trees as disks, one per layer chain (QEMU
                         boots on them): a raw ext4 of the first chain, qcow2s of each
                         chain's changes backed by the disk below
    received-roots/      what other nodes' fork templates sat on, byte for byte theirs
                         (QEMU): rootfs.<stamp>.img (a guest root built apart from this
                         node's), disk.<stamp>.qcow2 (a snapshot's disk)
    disks/<layer>.qcow2  disk layers: a machine's writable overlay or a frozen layer
    snapshots/           content-addressed snapshot store (blobs/, manifests)
    machines/<id>/       per-machine persistent files (console log)
    uploads/             snapshot imports being received

Every file and directory here is private to the daemon's user (0600/0700), and to
QEMU's user where QEMU reopens a file after dropping privileges (see docs/security.md).

and on tmpfs (``/dev/shm/boxd-<hash of data dir>``)::

    machines/<id>/       run directory: RAM file, QMP and agent sockets, pid
    templates/<id>/      frozen memory + device state that fork children map
    checkpoints/<id>/    checkpoint memory + device state
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HOME_ENV = "BOXD_HOME"
SHM_ENV = "BOXD_SHM"
URL_ENV = "BOXD_URL"
API_KEY_ENV = "BOXD_API_KEY"
IMAGE_CACHE_ENV = "BOXD_IMAGE_CACHE"


def _default_home() -> Path:
    if env := os.environ.get(HOME_ENV):
        return Path(env).expanduser()
    if os.geteuid() == 0:
        # A system service's place; unlike /root it is traversable by the unprivileged
        # user QEMU drops to.
        return Path("/var/lib/boxd")
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "boxd"


@dataclass(frozen=True)
class Paths:
    """Every path boxd uses, derived from one data directory."""

    home: Path

    @classmethod
    def default(cls) -> Paths:
        return cls(_default_home().resolve())

    @property
    def socket(self) -> Path:
        return self.home / "boxd.sock"

    @property
    def lock(self) -> Path:
        return self.home / "daemon.lock"

    @property
    def log(self) -> Path:
        return self.home / "daemon.log"

    @property
    def db(self) -> Path:
        return self.home / "state.db"

    @property
    def host_info(self) -> Path:
        return self.home / "host.json"

    @property
    def images(self) -> Path:
        return self.home / "images"

    @property
    def images_store(self) -> Path:
        """Imported container images: an OCI layout (``boxd image import``)."""
        return self.home / "oci"

    @property
    def image_roots(self) -> Path:
        """Imported images unpacked for machines to run on: one tree per image digest."""
        return self.home / "oci-roots"

    @property
    def received_roots(self) -> Path:
        """What other nodes' fork templates sat on, received with them (QEMU: a guest
        root built apart from this node's, a snapshot's disk): kept, named by bytes."""
        return self.home / "received-roots"

    @property
    def image_disks(self) -> Path:
        """Imported images as disks, one per layer chain, for engines that boot a disk
        (QEMU): the base's raw ext4, a qcow2 of each chain's changes on the one below."""
        return self.home / "oci-disks"

    @property
    def disks(self) -> Path:
        return self.home / "disks"

    @property
    def snapshots(self) -> Path:
        return self.home / "snapshots"

    @property
    def machines(self) -> Path:
        return self.home / "machines"

    @property
    def uploads(self) -> Path:
        return self.home / "uploads"

    @property
    def execs(self) -> Path:
        """Durable exec records: ``<machine id>/<exec id>.json`` (`boxd.storage.execs`)."""
        return self.home / "execs"

    @property
    def shm(self) -> Path:
        """Per-data-directory folder on tmpfs for RAM files and sockets.

        ``BOXD_SHM`` names the tmpfs to use (default ``/dev/shm``); guest RAM lives
        there, so it must have room for every machine's memory.
        """
        digest = hashlib.sha256(str(self.home).encode()).hexdigest()[:12]
        base = Path(os.environ.get(SHM_ENV) or "/dev/shm")
        return base / f"boxd-{digest}"

    def run_dir(self, machine_id: str) -> Path:
        return self.shm / "machines" / machine_id

    @property
    def hibernated(self) -> Path:
        """Memory + device state of hibernated machines (on disk, not tmpfs)."""
        return self.home / "hibernated"

    @property
    def templates(self) -> Path:
        return self.shm / "templates"

    @property
    def checkpoints(self) -> Path:
        return self.shm / "checkpoints"

    def ensure(self) -> None:
        """Create the data directory and the tmpfs folder, private to the daemon's user.

        New directories are made 0700. Existing ones lose every permission "others"
        have, except the search bit on the two roots: when the daemon runs as root,
        `Host.run_as` makes them 0711 (QEMU, dropped to its own user, reopens disk
        layers by path) and some folders below 2770 for QEMU's group; those stay. The
        database and the log are created 0600 before anything opens them (SQLite gives
        its -wal and -shm files the database's mode; the log handler appends).
        """
        subdirs = (self.images, self.disks, self.snapshots, self.machines, self.uploads,
                   self.execs, self.hibernated, self.shm / "machines", self.shm / "tmp",
                   self.templates, self.checkpoints)
        for root in (self.home, self.shm):
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            mode = os.stat(root).st_mode & 0o7777
            # Only root has a QEMU user that needs to pass through.
            os.chmod(root, mode & ~0o066 if os.geteuid() == 0 else 0o700)
        for d in subdirs:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            mode = os.stat(d).st_mode & 0o7777
            if mode & 0o007:
                os.chmod(d, mode & ~0o007)
        for f in (self.db, self.db.with_name(self.db.name + "-wal"),
                  self.db.with_name(self.db.name + "-shm"), self.log, self.host_info):
            _make_private(f, create=f in (self.db, self.log))


def _make_private(path: Path, *, create: bool = False) -> None:
    """Make ``path`` readable and writable by its owner only (created empty if asked).

    By path (``chmod``), never by opening the file: SQLite holds POSIX advisory locks
    on the database and its -wal/-shm files, and a process loses them all as soon as it
    closes *any* descriptor of such a file; other processes then read the database
    without the daemon's newest commits.
    """
    try:
        os.chmod(path, 0o600)
    except FileNotFoundError:
        if create:
            # O_EXCL: only a file made right here, which nobody holds locks on yet.
            with contextlib.suppress(FileExistsError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 0o600))
                return
            os.chmod(path, 0o600)


# Machine sizing defaults (documented in docs/design.md).
DEFAULT_VCPUS = 1
DEFAULT_MEMORY_MIB = 1024
DEFAULT_DISK_GIB = 8
MAX_VCPUS = 8
MAX_MEMORY_MIB = 16384
MAX_DISK_GIB = 256
DEFAULT_MACHINE_QUOTA = 50
GUEST_HTTP_PORT = 8080


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return max(0, int(env.get(name, str(default))))
    except ValueError:
        return default


_OFF = ("off", "0", "no", "false")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``10m`` or ``1h`` (0 means never).

    Raises:
        ValueError: not a non-negative number with an optional s, m or h.
    """
    t = text.strip().lower()
    unit = _UNITS.get(t[-1:])
    number = t[:-1] if unit is not None else t
    value = float(number) * (unit or 1.0)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"not a duration: {text!r}")
    return value


_SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from ``1048576``, ``512k``, ``16M`` or ``2G`` (powers of 1024).

    Raises:
        ValueError: not a positive whole number with an optional k, m or g.
    """
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = _SIZE_UNITS.get(t[-1:])
    number = t[:-1] if unit is not None else t
    value = int(number) * (unit or 1)
    if value <= 0:
        raise ValueError(f"not a size: {text!r}")
    return value


def _size(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return parse_size(env[name]) if name in env else default
    except ValueError:
        return default


def _words(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A list setting: words separated by spaces or commas."""
    return tuple(w for w in env.get(name, "").replace(",", " ").split() if w)


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    try:
        return parse_duration(env[name]) if name in env else default
    except ValueError:
        return default


def qemu_user(env: Mapping[str, str] | None = None) -> str:
    """``BOXD_QEMU_USER``: the user QEMU drops to when the daemon runs as root (default
    ``boxd-qemu``; empty: QEMU keeps the daemon's user). Read alone by the storage layer,
    which makes files that user's group can read."""
    return (os.environ if env is None else env).get("BOXD_QEMU_USER", "boxd-qemu")


def net_id_base(env: Mapping[str, str] | None = None) -> str:
    """``BOXD_NET_ID_BASE``: the first uid/gid of the ids the passt or pasta of machines
    with a network policy of their own run as (empty: the default, see
    `boxd.engine.netpolicy`). Read alone by the engines' shared network rules."""
    return (os.environ if env is None else env).get("BOXD_NET_ID_BASE", "")


@dataclass(frozen=True)
class Settings:
    """The daemon's settings, read once from the environment (see the README's table)."""

    accel: str = ""  # BOXD_ACCEL: "kvm" or "tcg" forces the accelerator; else probed
    qemu_user: str = "boxd-qemu"  # BOXD_QEMU_USER: user QEMU drops to (root daemon); "" off
    net_user: str = "boxd-net"  # BOXD_NET_USER: user passt runs as (root daemon)
    fork_spares: int = 8  # BOXD_FORK_SPARES: standby children per template; 0 off
    fork_spares_total: int = 32  # BOXD_FORK_SPARES_TOTAL: standby children per daemon
    fork_spares_per_account: int = 0  # BOXD_FORK_SPARES_PER_ACCOUNT: 0 = half the total
    log_level: str = "info"  # BOXD_LOG_LEVEL
    image_cache: Path | None = None  # BOXD_IMAGE_CACHE: where guest images are built
    image_apt: tuple[str, ...] = ()  # BOXD_IMAGE_APT: Debian packages in every machine's image
    image_pip: tuple[str, ...] = ()  # BOXD_IMAGE_PIP: pip packages in every machine's image
    engine: str = "auto"  # BOXD_ENGINE: auto (KVM, else gVisor, else TCG), qemu or gvisor
    suspend_after: float = 60.0  # BOXD_SUSPEND_AFTER: idle seconds before suspend; 0 never
    hibernate_after: float = 600.0  # BOXD_HIBERNATE_AFTER: idle seconds before hibernate
    default_max_machines: int = 50  # BOXD_DEFAULT_MAX_MACHINES: a new account's quota
    runsc: str = ""  # BOXD_RUNSC: the runsc binary of the gvisor engine; "" = from PATH
    ray_address: str = ""  # BOXD_RAY_ADDRESS: serve a Ray cluster ("auto": the local one)
    node_max_machines: int = 0  # BOXD_NODE_MAX_MACHINES: machines per cluster node; 0 auto
    node_root: Path | None = None  # BOXD_NODE_ROOT: where cluster nodes keep data/nodes/<id>
    max_body: int = 16 << 20  # BOXD_MAX_BODY: bytes of a JSON request body
    max_upload: int = 64 << 30  # BOXD_MAX_UPLOAD: bytes of a file upload or snapshot import
    max_exec_output: int = 16 << 20  # BOXD_MAX_EXEC_OUTPUT: bytes kept per stream of an exec
    body_timeout: float = 60.0  # BOXD_BODY_TIMEOUT: seconds a request body may stall
    cgroups: str = "auto"  # BOXD_CGROUPS: auto (a cgroup per QEMU process if possible), off
    event_loop: str = "auto"  # BOXD_EVENT_LOOP: auto (uvloop if installed), uvloop, asyncio
    e2b_listen: str = "127.0.0.1:0"  # BOXD_E2B_LISTEN: HOST:PORT of the E2B API; "off" none
    e2b_domain: str = ""  # BOXD_E2B_DOMAIN: serve <port>-<sandbox id>.DOMAIN Host names too
    console_listen: str = "127.0.0.1:0"  # BOXD_CONSOLE_LISTEN: the web console's; "off" none

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        cache = e.get(IMAGE_CACHE_ENV)
        return cls(
            accel=e.get("BOXD_ACCEL", "").strip().lower(),
            qemu_user=qemu_user(e),
            net_user=e.get("BOXD_NET_USER", "boxd-net") or "boxd-net",
            fork_spares=_int(e, "BOXD_FORK_SPARES", 8),
            fork_spares_total=_int(e, "BOXD_FORK_SPARES_TOTAL", 32),
            fork_spares_per_account=_int(e, "BOXD_FORK_SPARES_PER_ACCOUNT", 0),
            log_level=e.get("BOXD_LOG_LEVEL", "info").strip().lower() or "info",
            image_cache=Path(cache).expanduser() if cache else None,
            image_apt=_words(e, "BOXD_IMAGE_APT"),
            image_pip=_words(e, "BOXD_IMAGE_PIP"),
            engine=e.get("BOXD_ENGINE", "auto").strip().lower() or "auto",
            suspend_after=_seconds(e, "BOXD_SUSPEND_AFTER", 60.0),
            hibernate_after=_seconds(e, "BOXD_HIBERNATE_AFTER", 600.0),
            default_max_machines=_int(e, "BOXD_DEFAULT_MAX_MACHINES", DEFAULT_MACHINE_QUOTA),
            runsc=e.get("BOXD_RUNSC", "").strip(),
            ray_address=e.get("BOXD_RAY_ADDRESS", "").strip(),
            node_max_machines=_int(e, "BOXD_NODE_MAX_MACHINES", 0),
            node_root=Path(e["BOXD_NODE_ROOT"]).expanduser() if e.get("BOXD_NODE_ROOT")
            else None,
            max_body=_size(e, "BOXD_MAX_BODY", 16 << 20),
            max_upload=_size(e, "BOXD_MAX_UPLOAD", 64 << 30),
            max_exec_output=_size(e, "BOXD_MAX_EXEC_OUTPUT", 16 << 20),
            body_timeout=_seconds(e, "BOXD_BODY_TIMEOUT", 60.0) or 60.0,
            cgroups="off" if e.get("BOXD_CGROUPS", "").strip().lower() in _OFF else "auto",
            event_loop=e.get("BOXD_EVENT_LOOP", "auto").strip().lower() or "auto",
            e2b_listen=e.get("BOXD_E2B_LISTEN", "").strip() or "127.0.0.1:0",
            e2b_domain=e.get("BOXD_E2B_DOMAIN", "").strip().lower().strip("."),
            console_listen=e.get("BOXD_CONSOLE_LISTEN", "").strip() or "127.0.0.1:0",
        )


@dataclass(frozen=True)
class ClientSettings:
    """What a client (SDK, CLI) reads: ``BOXD_URL`` and ``BOXD_API_KEY``."""

    url: str | None
    api_key: str | None
    examples: Path | None = None  # BOXD_EXAMPLES: where `boxd demo` finds examples/rl

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSettings:
        e = os.environ if env is None else env
        examples = e.get("BOXD_EXAMPLES")
        return cls(url=e.get(URL_ENV) or None, api_key=e.get(API_KEY_ENV) or None,
                   examples=Path(examples) if examples else None)
