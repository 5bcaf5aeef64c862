"""Build the default guest image and boot it with a plain QEMU command line under TCG.

The image cache is shared through ``BOXD_IMAGE_CACHE`` (default here: the repo's
``.cache/images``), so a run builds the rootfs once (~1 min) and later runs only
rebuild the initramfs for the placeholder agent below.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd.config import Paths
from boxd.images import GuestImage, ensure_image, list_images

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
QEMU = "qemu-system-x86_64"

# Stand-in for src/boxd/guest/agent.py: proves init reached the agent, as PID 1, with
# the mounts, hostname, network and virtio-serial port the real agent relies on.
PLACEHOLDER_AGENT = r'''
import os, socket, sys
ports = {}
base = "/sys/class/virtio-ports"
for p in (os.listdir(base) if os.path.isdir(base) else []):
    with open(os.path.join(base, p, "name")) as f:
        ports[f.read().strip()] = p
mounts = {line.split()[1]: line.split()[2] for line in open("/proc/mounts")}
st = os.statvfs("/")
print("BOXD-TEST-AGENT pid=%d host=%s cwd=%s" % (os.getpid(), socket.gethostname(), os.getcwd()))
print("BOXD-TEST-PORT %s" % ports.get("boxd.agent", "missing"))
print("BOXD-TEST-MOUNTS " + " ".join("%s:%s" % (m, mounts.get(m, "-"))
      for m in ("/", "/proc", "/sys", "/dev", "/dev/pts", "/dev/shm", "/run", "/tmp")))
print("BOXD-TEST-ROOT-BYTES %d" % (st.f_blocks * st.f_frsize))
print("BOXD-TEST-ETH0 %s" % os.path.exists("/sys/class/net/eth0"))
print("BOXD-TEST-RESOLV %s" % open("/etc/resolv.conf").read().strip())
print("BOXD-TEST-DONE", flush=True)
sys.stdout.flush()
import time
while True:
    time.sleep(3600)
'''

CPU = "Haswell-noTSX,-pcid,-invpcid,-tsc-deadline"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuestImage]:
    for tool in (QEMU, "qemu-img", "mmdebstrap"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (run scripts/setup-host.sh)")
    home = tmp_path_factory.mktemp("boxd-home")
    agent_dir = tmp_path_factory.mktemp("agent")
    (agent_dir / "agent.py").write_text(PLACEHOLDER_AGENT)
    mp = pytest.MonkeyPatch()
    if not os.environ.get("BOXD_IMAGE_CACHE"):
        mp.setenv("BOXD_IMAGE_CACHE", str(REPO / ".cache" / "images"))
    steps: list[str] = []
    started = time.monotonic()
    img = ensure_image(Paths(home), progress=lambda s, _f: steps.append(s),
                       guest_dir=agent_dir)
    print(f"ensure_image: {time.monotonic() - started:.1f} s, steps: {steps}")
    yield img
    mp.undo()


def test_image_files_and_cache(image: GuestImage, tmp_path: Path) -> None:
    assert image.kernel.name in {"vmlinux", "vmlinuz"}
    assert image.kernel.read_bytes()[:4] == (b"\x7fELF" if image.kernel.name == "vmlinux"
                                            else image.kernel.read_bytes()[:4])
    assert image.rootfs.stat().st_size > 100 * 2**20
    assert image.initrd.stat().st_size > 1 * 2**20
    assert (image.dir / "recipe.json").exists()
    assert not list(image.dir.parent.glob(f"{image.dir.name}.tmp-*"))

    # A changed agent rebuilds only the initramfs: same rootfs, new key, milliseconds.
    other = tmp_path / "agent2"
    other.mkdir()
    (other / "agent.py").write_text(PLACEHOLDER_AGENT + "\n# changed\n")
    started = time.monotonic()
    img2 = ensure_image(Paths(tmp_path), image.recipe, guest_dir=other)
    assert time.monotonic() - started < 10
    assert img2.rootfs == image.rootfs
    assert img2.initrd != image.initrd
    assert img2.key != image.key
    assert any(i.dir == image.dir for i in list_images(Paths(tmp_path), guest_dir=other))


def _boot_argv(image: GuestImage, run: Path, hostname: str) -> list[str]:
    append = f"console=ttyS0 root=/dev/vda rw quiet boxd.hostname={hostname} {image.cmdline_hint}"
    return [
        QEMU,
        "-M", "microvm,pic=off,pit=off,rtc=on,isa-serial=on",
        "-bios", "/usr/share/qemu/qboot.rom",
        "-accel", "tcg,tb-size=64",
        "-cpu", CPU,
        "-m", "512",
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-serial", f"file:{run / 'console.log'}",
        "-kernel", str(image.kernel),
        "-initrd", str(image.initrd),
        "-append", append.strip(),
        "-drive", f"file={run / 'disk.qcow2'},format=qcow2,if=none,id=disk",
        "-device", "virtio-blk-device,drive=disk",
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={run / 'agent.sock'},server=on,wait=off",
        "-device", "virtserialport,name=boxd.agent,chardev=agent",
        "-netdev", "user,id=n0",
        "-device", "virtio-net-device,netdev=n0",
    ]


def test_image_boots_to_agent(image: GuestImage, tmp_path: Path) -> None:
    run = tmp_path
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw",
                    "-b", str(image.rootfs), str(run / "disk.qcow2"), "2G"], check=True)
    argv = _boot_argv(image, run, "imgtest")
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    console = run / "console.log"
    text = ""
    try:
        deadline = started + 120
        while time.monotonic() < deadline and proc.poll() is None:
            text = console.read_text(errors="replace") if console.exists() else ""
            if "BOXD-TEST-DONE" in text:
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        print(f"boot to agent: {elapsed:.2f} s")
        assert "BOXD-TEST-DONE" in text, (
            f"no agent marker after {elapsed:.0f} s; qemu rc={proc.poll()}\n{text[-3000:]}")
        assert "boxd-init: starting agent" in text
        assert "FATAL" not in text
        assert re.search(r"BOXD-TEST-AGENT pid=1 host=imgtest cwd=\S+", text), text
        assert re.search(r"BOXD-TEST-PORT vport\d+p\d+", text), text
        mounts = re.search(r"BOXD-TEST-MOUNTS (.*)", text)
        assert mounts is not None
        assert mounts.group(1).split() == [
            "/:ext4", "/proc:proc", "/sys:sysfs", "/dev:devtmpfs", "/dev/pts:devpts",
            "/dev/shm:tmpfs", "/run:tmpfs", "/tmp:tmpfs"]
        root_bytes = re.search(r"BOXD-TEST-ROOT-BYTES (\d+)", text)
        assert root_bytes is not None
        assert int(root_bytes.group(1)) > int(1.5 * 2**30), "root fs was not grown to the disk"
        assert "BOXD-TEST-ETH0 True" in text
        assert "BOXD-TEST-RESOLV nameserver 10.0.2.3" in text
        # The agent's virtio-serial port is reachable from the host.
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(run / "agent.sock"))
    finally:
        proc.kill()
        proc.wait(10)
