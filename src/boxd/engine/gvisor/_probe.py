"""Does ``runsc`` work on this host? Probed by running a real sandbox, like the KVM probe.

``runsc`` being installed proves little: an old build (Debian 12's own, 2022) runs only
with the ptrace platform and hangs on checkpoint; a kernel without the seccomp features
systrap needs fails at start. So the probe starts a sandbox on the image's root tree
with the engine's own flags and checks that ``/bin/true`` exits 0 within a deadline.
The result is cached per host (runsc version, host kernel, root tree) in its own file
next to ``host.json`` (which the QEMU probe rewrites whole).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROBE_DEADLINE = 30.0


@dataclass(frozen=True)
class RunscChoice:
    ok: bool
    reason: str
    version: str = ""
    probe_seconds: float | None = None


def runsc_version(runsc: str) -> str:
    """``runsc --version``'s first line's version, e.g. ``0.0~20240729.0``; "" if unknown."""
    try:
        out = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r"runsc version (\S+)", out.stdout)
    return m[1] if m else ""


def _snapshot_date(version: str) -> int:
    m = re.search(r"(20\d{6})", version)
    return int(m[1]) if m else 0


def _cache_key(runsc: str, version: str, tree: Path) -> str:
    parts = [runsc, version, os.uname().release, str(tree)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _run_probe(runsc: str, tree: Path) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory(prefix="boxd-runsc-probe-") as tmp:
        bundle = Path(tmp) / "bundle"
        bundle.mkdir()
        spec = {
            "ociVersion": "1.0.2",
            "process": {"args": ["/bin/true"], "cwd": "/", "user": {"uid": 0, "gid": 0},
                        "env": ["PATH=/usr/bin:/bin"]},
            "root": {"path": str(tree), "readonly": False},
            "hostname": "probe",
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount",
                                                            "network")]},
        }
        (bundle / "config.json").write_text(json.dumps(spec))
        root = Path(tmp) / "state"
        argv = [runsc, f"--root={root}", "--platform=systrap", "--network=none",
                "--overlay2=root:memory", "--ignore-cgroups", f"--log={tmp}/runsc.log",
                "run", f"--bundle={bundle}", f"probe-{os.getpid()}"]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, errors="replace", timeout=PROBE_DEADLINE)
        except subprocess.TimeoutExpired:
            subprocess.run([runsc, f"--root={root}", "delete", "-force",
                            f"probe-{os.getpid()}"], capture_output=True, timeout=30,
                           check=False)
            return False, f"a runsc sandbox did not finish /bin/true in {PROBE_DEADLINE:.0f}s", \
                PROBE_DEADLINE
        except OSError as exc:
            return False, f"could not start {runsc}: {exc}", 0.0
        elapsed = time.monotonic() - t0
        if proc.returncode == 0:
            return True, f"a runsc sandbox (systrap) ran /bin/true in {elapsed:.2f}s", elapsed
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"runsc (systrap) failed with status {proc.returncode}: {last[:200]}", \
            elapsed


def probe_runsc(tree: Path, cache: Path, runsc: str | None = None) -> RunscChoice:
    """Whether gVisor can run machines here, and why (cached per runsc, kernel and tree)."""
    runsc = runsc or shutil.which("runsc") or shutil.which("runsc", path="/usr/sbin:/sbin")
    if runsc is None:
        return RunscChoice(False, "runsc is not installed (apt-get install -t "
                                  "bookworm-backports runsc; scripts/setup-host.sh does)")
    version = runsc_version(runsc)
    if 0 < _snapshot_date(version) < 20230101:
        return RunscChoice(False, f"runsc {version} is too old (systrap and checkpoint need a "
                                  "2023 or later build; Debian 12's bookworm-backports has one)",
                           version)
    key = _cache_key(runsc, version, tree)
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return RunscChoice(**cached["choice"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ok, why, elapsed = _run_probe(runsc, tree)
    choice = RunscChoice(ok, why, version, round(elapsed, 2))
    tmp = cache.with_name(cache.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # like host.json
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"key": key, "choice": asdict(choice)}))
    os.replace(tmp, cache)
    return choice
