"""Guest kernel: fetch Debian's kernel and busybox packages, unpack them, pick modules.

Nothing is installed on the host: packages are fetched with ``apt-get download`` and
unpacked with ``dpkg-deb -x`` into a scratch directory.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import re
import shutil
import struct
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

from boxd.errors import HostSetupError

from ._util import need_tool, run

# Modules the init loads, in the order given (dependencies are added before each).
WANTED_MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio_net",
    "crc32c_generic",
    "ext4",
)

_APT_HINT = "check the host's apt sources and network, then run scripts/setup-host.sh"


def resolve_kernel_package() -> tuple[str, str]:
    """The concrete kernel package behind ``linux-image-amd64`` and its version string.

    Returns:
        (package name, kernel release), e.g. ("linux-image-6.1.0-57-amd64", "6.1.0-57-amd64").

    Raises:
        HostSetupError: apt-cache is missing or does not know the metapackage.
    """
    need_tool("apt-cache", "resolve kernel version")
    out = run(["apt-cache", "depends", "linux-image-amd64"], "resolve kernel version",
              hint=_APT_HINT)
    for line in out.splitlines():
        m = re.match(r"\s*Depends:\s*(linux-image-(\S+))\s*$", line)
        if m and m.group(2) != "amd64":
            return m.group(1), m.group(2)
    raise HostSetupError(
        "image build step 'resolve kernel version' failed: linux-image-amd64 has no "
        f"linux-image-<version> dependency in apt-cache output:\n{out[-1500:]}",
        hint="run `apt-get update` (scripts/setup-host.sh does it)",
    )


def download_debs(packages: list[str], dest: Path) -> list[Path]:
    """``apt-get download`` the packages into ``dest``; return the .deb files.

    Raises:
        HostSetupError: the download failed.
    """
    need_tool("apt-get", "download packages")
    dest.mkdir(parents=True, exist_ok=True)
    # As root, apt drops to the _apt user, which cannot write our private temp dir.
    run(["apt-get", "-q", "-o", "APT::Sandbox::User=root", "download", *packages],
        "download " + " ".join(packages), cwd=dest, hint=_APT_HINT)
    debs = sorted(dest.glob("*.deb"))
    if not debs:
        raise HostSetupError(f"apt-get download {' '.join(packages)} produced no .deb",
                             hint=_APT_HINT)
    return debs


def unpack_deb(deb: Path, dest: Path) -> None:
    """``dpkg-deb -x`` one package into ``dest``.

    Raises:
        HostSetupError: dpkg-deb failed.
    """
    need_tool("dpkg-deb", "unpack packages")
    dest.mkdir(parents=True, exist_ok=True)
    run(["dpkg-deb", "-x", deb, dest], f"unpack {deb.name}")


# --- vmlinux from bzImage (like the kernel's scripts/extract-vmlinux) -------------------

_MAGICS: tuple[tuple[str, bytes], ...] = (
    ("xz", b"\xfd7zXZ\x00"),
    ("zstd", b"\x28\xb5\x2f\xfd"),
    ("gzip", b"\x1f\x8b\x08"),
    ("bzip2", b"BZh"),
    ("lzma", b"\x5d\x00\x00"),
)


def _decompress(kind: str, data: bytes) -> bytes | None:
    try:
        if kind == "xz":
            return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)
        if kind == "lzma":
            return lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(data)
        if kind == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
        if kind == "bzip2":
            return bz2.BZ2Decompressor().decompress(data)
        if kind == "zstd" and shutil.which("zstd"):
            # The stdlib has no zstd before 3.14; use the CLI when it is present.
            proc = subprocess.run(["zstd", "-dc"], input=data, capture_output=True,
                                  check=False)
            return proc.stdout or None
    except (lzma.LZMAError, zlib.error, OSError, EOFError, ValueError):
        return None
    return None


def extract_vmlinux(bzimage: bytes) -> bytes | None:
    """The uncompressed ELF kernel inside a bzImage, or None when none is found."""
    for kind, magic in _MAGICS:
        start = 0
        while (pos := bzimage.find(magic, start)) >= 0:
            start = pos + 1
            out = _decompress(kind, bzimage[pos:])
            if out and out[:4] == b"\x7fELF":
                return out
    return None


XEN_ELFNOTE_PHYS32_ENTRY = 18


def has_pvh_note(elf: bytes) -> bool:
    """True when a 64-bit ELF kernel carries the Xen PVH entry note QEMU boots from."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        return False
    e_phoff, = struct.unpack_from("<Q", elf, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(e_phnum):
        off = e_phoff + i * e_phentsize
        p_type, = struct.unpack_from("<I", elf, off)
        if p_type != 4:  # PT_NOTE
            continue
        p_offset, = struct.unpack_from("<Q", elf, off + 8)
        p_filesz, = struct.unpack_from("<Q", elf, off + 32)
        pos, end = p_offset, p_offset + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            name = elf[pos + 12: pos + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and ntype == XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            pos += 12 + ((namesz + 3) & ~3) + ((descsz + 3) & ~3)
    return False


# --- kernel modules ------------------------------------------------------------------

def _norm(name: str) -> str:
    return name.replace("-", "_")


def read_module(path: Path) -> bytes:
    """A module's bytes, decompressed when stored as .ko.xz / .ko.gz / .ko.zst."""
    data = path.read_bytes()
    if path.suffix == ".xz":
        return lzma.decompress(data)
    if path.suffix == ".gz":
        return gzip.decompress(data)
    if path.suffix == ".zst":
        out = _decompress("zstd", data)
        if out is None:
            raise HostSetupError(f"cannot decompress {path}: zstd not found",
                                 hint="apt-get install zstd")
        return out
    return data


def modinfo_field(module: bytes, field: str) -> list[str]:
    """Values of ``field=`` in a module's .modinfo strings (parsed without tools)."""
    pat = re.compile(rb"(?:^|\0)" + re.escape(field.encode()) + rb"=([^\0]*)")
    return [m.group(1).decode(errors="replace") for m in pat.finditer(module)]


@dataclass(frozen=True)
class ModuleSet:
    """Kernel modules to load, dependencies first, as (name, uncompressed bytes)."""

    modules: tuple[tuple[str, bytes], ...]


def _module_index(moddir: Path) -> tuple[dict[str, Path], set[str]]:
    """An unpacked kernel tree's module files by (normalised) name, and its built-ins."""
    index: dict[str, Path] = {}
    for p in moddir.rglob("*.ko*"):
        base = p.name.split(".ko", 1)[0]
        index[_norm(base)] = p
    builtin: set[str] = set()
    bfile = moddir / "modules.builtin"
    if bfile.exists():
        for line in bfile.read_text().splitlines():
            builtin.add(_norm(Path(line).name.split(".ko", 1)[0]))
    return index, builtin


def resolve_modules(moddir: Path, wanted: tuple[str, ...] = WANTED_MODULES) -> ModuleSet:
    """Collect ``wanted`` modules and their dependencies from an unpacked kernel tree.

    Built-in modules (``modules.builtin``) and absent ones are skipped. Soft
    dependencies on crc32c are covered by listing ``crc32c_generic`` explicitly.

    Raises:
        HostSetupError: a required module (one that is neither built in nor optional) is missing.
    """
    index, builtin = _module_index(moddir)
    ordered: list[tuple[str, bytes]] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        name = _norm(name)
        if name in seen or name in builtin:
            return
        if name in chain:
            return
        path = index.get(name)
        if path is None:
            if name in {"virtio_mmio", "crc32c_generic"}:
                return  # built in under another name, or not needed
            raise HostSetupError(
                f"kernel module {name} not found under {moddir}",
                hint="the Debian kernel package changed layout; report this",
            )
        data = read_module(path)
        for deps in modinfo_field(data, "depends"):
            for dep in filter(None, deps.split(",")):
                visit(dep, (*chain, name))
        seen.add(name)
        ordered.append((name, data))

    for w in wanted:
        visit(w, ())
    return ModuleSet(tuple(ordered))
