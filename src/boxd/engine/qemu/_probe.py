"""Choose the accelerator: KVM only when it can really boot our guest kernel.

``/dev/kvm`` existing proves little: on PVM-only hosts it cannot run a stock guest
kernel (early boot dies with "KVM internal error"). So the probe boots the guest
kernel under KVM with a short deadline and looks for the point where the kernel has
finished early boot (it panics for want of a root filesystem, on purpose). The
result is cached per host (QEMU version, host kernel, /dev/kvm identity, guest kernel).
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

from boxd.engine.qemu._argv import CPU_MODELS, QBOOT

PROBE_DEADLINE = 20.0
_MARKERS = ("Kernel panic - not syncing", "VFS: Unable to mount root fs")


@dataclass(frozen=True)
class AccelChoice:
    accelerator: str  # "kvm" or "tcg"
    reason: str
    forced: bool = False
    probe_seconds: float | None = None


def qemu_version(qemu: str) -> tuple[int, int, int]:
    """QEMU's version as a tuple, e.g. (10, 0, 2); (0, 0, 0) if unknown."""
    try:
        out = subprocess.run([qemu, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return (0, 0, 0)
    m = re.search(r"version (\d+)\.(\d+)\.(\d+)", out.stdout)
    return (int(m[1]), int(m[2]), int(m[3])) if m else (0, 0, 0)


def _cache_key(qemu: str, kernel: Path) -> str:
    try:
        st = os.stat("/dev/kvm")
        kvm = f"{st.st_rdev}:{st.st_mode}"
    except OSError:
        kvm = "none"
    parts = [str(qemu_version(qemu)), os.uname().release, kvm, kernel.name,
             str(kernel.stat().st_size) if kernel.exists() else "0"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _boot_under_kvm(qemu: str, kernel: Path) -> tuple[bool, str, float]:
    argv = [
        qemu, "-machine", "microvm,x-option-roms=off,pit=off,pic=off,rtc=on",
        "-accel", "kvm", "-cpu", CPU_MODELS["kvm"], "-m", "256M", "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", "stdio", "-kernel", str(kernel),
        "-append", "console=ttyS0 panic=-1 loglevel=4",
    ]
    if QBOOT.exists():
        argv += ["-bios", str(QBOOT)]
    # Under coreutils' timeout: the probe QEMU (a guest that may never finish booting)
    # is killed at the deadline even if the daemon dies first (killed during its start,
    # it used to leave the probe spinning for ever).
    watchdog = shutil.which("timeout")
    if watchdog is not None:
        argv = [watchdog, "-s", "KILL", f"{PROBE_DEADLINE:.0f}", *argv]
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=PROBE_DEADLINE + 5, stdin=subprocess.DEVNULL)
            rc: int | None = proc.returncode
            if watchdog is not None and rc == 128 + 9:  # the watchdog's kill: the deadline
                rc = None
        except subprocess.TimeoutExpired:
            rc = None
        except OSError as exc:
            return False, f"could not start {qemu}: {exc}", 0.0
        elapsed = time.monotonic() - t0
        out.seek(0)
        text = out.read().decode(errors="replace")
    if any(m in text for m in _MARKERS):
        return True, f"KVM booted the guest kernel in {elapsed:.1f}s", elapsed
    if "KVM internal error" in text or "emulation failure" in text:
        why = "KVM cannot run the guest kernel (KVM internal error: emulation failure)"
        return False, why, elapsed
    if rc is None:
        why = f"the guest kernel did not finish early boot under KVM in {PROBE_DEADLINE:.0f}s"
        return False, why, elapsed
    last = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["no output"]
    return False, f"QEMU with KVM exited with status {rc}: {last[0][:200]}", elapsed


def probe_accelerator(qemu: str, kernel: Path, cache: Path, forced: str = "") -> AccelChoice:
    """Pick KVM or TCG for this host; ``forced`` (``BOXD_ACCEL``: kvm|tcg) wins when set."""
    if forced in ("kvm", "tcg"):
        return AccelChoice(forced, f"forced by BOXD_ACCEL={forced}", forced=True)
    if not os.path.exists("/dev/kvm"):
        return AccelChoice("tcg", "/dev/kvm does not exist: using TCG (software emulation)")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return AccelChoice("tcg", "no permission to open /dev/kvm: using TCG (software emulation)")
    key = _cache_key(qemu, kernel)
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return AccelChoice(**cached["choice"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ok, why, elapsed = _boot_under_kvm(qemu, kernel)
    if ok:
        choice = AccelChoice("kvm", why, probe_seconds=round(elapsed, 2))
    else:
        extra = ""
        if Path("/sys/module/kvm_pvm").exists():
            extra = " (this host's /dev/kvm is kvm_pvm, a paravirtual hypervisor)"
        choice = AccelChoice("tcg", f"{why}{extra}: using TCG (software emulation)",
                             probe_seconds=round(elapsed, 2))
    tmp = cache.with_name(cache.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"key": key, "choice": asdict(choice)}))
    os.replace(tmp, cache)
    return choice
