"""cpio writer, kernel helpers (ELF notes, modinfo, payload extraction), init script (no I/O)."""

from __future__ import annotations

import lzma
import stat
import struct
from pathlib import Path

from boxd.images import _initramfs, _kernel


def _parse_cpio(data: bytes) -> dict[str, tuple[int, bytes]]:
    out: dict[str, tuple[int, bytes]] = {}
    pos = 0
    while True:
        assert data[pos:pos + 6] == b"070701"
        f = [int(data[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = f[1], f[6], f[11]
        name = data[pos + 110: pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += -pos % 4
        body = data[pos:pos + size]
        pos += size + (-size % 4)
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, body)


def test_cpio_roundtrip() -> None:
    img = _initramfs.build_initramfs(b"BB", [("virtio", b"KO1"), ("ext4", b"KO22")],
                                     {"agent.py": b"print('hi')"})
    assert len(img) % 512 == 0
    files = _parse_cpio(img)
    assert files["init"][1].startswith(b"#!/bin/busybox sh")
    assert files["init"][0] & 0o111
    assert stat.S_ISCHR(files["dev/console"][0])
    assert files["lib/modules/load-order"][1] == b"virtio\next4\n"
    assert files["lib/modules/ext4.ko"][1] == b"KO22"
    assert files["boxd/agent.py"][1] == b"print('hi')"
    assert stat.S_ISLNK(files["bin/sh"][0])


def test_init_script_contract() -> None:
    s = _initramfs.INIT_SCRIPT
    for needle in ("boxd.hostname=", "10.0.2.15/24", "10.0.2.2", "nameserver 10.0.2.3",
                   "resize2fs", "switch_root", "/run/boxd/agent.py", "python3 -u",
                   "virtio_mmio.", "devpts", "/dev/shm"):
        assert needle in s
    # a container image's machine: the guest root's disk, found by the serial the
    # engine names, lends the agent its Python through its own loader
    from boxd.engine.qemu._argv import RUNTIME_SERIAL

    assert RUNTIME_SERIAL == "boxd-rt"
    for needle in ("boxd.runtime=", "/sys/block/vd*", "/serial", "ro,noload",
                   "/opt/boxd-rt", "--python-arg --library-path", "usr/sbin/resize2fs"):
        assert needle in s, needle


def test_modinfo_field() -> None:
    blob = b"\x00junk\x00license=GPL\x00depends=virtio,virtio_ring\x00name=virtio_blk\x00"
    assert _kernel.modinfo_field(blob, "depends") == ["virtio,virtio_ring"]
    assert _kernel.modinfo_field(blob, "name") == ["virtio_blk"]
    assert _kernel.modinfo_field(blob, "softdep") == []


def _elf_with_note(name: bytes, ntype: int) -> bytes:
    desc = b"\0" * 4
    namesz = len(name) + 1
    note = struct.pack("<III", namesz, len(desc), ntype) + name + b"\0"
    note += b"\0" * (-len(note) % 4) + desc
    ehdr = bytearray(64)
    ehdr[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", ehdr, 0x20, 64)
    struct.pack_into("<HH", ehdr, 0x36, 56, 1)
    phdr = bytearray(56)
    struct.pack_into("<I", phdr, 0, 4)
    struct.pack_into("<Q", phdr, 8, 120)
    struct.pack_into("<Q", phdr, 32, len(note))
    return bytes(ehdr) + bytes(phdr) + note


def test_pvh_note_detection() -> None:
    assert _kernel.has_pvh_note(_elf_with_note(b"Xen", 18))
    assert not _kernel.has_pvh_note(_elf_with_note(b"Xen", 5))
    assert not _kernel.has_pvh_note(_elf_with_note(b"GNU", 18))
    assert not _kernel.has_pvh_note(b"MZ not an elf")


def test_extract_vmlinux_finds_xz_payload() -> None:
    elf = _elf_with_note(b"Xen", 18) + b"kernel" * 100
    bzimage = b"\x00" * 700 + b"HdrS" + b"\x00" * 50 + lzma.compress(elf) + b"\xff" * 30
    assert _kernel.extract_vmlinux(bzimage) == elf
    assert _kernel.extract_vmlinux(b"\x00" * 100) is None


def test_the_client_files_are_a_whole_client(tmp_path: Path) -> None:
    """What the initramfs carries for `from boxd import Boxd` in a guest imports alone:
    every boxd module the client loads comes from those files (no daemon code)."""
    import subprocess
    import sys

    from boxd.images._initramfs import client_files, guest_files

    files = client_files()
    assert set(files) <= set(guest_files(Path(__file__).parents[2] / "src/boxd/guest"))
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1] + '/py')\n"
        "from boxd import Boxd, AsyncBoxd, errors, models\n"
        "import boxd.process_models, boxd.sdk._lineage\n"
        "Boxd(api_key='boxd_x', base_url='http://127.0.0.1:9').close()\n"
        "bad = [m for m, mod in sys.modules.items() if m.startswith('boxd') and not "
        "str(getattr(mod, '__file__', '') or '').startswith(sys.argv[1])]\n"
        "assert not bad, bad\n"
        "assert not {'fastapi', 'uvicorn', 'qemu'} & set(sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stderr
