"""The OCI bundle of a gVisor machine and the files of its run directory.

Every machine of one image gets the same spec but for its hostname: the image's root
tree (read-only on the host; writes go to gVisor's in-memory overlay, which a
checkpoint includes), the agent tree at ``/opt/boxd`` (read-only) and its in-machine
client at ``/run/boxd/py`` (read-only; where the image's .pth puts it on the system
python3's path, as in a QEMU guest), tmpfs on /tmp, /run and /dev/shm, and the guest
agent as PID 1 on the sandbox's stdio: boxd-init (``guest/init.c``, compiled into the
agent tree) in front of agent.py, as in a QEMU guest, so the step channel's frames are
relayed in C; or agent.py alone when the tree has no boxd-init (`process_args`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def process_args(agent_tree: Path, memory_mib: int | None = None) -> list[str]:
    """PID 1 of a sandbox on ``agent_tree``. A restore gets the same (its Roots name the
    tree its sandbox was checkpointed with), whatever a newer tree would run.

    With ``memory_mib``, boxd-init kills the largest guest process once the guest's
    processes use more than that (``--memory-mib``: runsc has no OOM killer of its own);
    agent.py alone (no C compiler) does not."""
    python = ["/usr/bin/python3", "-u", f"{AGENT_MOUNT}/agent.py"]
    if native_relay(agent_tree):
        memory = ["--memory-mib", str(memory_mib)] if memory_mib else []
        return [f"{AGENT_MOUNT}/boxd-init", "--stdio", "--host-clock", *memory,
                "--python", python[0], "--agent", python[2], "--", "--host-clock"]
    return [*python, "--stdio", "--host-clock"]


@dataclass(frozen=True)
class Roots:
    """The host trees a sandbox is built on; a restored copy must get the same ones."""

    rootfs: Path
    agent: Path

    def to_json(self) -> dict[str, str]:
        return {"rootfs": str(self.rootfs), "agent": str(self.agent)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Roots:
        return cls(Path(data["rootfs"]), Path(data["agent"]))


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
    if resolv_conf is not None:
        extra.append({"destination": "/etc/resolv.conf", "type": "bind",
                      "source": str(resolv_conf), "options": ["rbind", "ro"]})
    spec: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": process_args(roots.agent, memory_mib),
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
