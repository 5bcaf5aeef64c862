"""Machines of an imported container image on the QEMU engine, through the daemon
(issue 41, item 3): the image's files are the root disk (an ext4 made once per image,
under each machine's qcow2 overlay), boxd's own guest root a second, read-only disk
whose Python runs the agent. The image is a static busybox with no Python and no libc,
and a non-root USER. Few VMs (QEMU runs under TCG here): one machine, its fork, and a
machine from its snapshot.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from boxd import errors
from boxd.config import Paths
from tests._support.oci import make_image, write_layout
from tests.integration.test_image_machines import CONFIG, _files

pytestmark = pytest.mark.vm

IMAGE = "itq/app:v1"
PASSWD = {"etc/passwd": b"root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n",
          "etc/group": b"root:x:0:\napp:x:1000:\n"}
# The service: ENTRYPOINT + CMD, as the image's USER in its WORKDIR, serving its
# EXPOSEd port (which decides when the machine is ready).
SERVICE = {**CONFIG, "User": "app", "ExposedPorts": {"8000/tcp": {}},
           "Cmd": ["/bin/sh", "-c", "echo service up as $(busybox id -u) in $(pwd); "
                   "exec busybox httpd -f -p 8000 -h /srv/app"]}


@pytest.fixture(scope="module")
def image(client, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("qemu-layouts")
    write_layout(root / "app", {"v1": make_image([_files(), PASSWD], config=SERVICE)})
    digest = client.images.import_(f"oci:{root / 'app'}:v1", IMAGE).digest
    yield digest
    with contextlib.suppress(errors.NotFound):
        client.images.remove(IMAGE)


@pytest.fixture
def made(client) -> Iterator[list[str]]:  # type: ignore[no-untyped-def]
    ids: list[str] = []
    yield ids
    for mid in reversed(ids):
        with contextlib.suppress(Exception):
            client.machines.delete(mid)


def test_a_qemu_machine_runs_an_image_without_python_forks_and_snapshots(  # type: ignore[no-untyped-def]
        daemon, client, image, made) -> None:
    m = client.machines.new("imgq", engine="qemu", image=IMAGE)
    made.append(m.id)
    m = client.machines.wait_until_ready(m.id, timeout=300)
    assert m.engine == "qemu"
    assert m.image is not None and (m.image.name, m.image.digest) == (IMAGE, image)
    # The image's USER, WORKDIR and ENV; a program only the image has; no Python in it.
    r = client.machines.exec(m.id, ["busybox", "id", "-u"])
    assert (r.exit_code, r.stdout) == (0, "1000\n"), r
    assert client.machines.exec(m.id, ["busybox", "pwd"]).stdout == "/srv/app\n"
    r = client.machines.exec(m.id, "echo $GREETING $HOME; cat data.txt")
    assert r.stdout == "hi /home/app\nimage data\n", r
    assert client.machines.exec(m.id, ["hello-image"]).stdout == \
        "hello from the image: hi in /srv/app\n"
    assert client.machines.exec(m.id, ["busybox", "test", "-e", "/usr/bin/python3"]
                                ).exit_code == 1
    # the root filesystem grew to the machine's disk (the image has no resize2fs)
    df = client.machines.exec(m.id, ["busybox", "df", "-k", "/"]).stdout.splitlines()
    assert int(df[1].split()[1]) > (m.disk_gib - 1) << 20, df
    # exec's own user, cwd and env win
    r = client.machines.exec(m.id, "busybox id -u; pwd; echo $GREETING", user="root",
                             cwd="/tmp", env={"GREETING": "yo"})
    assert r.stdout == "0\n/tmp\nyo\n", r
    # the service started as the image says, and logged
    deadline = time.monotonic() + 60
    while "service up" not in (log := client.machines.logs(m.id)).data \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "service up as 1000 in /srv/app\n" in log.data, log
    # its EXPOSEd port, through the machine's URL
    r = httpx.get(client.machines.url(m.id, port=8000).rstrip("/") + "/data.txt", timeout=60)
    assert (r.status_code, r.text) == (200, "image data\n"), r
    # writes go to the machine's disk; a fork sees them, and its own stay its own
    client.machines.exec(m.id, "echo parent > /tmp/../srv/app/mine.txt", user="root")
    child = client.machines.fork(m.id, "imgq-child")
    made.append(child.id)
    assert child.image is not None and child.image.digest == image
    assert client.machines.exec(child.id, "cat mine.txt").stdout == "parent\n"
    assert client.machines.exec(child.id, ["busybox", "id", "-u"]).stdout == "1000\n"
    client.machines.exec(child.id, "echo child > mine.txt", user="root")
    assert client.machines.exec(m.id, "cat mine.txt").stdout == "parent\n"
    client.machines.delete(child.id)
    # a checkpoint rewinds it, on the guest root it was saved on (its RAM caches that
    # disk's blocks: a guest root built since, as after the daemon's guest image
    # changed, is another file): here a link to it stands for the old one
    client.machines.checkpoints.save(m.id, "before")
    client.machines.exec(m.id, "echo after > mine.txt", user="root")
    (note,) = list((Paths(daemon.home.resolve()).checkpoints).glob("*/runtime"))
    runtime = Path(note.read_text())
    assert runtime.name == "rootfs.img" and runtime.is_file()
    pinned = runtime.with_name(f"rootfs.pinned-{m.id}.img")
    os.link(runtime, pinned)
    try:
        note.write_text(str(pinned))
        client.machines.checkpoints.restore(m.id, "before")
        assert client.machines.exec(m.id, "cat mine.txt").stdout == "parent\n"
        assert any(str(pinned) in _cmdline(p) for p in _pids_of(m.id)), \
            "the restore attached the guest root the checkpoint names"
    finally:
        pinned.unlink()  # QEMU holds it open
    snap = client.snapshots.save(m.id, "imgq-snap")
    try:
        again = client.machines.new("imgq-again", from_snapshot=snap.name)
        made.append(again.id)
        again = client.machines.wait_until_ready(again.id, timeout=300)
        assert again.engine == "qemu"
        assert again.image is not None and again.image.digest == image
        assert client.machines.exec(again.id, "cat mine.txt; busybox id -u").stdout == \
            "parent\n1000\n"
        client.machines.delete(again.id)
    finally:
        client.snapshots.delete(snap.name)


def _pids_of(machine_id: str) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and machine_id in _cmdline(int(p.name))]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_an_image_machines_long_disk_chain_collapses(  # type: ignore[no-untyped-def]
        daemon, client, image, made) -> None:
    """Each checkpoint adds a layer under the machine's disk; past `MAX_CHAIN` the
    node streams them into the active one, down to the image's own disk (its records
    name the image's tree; QEMU's chain ends in the top layer chain's disk)."""
    import sqlite3

    from boxd.node.runtime import MAX_CHAIN

    m = client.machines.new("imgq-chain", engine="qemu", image=IMAGE, service=False)
    made.append(m.id)
    client.machines.wait_until_ready(m.id, timeout=300)

    def chain_length() -> int:
        db = sqlite3.connect(daemon.home / "state.db")
        try:
            (layer,) = db.execute("SELECT layer_id FROM machines WHERE id=?",
                                  (m.id,)).fetchone()
            n = 0
            while layer is not None:
                n += 1
                (layer,) = db.execute("SELECT parent_id FROM layers WHERE id=?",
                                      (layer,)).fetchone()
            return n
        finally:
            db.close()

    for i in range(MAX_CHAIN + 2):
        client.machines.exec(m.id, ["busybox", "sh", "-c", f"echo {i} > /layer-{i}"],
                             user="root")
        client.machines.checkpoints.save(m.id, f"c{i}")
    deadline = time.monotonic() + 300
    while chain_length() > MAX_CHAIN and time.monotonic() < deadline:
        time.sleep(1)
    assert chain_length() <= MAX_CHAIN, f"chain is {chain_length()} long"
    out = client.machines.exec(m.id, ["busybox", "sh", "-c", "cat /layer-*"],
                               user="root").stdout.split()
    assert sorted(out, key=int) == [str(i) for i in range(MAX_CHAIN + 2)]
    client.machines.checkpoints.restore(m.id, "c0")
    r = client.machines.exec(m.id, ["busybox", "ls", "/"], user="root")
    assert "layer-0" in r.stdout.split() and "layer-1" not in r.stdout.split(), r
