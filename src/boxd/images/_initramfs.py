"""The guest initramfs: static busybox, the virtio/ext4 modules, /init and the agent.

It is a plain (uncompressed) newc cpio written in Python: building it takes
milliseconds, and the kernel unpacks it faster than a compressed one under TCG.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from boxd.errors import HostSetupError

#: The guest's PID 1 in front of the Python agent, compiled from ``guest/init.c``.
INIT_SOURCE = "init.c"
INIT_BINARY = "boxd-init"

# The /init script. Kept in one place so its text is part of the initramfs cache key.
INIT_SCRIPT = r"""#!/bin/busybox sh
# boxd guest init: load modules, mount the root disk, then hand over to the agent.
/bin/busybox mkdir -p /bin /sbin /proc /sys /dev /newroot
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null

log() { echo "boxd-init: $*"; }
die() { log "FATAL: $*"; sleep 5; echo o > /proc/sysrq-trigger; poweroff -f; }
cmdline=$(cat /proc/cmdline)

# virtio_mmio takes its device list from the kernel command line; only modprobe
# would pass module.param= words on, so forward them to insmod here.
mmio_args=""
for word in $cmdline; do
  case "$word" in virtio_mmio.*) mmio_args="$mmio_args ${word#virtio_mmio.}";; esac
done
while read -r mod; do
  [ -n "$mod" ] || continue
  if [ "$mod" = virtio_mmio ]; then
    insmod "/lib/modules/$mod.ko" $mmio_args || log "insmod $mod failed"
  else
    insmod "/lib/modules/$mod.ko" || log "insmod $mod failed"
  fi
done < /lib/modules/load-order

# boxd.runtime=SERIAL: a container image's machine. Its root disk holds the image's
# files; the disk with that serial, boxd's own guest root (read-only), lends the agent
# its Python, mounted at /opt/boxd-rt (docs/images.md).
rt_serial=""
for word in $cmdline; do
  case "$word" in boxd.runtime=?*) rt_serial="${word#boxd.runtime=}";; esac
