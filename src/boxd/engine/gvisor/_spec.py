"""The OCI bundle of a gVisor machine and the files of its run directory.

Every machine of one image gets the same spec but for its hostname: the image's root
tree (read-only on the host; writes go to gVisor's in-memory overlay, which a
checkpoint includes), the agent tree at ``/opt/boxd`` (read-only) and its in-machine
client at ``/run/boxd/py`` (read-only; where the image's .pth puts it on the system
python3's path, as in a QEMU guest), tmpfs on /tmp, /run and /dev/shm, and the guest
agent as PID 1 on the sandbox's stdio: boxd-init (``guest/init.c``, compiled into the
agent tree) in front of agent.py, as in a QEMU guest, so the step channel's frames are
relayed in C; or agent.py alone when the tree has no boxd-init (`process_args`).

A machine of an imported container image has that image's tree as its root instead,
and boxd's guest root mounted read-only at `RUNTIME_MOUNT`: the agent runs on that
tree's Python through its own dynamic loader, so the image needs no Python, shell or
particular libc, and none of its files is changed (`Roots.runtime`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boxd.errors import HostSetupError
from boxd.images import AGENT_MOUNT, CLIENT_DIR, GUEST_CLIENT_DIR, native_relay

# What a root user in a QEMU guest may do that gVisor implements.
CAPABILITIES = [
    "CAP_AUDIT_WRITE", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER",
    "CAP_FSETID", "CAP_IPC_LOCK", "CAP_KILL", "CAP_MKNOD", "CAP_NET_ADMIN",
    "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SETFCAP", "CAP_SETGID", "CAP_SETPCAP",
    "CAP_SETUID", "CAP_SYS_ADMIN", "CAP_SYS_CHROOT", "CAP_SYS_NICE", "CAP_SYS_PTRACE",
    "CAP_SYS_RESOURCE",
]

#: pasta's DNS forwarder in a machine's namespace (the address a QEMU guest uses too).
DNS = "10.0.2.3"

ENV = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1",
]


#: Where a machine of a container image sees boxd's own guest root (read-only): the
#: agent runs on its Python, so the image needs none (`runtime_python`).
RUNTIME_MOUNT = "/opt/boxd-rt"


def runtime_python(runtime: Path) -> list[str]:
    """The command that runs the Python of guest root tree ``runtime`` as it is mounted
    at `RUNTIME_MOUNT`, whatever the sandbox's own root holds: that tree's dynamic loader
    with its library directory first (``ld.so --library-path DIR PYTHON``: no patchelf,
    no LD_LIBRARY_PATH for the commands agent.py starts), ``-E -s`` so the image's
    PYTHON* variables leave the agent alone. Python finds its own prefix from its path.

    Raises:
        HostSetupError: the tree has no dynamic loader or no python3.
    """
    loaders = sorted(p for p in runtime.glob("usr/lib/*-linux-gnu/ld-linux*.so.*")
                     if p.is_file() and not p.is_symlink())
    python = _inside(runtime, "usr/bin/python3")
    if not loaders or python is None:
        raise HostSetupError(
            f"the guest root {runtime} has no dynamic loader or no usr/bin/python3: "
            "machines of a container image run their agent on it",
            hint="rebuild boxd's guest image (boxd image build --force)")
    loader = loaders[0].relative_to(runtime)
    return [f"{RUNTIME_MOUNT}/{loader}", "--library-path", f"{RUNTIME_MOUNT}/{loader.parent}",
            f"{RUNTIME_MOUNT}/{python}", "-E", "-s"]


def _inside(tree: Path, rel: str) -> str | None:
    """``rel``'s symbolic links followed as they resolve with ``tree`` as the root (an
    absolute link target is in the tree, not on the host); None if it is no file."""
    for _ in range(40):
        path = tree / rel
        if not path.is_symlink():
            return rel if path.is_file() else None
        target = os.readlink(path)
        rel = os.path.normpath(target.lstrip("/") if target.startswith("/")
                               else os.path.join(os.path.dirname(rel), target))
        if rel.startswith(".."):
            return None
    return None


def process_args(agent_tree: Path, memory_mib: int | None = None,
                 runtime: Path | None = None) -> list[str]:
    """PID 1 of a sandbox on ``agent_tree``. A restore gets the same (its Roots name the
    trees its sandbox was checkpointed with), whatever a newer tree would run.

    With ``memory_mib``, boxd-init kills the largest guest process once the guest's
    processes use more than that (``--memory-mib``: runsc has no OOM killer of its own);
    agent.py alone (no C compiler) does not. With ``runtime`` (a container image's
    machine) agent.py runs on that tree's Python (`runtime_python`), not the root's."""
    python = runtime_python(runtime) if runtime is not None else ["/usr/bin/python3"]
    agent = f"{AGENT_MOUNT}/agent.py"
    if native_relay(agent_tree):
        memory = ["--memory-mib", str(memory_mib)] if memory_mib else []
        extra = [x for arg in python[1:] for x in ("--python-arg", arg)]
        return [f"{AGENT_MOUNT}/boxd-init", "--stdio", "--host-clock", *memory,
                "--python", python[0], *extra, "--agent", agent, "--", "--host-clock"]
    return [*python, "-u", agent, "--stdio", "--host-clock"]


@dataclass(frozen=True)
class Roots:
    """The host trees a sandbox is built on; a restored copy must get the same ones.

    ``runtime``: for a machine of a container image (``rootfs`` is the image's tree),
    boxd's guest root, whose Python runs the agent (mounted at `RUNTIME_MOUNT`)."""

    rootfs: Path
    agent: Path
    runtime: Path | None = None

    def to_json(self) -> dict[str, str]:
        out = {"rootfs": str(self.rootfs), "agent": str(self.agent)}
        if self.runtime is not None:
            out["runtime"] = str(self.runtime)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Roots:
        runtime = data.get("runtime")
        return cls(Path(data["rootfs"]), Path(data["agent"]),
                   Path(runtime) if runtime else None)


class RunFiles:
    """The run directory of one machine (on tmpfs)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.bundle = run_dir / "bundle"
        self.stdin = run_dir / "agent.in"  # FIFO: host → agent
        self.stdout = run_dir / "agent.out"  # FIFO: agent → host
        self.pidfile = run_dir / "sandbox.pid"
        self.roots = run_dir / "roots.json"
        self.image = run_dir / "image"  # a snapshot's checkpoint, reassembled

    def make_fifos(self) -> None:
        for f in (self.stdin, self.stdout):
            f.unlink(missing_ok=True)
            os.mkfifo(f, 0o600)


def build(hostname: str, roots: Roots, memory_mib: int, netns: str | None = None,
          resolv_conf: Path | None = None) -> dict[str, Any]:
    """config.json of a machine's bundle.

    ``netns`` is the network namespace a non-isolated machine runs in (see ``_net``),
    with ``resolv_conf`` naming pasta's DNS forwarder; None: an empty one (no network).
    """
    caps = {k: CAPABILITIES for k in ("bounding", "effective", "permitted")}
    namespaces: list[dict[str, str]] = [
        {"type": t} for t in ("pid", "ipc", "uts", "mount", "network")]
    if netns is not None:
        namespaces[-1]["path"] = netns
    extra: list[dict[str, Any]] = []
    # An agent tree made before the client was in it (a checkpoint's) has none: a
    # restore must get the mounts its sandbox was checkpointed with.
    if (roots.agent / CLIENT_DIR).is_dir():
        extra.append({"destination": GUEST_CLIENT_DIR, "type": "bind",
                      "source": str(roots.agent / CLIENT_DIR), "options": ["rbind", "ro"]})
    if roots.runtime is not None:
        extra.append({"destination": RUNTIME_MOUNT, "type": "bind",
                      "source": str(roots.runtime), "options": ["rbind", "ro"]})
    if resolv_conf is not None:
        extra.append({"destination": "/etc/resolv.conf", "type": "bind",
                      "source": str(resolv_conf), "options": ["rbind", "ro"]})
    spec: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": process_args(roots.agent, memory_mib, roots.runtime),
            "env": ENV,
            "cwd": "/",
            "capabilities": caps,
            "noNewPrivileges": False,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576}],
        },
        "root": {"path": str(roots.rootfs), "readonly": False},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "nodev", "mode=1777"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777"]},
            {"destination": "/run", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=755"]},
            {"destination": AGENT_MOUNT, "type": "bind", "source": str(roots.agent),
             "options": ["rbind", "ro"]},
            *extra,
        ],
        "linux": {"namespaces": namespaces},
    }
    return spec


def write_bundle(files: RunFiles, hostname: str, roots: Roots, memory_mib: int,
                 netns: str | None = None) -> None:
    files.bundle.mkdir(parents=True, exist_ok=True)
    resolv = None
    if netns is not None:
        resolv = files.bundle / "resolv.conf"
        resolv.write_text(f"nameserver {DNS}\n")
    (files.bundle / "config.json").write_text(
        json.dumps(build(hostname, roots, memory_mib, netns, resolv)))
    files.roots.write_text(json.dumps(roots.to_json()))
