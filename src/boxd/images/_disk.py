"""A container image's root as a block device, for engines that boot one (QEMU).

An imported image is unpacked per layer chain into hard-linked directory trees
(`boxd.images.oci.unpack_image`: ``chains/<id>`` holds the first k layers, and
``chains/<id>.below`` names the chain under it); gVisor serves those trees itself. A
QEMU guest boots a disk, so the trees become disks the same way, one per chain, and
an image's disk is the qcow2 backing chain of its layer chains: a base shared by ten
images is stored once.

- The first chain (no ``.below``) is packed with ``mkfs.ext4 -d`` into a raw ext4,
  sized content x 1.15 + 256 MiB (sparse: the headroom costs nothing on the host).
- A chain above it starts as a raw copy of the disk below (``qemu-img convert``,
  sparse), grown with ``resize2fs`` if its files need more room; what its layer changed
  (`boxd.images._ext4diff`: removals, new files, modes, owners, times, links, xattrs)
  is applied with ``debugfs -w`` and checked with ``e2fsck -fn``; then a qcow2 on
  that copy is rebased onto the disk below (``qemu-img rebase``, safe mode), which
  keeps only the clusters the two differ in: a qcow2 backed by the disk below. No
  loop device, no mount, no root needed, and the guest needs nothing new: QEMU
  follows the backing chain itself.
- A chain that debugfs cannot express (a socket in the tree, a name with a line break)
  or whose build fails is packed whole instead (``mkfs.ext4 -d``: correct, not shared;
  logged as ``event=image_disk_unshared``), and the chains above it back on that.

Every machine of the image backs its qcow2 overlay on the top chain's disk: writes go
to the machine's overlay, forks share the image's blocks copy-on-write, and no disk of
a chain changes once made.

Layout::

    <dest>/<chain id>.ext4      a chain's root as a whole raw ext4 (the first chain's,
                                one packed whole, or one made before disks were chained)
    <dest>/<chain id>.qcow2     a chain's changes, backed by the disk of the chain below
    <dest>/<chain id>.lock      fcntl lock: a second maker waits, then uses the result

A disk once made is never renamed or removed here: machines' overlays name it as
their backing file.

Moving to another node (a cross-node fork of an image machine): each node packs its own
disks, and two packings of one tree differ byte for byte (mkfs.ext4's UUID, times and
block layout), while a machine's frozen qcow2 layers sit on the sender's disks block by
block. So the sender's chain goes with them (`disk_chain`, each disk under a name of
its exact bytes, `disk_name`) and the receiver keeps it beside its own
(`place_disk`)::

    <dest>/<chain id>.<stamp>.ext4    another node's disk of a chain, as its name says
    <dest>/<chain id>.<stamp>.qcow2   (the stamp names those bytes on every node)

A node asked for a disk it made itself (a fork coming back) finds it by its stamp
(`find_disk`). The collection treats every disk of a chain alike (its chain id). Other
roots a QEMU template may sit on go by the same kind of name (`disk_name` with a kind):
``rootfs.<stamp>.img``, a guest root, and ``disk.<stamp>.qcow2``, a snapshot's whole
disk; a receiver keeps those apart (`boxd.config.Paths.received_roots`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
import subprocess
from pathlib import Path

from boxd.errors import HostSetupError, IntegrityError, InvalidRequest

from ._build import _locked
from ._ext4diff import Script, Tree, Unsupported
from ._rootfs import ext4_size, make_ext4
from ._util import need_tool, run

log = logging.getLogger("boxd.images")

#: The mode of the disk files: QEMU's unprivileged user reads them through its group.
DISK_MODE = 0o640
#: Cluster size of a chain's qcow2: small, so a changed inode costs 16 KiB, not 64.
_CLUSTER = 16384
_BELOW = ".below"


def image_disk(tree: Path, dest: Path, group: int | None = None) -> Path:
    """The disk of ``tree`` (a container image's unpacked root: its top layer chain),
    made once per chain under ``dest`` and shared read-only by every machine of it: a
    raw ext4, or a qcow2 backed by the disks of the chains below (`disk_format`).

    ``group``: the group that may read it (QEMU's, when it drops privileges).

    Raises:
        HostSetupError: mkfs.ext4 or qemu-img is missing or failed.
    """
    dest.mkdir(parents=True, exist_ok=True, mode=0o711)
    todo: list[Path] = []  # chains without a disk, top first
    here: Path | None = tree
    disk: Path | None = None
    while here is not None and (disk := _existing(dest, here.name)) is None:
        todo.append(here)
        here = chain_below(here)
    below = None if here is None or disk is None else (here, disk)
    for chain in reversed(todo):
        disk = _make(chain, below, dest, group)
        below = (chain, disk)
    assert disk is not None
    return disk


def chain_below(tree: Path) -> Path | None:
    """The tree of the layer chain under ``tree``, as `unpack_image` noted it (None: the
    first chain, or one unpacked before chains were noted)."""
    try:
        name = os.readlink(tree.with_name(tree.name + _BELOW))
    except OSError:
        return None
    below = tree.with_name(name)
    return below if "/" not in name and below.is_dir() else None


def disk_format(disk: Path) -> str:
    """``raw`` or ``qcow2``: how QEMU opens an image disk `image_disk` returned (or a
    root `disk_name` named: ``.img`` is a raw guest root)."""
    return "raw" if disk.suffix in (".ext4", ".img") else "qcow2"


def virtual_size(disk: Path) -> int:
    """The size in bytes the guest sees of an image disk (a qcow2's, from its header)."""
    if disk_format(disk) == "raw":
        return disk.stat().st_size
    with open(disk, "rb") as f:
        header = f.read(32)
    return int.from_bytes(header[24:32], "big")


def _existing(dest: Path, chain: str) -> Path | None:
    for suffix in (".ext4", ".qcow2"):
        if (dest / f"{chain}{suffix}").exists():
            return dest / f"{chain}{suffix}"
    return None


def _make(tree: Path, below: tuple[Path, Path] | None, dest: Path, group: int | None) -> Path:
    """The disk of the chain ``tree``: its changes over ``below`` (the chain under it
    and that chain's disk), or, with none or when that fails, the whole tree."""
    with _locked(dest / f"{tree.name}.lock"):
        found = _existing(dest, tree.name)
        if found is not None:
            return found
        if below is not None:
            try:
                return _changes(tree, below, dest, group)
            except (Unsupported, HostSetupError) as exc:
                log.warning("event=image_disk_unshared chain=%s below=%s reason=%r",
                            tree.name[:12], below[0].name[:12], str(exc)[:500])
        return _whole(tree, dest, group)


def _whole(tree: Path, dest: Path, group: int | None) -> Path:
    final = dest / f"{tree.name}.ext4"
    tmp = dest / f".{tree.name}.tmp-{os.getpid()}"
    try:
        make_ext4(tree, tmp)
        _publish(tmp, final, group)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return final


def _changes(tree: Path, below: tuple[Path, Path], dest: Path, group: int | None) -> Path:
    """``tree``'s disk as a qcow2 of what differs from the disk below (see the module
    docstring).

    Raises:
        Unsupported: the tree holds an entry debugfs cannot make.
        HostSetupError: a tool failed (debugfs's or e2fsck's complaints included).
    """
    below_tree, below_disk = below
    final = dest / f"{tree.name}.qcow2"
    stem = dest / f".{tree.name}.{os.getpid()}"
    raw, out, values = (stem.with_name(stem.name + s) for s in (".raw", ".tmp", ".ea"))
    try:
        values.mkdir(mode=0o700, exist_ok=True)
        here = Tree.walk(tree)
        script = Script(Tree.walk(below_tree), here, values).build()
        qemu_img = need_tool("qemu-img", "image disk")
        run([qemu_img, "convert", "-q", "-O", "raw", "-f", disk_format(below_disk),
             below_disk, raw], "image disk: copy the chain below")
        _grow(raw, ext4_size(*here.used())[0] << 20)
        _debugfs(raw, script, stem.with_name(stem.name + ".cmds"))
        run([need_tool("e2fsck", "image disk"), "-fn", raw], "image disk: check")
        # Only what differs from the disk below: an empty qcow2 on the changed copy,
        # rebased (safe mode) onto the disk below, copies in each cluster the two differ in.
        run([qemu_img, "create", "-q", "-f", "qcow2", "-o", f"cluster_size={_CLUSTER}",
             "-b", raw, "-F", "raw", out], "image disk: keep the changes")
        run([qemu_img, "rebase", "-q", "-f", "qcow2", "-b", below_disk, "-F",
             disk_format(below_disk), out], "image disk: keep the changes")
        _publish(out, final, group)
    finally:
        shutil.rmtree(values, ignore_errors=True)
        for p in (raw, out, stem.with_name(stem.name + ".cmds")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    log.info("event=image_disk_chained chain=%s below=%s bytes=%d", tree.name[:12],
             below_tree.name[:12], final.stat().st_blocks * 512)
    return final


def _grow(raw: Path, need: int) -> None:
    """Make the file system on ``raw`` at least ``need`` bytes (offline resize2fs)."""
    if raw.stat().st_size >= need:
        return
    os.truncate(raw, need)
    run([need_tool("resize2fs", "image disk"), "-f", raw, f"{need >> 20}M"],
        "image disk: grow")


def _debugfs(raw: Path, script: list[str], cmds: Path) -> None:
    """Run ``script`` on ``raw`` with ``debugfs -w``. It reports a failed command on
    stderr only (exit status 0), so any line there but its banner is a failure.

    Raises:
        HostSetupError: a command failed.
    """
    cmds.write_bytes("".join(f"{line}\n" for line in script).encode(errors="surrogateescape"))
    argv = [need_tool("debugfs", "image disk"), "-w", "-f", str(cmds), str(raw)]
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=3600,
                           check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostSetupError(f"image disk: debugfs failed: {exc}") from None
    errors = [line for line in r.stderr.decode(errors="replace").splitlines()
              if line.strip() and not line.startswith("debugfs ")]
    if r.returncode != 0 or errors:
        raise HostSetupError(f"image disk: debugfs failed (exit {r.returncode}): "
                             + " | ".join(errors[:5]))


def _publish(tmp: Path, final: Path, group: int | None) -> None:
    """``tmp`` renamed to ``final`` once it is whole: mode DISK_MODE, group ``group``."""
    os.chmod(tmp, DISK_MODE)
    if group is not None:
        os.chown(tmp, -1, group)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


# ---------------------------------------------------------------- moving between nodes

#: qcow2's magic: the first four bytes of its header.
_QCOW2_MAGIC = b"QFI\xfb"
#: The suffixes of an image disk's two forms.
_SUFFIXES = (".ext4", ".qcow2")
#: Other roots a disk may sit on (`disk_name`), and the suffix each is named with.
_KINDS = {"rootfs": "img", "disk": "qcow2"}


def disk_chain(top: Path) -> list[Path]:
    """The image disks ``top`` stands on, itself included, bottom (a raw ext4) first:
    each qcow2's backing file as its header names it.

    Raises:
        IntegrityError: a backing file named is not an image disk beside ``top``.
    """
    chain = [top]
    while chain[-1].suffix == ".qcow2":
        below = qcow2_backing(chain[-1])
        if below is None or below.parent != top.parent or below.suffix not in _SUFFIXES \
                or below in chain:
            raise IntegrityError(
                f"image disk {chain[-1]} names backing {below}, not an image disk beside it",
                hint="remove the image and import it again (`boxd image rm`, "
                "`boxd image import`)")
        chain.append(below)
    return chain[::-1]


def qcow2_backing(path: Path) -> Path | None:
    """The backing file a qcow2's header names (None: none, or not a qcow2)."""
    with open(path, "rb") as f:
        header = f.read(20)
        if len(header) < 20 or header[:4] != _QCOW2_MAGIC:
            return None
        offset = int.from_bytes(header[8:16], "big")
        size = int.from_bytes(header[16:20], "big")
        if offset == 0 or not 0 < size <= 4096:
            return None
        f.seek(offset)
        return Path(os.fsdecode(f.read(size)))


def disk_name(disk: Path, kind: str | None = None) -> str:
    """A name of ``disk``'s exact bytes, the same on every node that holds them. An
    image disk: ``<chain id>.<stamp><suffix>``; another root (``kind``: ``rootfs``, a
    raw guest root, or ``disk``, a standalone qcow2 such as a snapshot's disk):
    ``<kind>.<stamp>.img|qcow2``. A disk received from a peer keeps the name it came
    with; one made here is named by where and when it was made (this host, its device,
    inode, size and mtime: a disk never changes once made, one made again is another)."""
    if _valid_name(disk.name):
        return disk.name
    st = disk.stat()
    where = f"{_host_id()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    stamp = hashlib.sha256(where.encode()).hexdigest()[:20]
    if kind is not None:
        return f"{kind}.{stamp}.{_KINDS[kind]}"
    return f"{disk.name.split('.')[0]}.{stamp}{disk.suffix}"


def find_disk(dest: Path, name: str) -> Path | None:
    """The disk under ``dest`` whose bytes `disk_name` calls ``name``: received before,
    or made here."""
    received = dest / name
    if received.exists():
        return received
    chain, _, suffix = name.split(".")
    own = dest / f"{chain}.{suffix}"
    with contextlib.suppress(FileNotFoundError):
        if disk_name(own) == name:
            return own
    return None


def check_disk_name(name: str) -> None:
    """Raise InvalidRequest unless ``name`` is what `disk_name` gives (a peer's word)."""
    if not _valid_name(name):
        raise InvalidRequest(f"{name!r} is not an image disk's name", field="roots")


def _valid_name(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 3 and _hex(parts[1]) and (
        _KINDS.get(parts[0]) == parts[2]
        or (_hex(parts[0]) and f".{parts[2]}" in _SUFFIXES))


def _hex(part: str) -> bool:
    return bool(part) and all(c in "0123456789abcdef" for c in part)


def place_disk(received: Path, dest: Path, name: str, below: Path | None,
               group: int | None) -> Path:
    """Keep ``received`` (a peer's disk, fetched whole) under ``dest`` as ``name``: a
    qcow2 is re-pointed at ``below``, this node's copy of the disk under it (its header
    only: ``qemu-img rebase -u``). Returns its path; ``received`` is moved there."""
    check_disk_name(name)
    final = dest / name
    if final.suffix == ".qcow2" and qcow2_backing(received) is not None:
        if below is None:
            raise InvalidRequest(f"image disk {name} came without the disk under it",
                                 field="roots")
        run([need_tool("qemu-img", "image disk"), "rebase", "-q", "-u", "-f", "qcow2",
             "-b", below, "-F", disk_format(below), received], "image disk: re-point")
    dest.mkdir(parents=True, exist_ok=True, mode=0o711)
    _publish(received, final, group)
    return final


def unused_received(dest: Path, used: set[str]) -> list[Path]:
    """Remove the whole disks under ``dest`` (``disk.<stamp>.qcow2``: a snapshot's disk a
    peer's template sat on, `place_disk`) whose path is not in ``used`` (what layers sit
    on); return them. Guest roots stay (a template's guest root is noted, not a base)."""
    gone = []
    for disk in dest.glob("disk.*.qcow2") if dest.is_dir() else ():
        if str(disk) not in used and _valid_name(disk.name):
            disk.unlink(missing_ok=True)
            gone.append(disk)
    return gone


def _host_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            value = Path(path).read_text().strip()
            if value:
                return value
    return socket.gethostname()


__all__ = [
    "DISK_MODE", "chain_below", "check_disk_name", "disk_chain", "disk_format", "disk_name",
    "find_disk", "image_disk", "place_disk", "qcow2_backing", "unused_received", "virtual_size",
]