done
root=vda
rt=""
i=0
while :; do
  if [ -n "$rt_serial" ]; then
    for d in /sys/block/vd*; do
      [ -e "$d" ] || continue
      if [ "$(cat $d/serial 2>/dev/null)" = "$rt_serial" ]; then rt=${d##*/}
      else root=${d##*/}; fi
    done
  fi
  found=1
  [ -b /dev/$root ] || found=""
  if [ -n "$rt_serial" ]; then [ -n "$rt" ] && [ "$rt" != "$root" ] || found=""; fi
  [ -n "$found" ] && break
  i=$((i + 1))
  [ "$i" -gt 500 ] && die "no root disk /dev/$root (or no disk $rt_serial) after 5 s"
  usleep 10000
done
# noinit_itable: no ext4lazyinit thread zeroing inode tables in the background (after
# an online grow that is minutes of TCG time, repeated by every fork child).
mount -t ext4 -o rw,noinit_itable /dev/$root /newroot || die "cannot mount /dev/$root"

R=/newroot
RT=/opt/boxd-rt
mkdir -p $R/proc $R/sys $R/dev $R/run $R/tmp $R/etc
if [ -n "$rt" ]; then
  mkdir -p $R$RT
  mount -t ext4 -o ro,noload /dev/$rt $R$RT || die "cannot mount the guest root /dev/$rt"
  ld=$(ls $R$RT/usr/lib/*-linux-gnu/ld-linux*.so.* 2>/dev/null | head -n 1)
  py=$(readlink -f $R$RT/usr/bin/python3)
  [ -f "$ld" ] && [ -f "$py" ] || die "no dynamic loader or python3 in the guest root"
  libdir=${ld%/*}
fi
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts $R/dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs $R/dev/shm
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs $R/run
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs $R/tmp

host=boxd
for word in $cmdline; do
  case "$word" in boxd.hostname=?*) host="${word#boxd.hostname=}";; esac
done
hostname "$host"
# Identity files live on tmpfs (the agent rewrites them on every fork and restore).
mkdir -p $R/run/boxd
for f in hostname machine-id; do
  [ -L $R/etc/$f ] || { rm -f $R/etc/$f; ln -s ../run/boxd/$f $R/etc/$f; }
done
echo "$host" > $R/run/boxd/hostname
: > $R/run/boxd/machine-id

ip link set lo up
if [ -e /sys/class/net/eth0 ]; then
  ip link set eth0 up
  ip addr add 10.0.2.15/24 dev eth0
  ip route add default via 10.0.2.2 dev eth0
  rm -f $R/etc/resolv.conf
  echo "nameserver 10.0.2.3" > $R/etc/resolv.conf
fi

# Grow the filesystem online when the disk (a qcow2 overlay) is larger than it.
disk_bytes=$(( $(cat /sys/class/block/$root/size) * 512 ))
blocks=$(od -An -tu4 -j1028 -N4 /dev/$root | tr -d ' ')
log_bs=$(od -An -tu4 -j1048 -N4 /dev/$root | tr -d ' ')
fs_bytes=$(( blocks * (1024 << log_bs) ))
if [ "$disk_bytes" -gt "$fs_bytes" ]; then
  if [ -n "$rt" ]; then  # the image has no resize2fs: the guest root's, on its loader
    $ld --library-path $libdir $R$RT/usr/sbin/resize2fs /dev/$root >/dev/null 2>&1 \
      || log "resize2fs failed"
  else
    chroot $R /sbin/resize2fs /dev/$root >/dev/null 2>&1 || log "resize2fs failed"
  fi
fi

cp /boxd/*.py $R/run/boxd/ 2>/dev/null
# The boxd client for the guest's python3 (the rootfs has a .pth naming /run/boxd/py).
[ -d /boxd/py ] && cp -r /boxd/py $R/run/boxd/
[ -f $R/run/boxd/agent.py ] || die "no agent in the initramfs"
[ -x /boxd/boxd-init ] && cp /boxd/boxd-init $R/run/boxd/

umount /proc /sys /dev 2>/dev/null
log "starting agent"
cd $R/home/boxd 2>/dev/null
export HOME=/root LANG=C.UTF-8 TERM=linux
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# boxd-init answers the hot operations itself and runs agent.py behind it.
if [ -n "$rt" ]; then
  # The guest root's Python through its own loader: no LD_LIBRARY_PATH or PYTHONHOME
  # for the image's commands; -E -s: the image's PYTHON* leave the agent alone.
  ld=${ld#$R} libdir=${libdir#$R} py=${py#$R}
  if [ -x $R/run/boxd/boxd-init ]; then
    exec switch_root $R /run/boxd/boxd-init --python $ld --python-arg --library-path \
      --python-arg $libdir --python-arg $py --python-arg -E --python-arg -s \
      < $R/dev/console > $R/dev/console 2>&1
  fi
  exec switch_root $R $ld --library-path $libdir $py -E -s -u /run/boxd/agent.py \
    < $R/dev/console > $R/dev/console 2>&1
fi
if [ -x $R/run/boxd/boxd-init ]; then
  exec switch_root $R /run/boxd/boxd-init < $R/dev/console > $R/dev/console 2>&1
fi
exec switch_root $R /usr/bin/python3 -u /run/boxd/agent.py \
  < $R/dev/console > $R/dev/console 2>&1
"""


@dataclass(frozen=True)
class CpioEntry:
    """One file, directory, symlink or device node of the archive."""

    name: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def _header(ino: int, e: CpioEntry, nlink: int) -> bytes:
    name = e.name.encode() + b"\0"
    fields = (ino, e.mode, 0, 0, nlink, 0, len(e.data), 0, 0, e.rdev[0], e.rdev[1],
              len(name), 0)
    hdr = b"070701" + b"".join(f"{v:08x}".encode() for v in fields)
    out = hdr + name
    return out + b"\0" * (-len(out) % 4)


def write_cpio(entries: Iterable[CpioEntry]) -> bytes:
    """A newc ("070701") cpio archive of ``entries``, as the kernel unpacks it."""
    buf = io.BytesIO()
    ino = 1
    for e in entries:
        nlink = 2 if stat.S_ISDIR(e.mode) else 1
        buf.write(_header(ino, e, nlink))
        buf.write(e.data + b"\0" * (-len(e.data) % 4))
        ino += 1
    buf.write(_header(0, CpioEntry("TRAILER!!!", 0), 1))
    buf.write(b"\0" * (-buf.tell() % 512))
    return buf.getvalue()


#: The modules of the boxd package the in-machine client imports (``from boxd import
#: Boxd``): the SDK and the shared modules, no daemon code (the import-linter contract "The
#: SDK is a light client" keeps it so; tests/unit/test_initramfs.py checks the list).
CLIENT_MODULES = (
    "__init__.py", "_lazy.py", "_server_deps.py", "_version.py", "config.py", "errors.py",
    "models.py", "process_models.py", "py.typed", "sdk/*.py",
)
#: The package the client comes from.
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def client_files(package_dir: Path = PACKAGE_DIR) -> dict[str, bytes]:
    """The boxd client's files, by path under ``py/`` in the initramfs's ``/boxd``."""
    files: dict[str, bytes] = {}
    for pattern in CLIENT_MODULES:
        for p in sorted(package_dir.glob(pattern)):
            files[f"py/boxd/{p.relative_to(package_dir)}"] = p.read_bytes()
    return files


def guest_files(guest_dir: Path | None) -> dict[str, bytes]:
    """The agent's sources (``*.py`` and ``init.c`` of ``guest_dir``) by file name, and the
    boxd client's files (``py/boxd/...``)."""
    if guest_dir is None or not guest_dir.is_dir():
        return {}
    files = {p.name: p.read_bytes() for p in sorted(guest_dir.glob("*.py"))}
    init = guest_dir / INIT_SOURCE
    if init.exists():
        files[INIT_SOURCE] = init.read_bytes()
    files.update(client_files())
    return files


def compile_init(source: bytes) -> bytes:
    """Compile boxd-init (a static binary: the guest has no C library of the host's).

    Raises:
        HostSetupError: no C compiler or static C library, or the source does not build.
    """
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise HostSetupError(
            "no C compiler to build the guest's boxd-init",
            hint="install gcc and libc6-dev (scripts/setup-host.sh does)",
        )
    with tempfile.TemporaryDirectory(prefix="boxd-init-") as tmp:
        out = Path(tmp) / INIT_BINARY
        proc = subprocess.run(
            [cc, "-O2", "-std=gnu11", "-Wall", "-static", "-s", "-o", str(out), "-x", "c", "-"],
            input=source, capture_output=True, check=False,
        )
        if proc.returncode != 0 or not out.exists():
            tail = proc.stderr.decode(errors="replace").strip()[-600:]
            raise HostSetupError(
                f"building the guest's boxd-init failed: {tail}",
                hint="install gcc and libc6-dev (scripts/setup-host.sh does)",
            )
        return out.read_bytes()


def with_init_binary(agent: dict[str, bytes]) -> dict[str, bytes]:
    """The files the initramfs carries: ``init.c`` compiled to ``boxd-init``."""
    files = dict(agent)
    source = files.pop(INIT_SOURCE, None)
    if source is not None:
        files[INIT_BINARY] = compile_init(source)
    return files


def initramfs_key(kernel_release: str, busybox: bytes, agent: dict[str, bytes]) -> str:
    """Cache key of an initramfs: kernel, init script, busybox and agent contents."""
    h = hashlib.sha256()
    for part in (kernel_release.encode(), INIT_SCRIPT.encode(), hashlib.sha256(busybox).digest()):
        h.update(len(part).to_bytes(8, "little") + part)
    for name, data in sorted(agent.items()):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:16]


def build_initramfs(busybox: bytes, modules: list[tuple[str, bytes]],
                    agent: dict[str, bytes]) -> bytes:
    """The initramfs image (uncompressed newc cpio)."""
    d, f, x = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644, stat.S_IFREG | 0o755
    entries = [
        CpioEntry("bin", d), CpioEntry("dev", d), CpioEntry("proc", d), CpioEntry("sys", d),
        CpioEntry("newroot", d), CpioEntry("lib", d), CpioEntry("lib/modules", d),
        CpioEntry("boxd", d),
        CpioEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
        CpioEntry("dev/null", stat.S_IFCHR | 0o666, rdev=(1, 3)),
        CpioEntry("bin/busybox", x, busybox),
        CpioEntry("bin/sh", stat.S_IFLNK | 0o777, b"busybox"),
        CpioEntry("init", x, INIT_SCRIPT.encode()),
    ]
    order = "".join(name + "\n" for name, _ in modules)
    entries.append(CpioEntry("lib/modules/load-order", f, order.encode()))
    entries += [CpioEntry(f"lib/modules/{name}.ko", f, data) for name, data in modules]
    dirs = sorted({"/".join(parts[:i]) for parts in (n.split("/") for n in agent)
                   for i in range(1, len(parts))})
    entries += [CpioEntry(f"boxd/{name}", d) for name in dirs]
    entries += [
        CpioEntry(f"boxd/{name}", x if name == INIT_BINARY else f, data)
        for name, data in sorted(agent.items())
    ]
    return write_cpio(entries)
