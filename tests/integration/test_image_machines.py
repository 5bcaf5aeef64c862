"""Machines of an imported container image, on gVisor, through the daemon.

The images are made here, offline, from files: a static busybox as the image's only
program (no Python, no libc, no /etc), and a variant whose ``/usr/bin/python3`` is a
script that only fails. boxd runs its agent on its own guest root's Python either way;
the image's files are the machine's root, its ENV, WORKDIR and USER exec's defaults.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd import errors
from tests._support.machines import _gvisor_status
from tests._support.oci import make_image, write_layout

pytestmark = pytest.mark.vm

HELLO = b"#!/bin/sh\necho \"hello from the image: $GREETING in $(pwd)\"\n"
CONFIG = {"Env": ["PATH=/usr/local/bin:/bin", "GREETING=hi"], "WorkingDir": "/srv/app",
          "Cmd": ["/bin/sh"]}


def _busybox() -> bytes:
    path = shutil.which("busybox")
    if path is None:
        pytest.skip("no busybox on this host (Debian's busybox-static)")
    data = Path(path).read_bytes()
    if b"/lib64/ld-linux" in data[:4096]:
        pytest.skip(f"{path} is not static (install busybox-static)")
    return data


def _files(extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    busybox = _busybox()
    return {"bin/busybox": busybox, "bin/sh": busybox, "bin/cat": busybox,
            "usr/local/bin/hello-image": HELLO, "srv/app/data.txt": b"image data\n",
            **(extra or {})}


@pytest.fixture(scope="module")
def images(client, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:  # type: ignore[no-untyped-def]
    """Two images imported for the session's account: ``tiny`` (busybox only) and
    ``badpy`` (its python3 a script that exits 99)."""
    status, why = _gvisor_status(client)
    if status != "ok":
        pytest.skip(f"gvisor unavailable here: {why}")
    root = tmp_path_factory.mktemp("layouts")
    tiny = make_image([_files()], config=CONFIG)
    badpy = make_image([_files(), {"usr/bin/python3": b"#!/bin/sh\necho image-python\nexit 99\n"}],
                       config=CONFIG)
    user = make_image([_files(), {"etc/passwd": b"root:x:0:0::/root:/bin/sh\n"
                                                b"app:x:1000:1000::/home/app:/bin/sh\n",
                                  "etc/group": b"root:x:0:\napp:x:1000:\n"}],
                      config={**CONFIG, "User": "app"})
    got = {}
    for name, img in (("tiny", tiny), ("badpy", badpy), ("user", user)):
        write_layout(root / name, {"v1": img})
        got[name] = client.images.import_(f"oci:{root / name}:v1", f"it/{name}:v1").digest
    yield got
    for name in ("it/tiny:v1", "it/badpy:v1", "it/user:v1"):
        with contextlib.suppress(errors.NotFound):
            client.images.remove(name)


@pytest.fixture
def made(client) -> Iterator[list[str]]:  # type: ignore[no-untyped-def]
    ids: list[str] = []
    yield ids
    for mid in ids:
        with contextlib.suppress(Exception):
            client.machines.delete(mid)


def _new(client, made: list[str], name: str, **kw):  # type: ignore[no-untyped-def]
    m = client.machines.new(name, engine="gvisor", **kw)
    made.append(m.id)
    return client.machines.wait_until_ready(m.id, timeout=120)


def test_a_machine_runs_an_image_without_python_and_forks(client, images, made) -> None:  # type: ignore[no-untyped-def]
    m = _new(client, made, "img-tiny", image="it/tiny:v1")
    assert m.image is not None and m.image.name == "it/tiny:v1"
    assert m.image.digest == images["tiny"]
    # A program only the image has, found on the image's PATH, in its WORKDIR, with
    # its ENV; the agent runs though the image has no Python.
    r = client.machines.exec(m.id, ["hello-image"])
    assert (r.exit_code, r.stdout) == (0, "hello from the image: hi in /srv/app\n")
    assert client.machines.exec(m.id, "cat data.txt").stdout == "image data\n"
    assert client.machines.exec(m.id, ["/bin/busybox", "test", "-e", "/usr/bin/python3"]
                                ).exit_code == 1
    # exec's own env and cwd win over the image's
    r = client.machines.exec(m.id, ["hello-image"], env={"GREETING": "yo"}, cwd="/tmp")
    assert r.stdout == "hello from the image: yo in /tmp\n"
    # writes go to the machine, not to the image
    client.machines.exec(m.id, "echo changed > /srv/app/data.txt")
    child = client.machines.fork(m.id, "img-tiny-child")
    made.append(child.id)
    child = client.machines.wait_until_ready(child.id, timeout=120)
    assert child.image is not None and child.image.digest == images["tiny"]
    assert client.machines.exec(child.id, ["hello-image"]).stdout == \
        "hello from the image: hi in /srv/app\n"
    assert client.machines.exec(child.id, "cat data.txt").stdout == "changed\n"
    client.machines.exec(child.id, "echo child > /srv/app/data.txt")
    assert client.machines.exec(m.id, "cat data.txt").stdout == "changed\n"
    # a second machine of the image starts from the image's files, not the first's
    other = _new(client, made, "img-tiny-2", image=images["tiny"])
    assert other.image is not None and other.image.name == "it/tiny:v1"
    assert client.machines.exec(other.id, "cat data.txt").stdout == "image data\n"


def test_the_agent_does_not_use_the_images_python(client, images, made) -> None:  # type: ignore[no-untyped-def]
    m = _new(client, made, "img-badpy", image="it/badpy:v1")
    r = client.machines.exec(m.id, "/usr/bin/python3; echo rc=$?")
    assert r.stdout == "image-python\nrc=99\n"
    # the agent's own work (files, checkpoints) goes on
    client.machines.files.upload(m.id, "/srv/app/up.txt", b"uploaded")
    assert client.machines.files.download(m.id, "/srv/app/up.txt") == b"uploaded"
    client.machines.checkpoints.save(m.id, "before")
    client.machines.exec(m.id, "echo after > /srv/app/up.txt")
    client.machines.checkpoints.restore(m.id, "before")
    assert client.machines.files.download(m.id, "/srv/app/up.txt") == b"uploaded"
    assert client.machines.exec(m.id, ["hello-image"]).exit_code == 0
    # a snapshot records the image; a machine from it runs on the same trees
    snap = client.snapshots.save(m.id, "img-badpy-snap")
    again = _new(client, made, "img-from-snap", from_snapshot=snap.name)
    assert again.image is not None and again.image.digest == images["badpy"]
    assert client.machines.files.download(again.id, "/srv/app/up.txt") == b"uploaded"
    assert client.machines.exec(again.id, ["hello-image"]).exit_code == 0
    client.machines.delete(again.id)
    client.snapshots.delete(snap.name)


def test_exec_runs_as_the_images_user(client, images, made) -> None:  # type: ignore[no-untyped-def]
    m = _new(client, made, "img-user", image="it/user:v1")
    r = client.machines.exec(m.id, "busybox id -u; busybox id -g; echo $HOME:$USER; pwd")
    assert r.stdout == "1000\n1000\n/home/app:app\n/srv/app\n"
    # exec's own user wins (by name or number)
    assert client.machines.exec(m.id, "busybox id -u", user="root").stdout == "0\n"
    assert client.machines.exec(m.id, "busybox id -u; busybox id -g", user="4242:7"
                                ).stdout == "4242\n7\n"
    with pytest.raises(errors.InvalidRequest, match="no user 'nobody-here'"):
        client.machines.exec(m.id, "true", user="nobody-here")
    # the agent itself stays root: files go in as it writes them
    client.machines.files.upload(m.id, "/srv/app/root-owned", b"x")
    assert client.machines.exec(m.id, "busybox stat -c %u /srv/app/root-owned").stdout == "0\n"


def test_an_image_that_is_not_imported_is_refused_on_either_engine(client, images, made) -> None:  # type: ignore[no-untyped-def]
    # (QEMU runs images too: tests/integration/test_image_machines_qemu.py)
    for engine in ("gvisor", "qemu"):
        with pytest.raises(errors.NotFound, match="boxd image import"):
            client.machines.new(f"img-none-{engine}", engine=engine, image="it/absent:v1")
    names = {m.name for m in client.machines.list()}
    assert not {"img-none-gvisor", "img-none-qemu"} & names, \
        "a refused machine leaves no record"
