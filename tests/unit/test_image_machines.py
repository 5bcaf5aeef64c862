"""Machines of an imported container image (`MachineCreate.image`): the control plane
resolves the account's image, the node unpacks it once and boots on its tree, exec
defaults to the image's ENV, WORKDIR and USER; on the fake engine, with a real image store and
SQLite. The gVisor spec such a machine gets (the guest root's Python, mounted beside the
image) is checked here too; tests/integration/test_image_machines.py runs it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._support.fake_world import ACCOUNT, World, make_world, run
from tests._support.oci import make_image, write_layout

from boxd import models
from boxd.engine.gvisor import _spec
from boxd.engine.gvisor._spec import RUNTIME_MOUNT, Roots
from boxd.errors import HostSetupError, InvalidRequest, NotFound
from boxd.images.oci import import_image
from boxd.storage.oci import ImageStore

CONFIG = {"Env": ["PATH=/usr/local/bin:/bin", "GREETING=hi"], "WorkingDir": "/srv/app",
          "User": "app"}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = make_world(tmp_path, monkeypatch)
    img = make_image([{"srv/app/data.txt": b"image data\n"}], config=CONFIG)
    layout = write_layout(tmp_path / "layout", {"v1": img})
    import_image(ImageStore(w.paths.images_store), f"oci:{layout}:v1",
                 f"{ACCOUNT}/envs/tiny:v1")
    yield w
    w.repos.db.close()


def _new(w: World, **kw: object) -> models.Machine:
    async def go() -> models.Machine:
        m = await w.machines.create(ACCOUNT, models.MachineCreate(**kw))  # type: ignore[arg-type]
        return await w.machines.wait_until_ready(ACCOUNT, m.id, timeout=5)
    out = run(go())
    assert isinstance(out, models.Machine)
    return out


def _exec(w: World, ref: str, cmd: str, **kw: object) -> str:
    req = models.ExecRequest(command=cmd, **kw)  # type: ignore[arg-type]
    return run(w.machines.exec(ACCOUNT, ref, req)).stdout  # type: ignore[attr-defined, no-any-return]


def test_a_machine_boots_on_the_images_tree_and_exec_defaults_to_its_config(
    world: World,
) -> None:
    m = _new(world, name="img", image="envs/tiny:v1")
    digest = ImageStore(world.paths.images_store).refs()[f"{ACCOUNT}/envs/tiny:v1"].digest
    assert m.image == models.MachineImage(name="envs/tiny:v1", digest=digest)
    # its disk's base is the image's tree, unpacked under <data dir>/oci-roots
    rec = world.repos.machines.get(m.id)
    assert rec is not None and rec.layer_id is not None
    backing = Path(json.loads(world.node.launcher.layer_path(rec.layer_id).read_text())
                   ["backing"])
    assert backing == (world.paths.image_roots / digest.split(":", 1)[1]).resolve()
    assert (backing / "srv/app/data.txt").read_bytes() == b"image data\n"
    assert _exec(world, "img", "env") == "GREETING=hi\nPATH=/usr/local/bin:/bin\n"
    assert _exec(world, "img", "pwd") == "/srv/app\n"
    # exec's own env and cwd win
    assert _exec(world, "img", "env", env={"GREETING": "yo", "X": "1"}) == \
        "GREETING=yo\nPATH=/usr/local/bin:/bin\nX=1\n"
    assert _exec(world, "img", "pwd", cwd="/tmp") == "/tmp\n"
    assert _exec(world, "img", "whoami") == "app\n"  # the image's USER
    assert _exec(world, "img", "whoami", user="0:0") == "0:0\n"  # exec's own wins
    # a fork keeps the image (and its defaults); a second machine by digest shares the tree
    (child,) = run(world.machines.fork(ACCOUNT, "img", ["img-child"]))  # type: ignore[misc]
    assert isinstance(child, models.Machine) and child.image == m.image
    assert _exec(world, "img-child", "pwd") == "/srv/app\n"
    other = _new(world, name="img2", image=digest)
    assert other.image == m.image
    assert set(os.listdir(world.paths.image_roots)) == {
        "chains", digest.split(":", 1)[1], ".gc-lock"}  # the collection's lock (empty)
    assert len(os.listdir(world.paths.image_roots / "chains")) == 1  # one layer: one tree
    # a machine of the default image keeps the agent's own defaults
    plain = _new(world, name="plain")
    assert plain.image is None
    assert _exec(world, "plain", "env") == "" and _exec(world, "plain", "pwd") == "/home/boxd\n"
    assert _exec(world, "plain", "whoami") == "root\n"


def test_an_image_the_account_lacks_is_not_found_and_leaves_no_machine(world: World) -> None:
    with pytest.raises(NotFound, match="boxd image import"):
        _new(world, name="x", image="envs/absent:v1")
    # another account's image is not this one's
    with pytest.raises(NotFound, match="boxd image import"):
        run(world.machines.create("a_other", models.MachineCreate(name="y",
                                                                  image="envs/tiny:v1")))
    with pytest.raises(InvalidRequest, match="not both"):
        _new(world, name="z", image="envs/tiny:v1", from_snapshot="snap")
    assert world.repos.machines.list(ACCOUNT) == []


def test_an_engine_without_image_roots_refuses_with_a_typed_error(world: World) -> None:
    world.engine.roots_from_images = False  # an engine that boots no image's root
    with pytest.raises(InvalidRequest, match="engine cannot run container images"):
        _new(world, name="q", image="envs/tiny:v1")
    assert world.repos.machines.list(ACCOUNT) == []
    assert not world.paths.image_roots.exists(), "nothing unpacked for a refused machine"


# ------------------------------------------------------------------ the gVisor spec


def _runtime(tmp: Path, link: str = "/usr/bin/python3.11") -> Path:
    rt = tmp / "rootfs.tree"
    (rt / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (rt / "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2").write_bytes(b"\x7fELF")
    (rt / "usr/bin").mkdir(parents=True)
    (rt / "usr/bin/python3.11").write_bytes(b"\x7fELF")
    (rt / "usr/bin/python3").symlink_to(link)  # absolute: inside the tree, not the host's
    return rt


def _agent(tmp: Path, native: bool) -> Path:
    agent = tmp / "agent-x"
    agent.mkdir()
    if native:
        (agent / "boxd-init").write_bytes(b"\x7fELF")
    return agent


@pytest.mark.parametrize("link", ["/usr/bin/python3.11", "python3.11"])
def test_the_agent_runs_on_the_guest_roots_python_through_its_loader(
    tmp_path: Path, link: str,
) -> None:
    rt = _runtime(tmp_path, link)
    loader = f"{RUNTIME_MOUNT}/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    python = [loader, "--library-path", f"{RUNTIME_MOUNT}/usr/lib/x86_64-linux-gnu",
              f"{RUNTIME_MOUNT}/usr/bin/python3.11", "-E", "-s"]
    assert _spec.runtime_python(rt) == python
    roots = Roots(tmp_path / "image", _agent(tmp_path, native=True), rt)
    spec = _spec.build("m1", roots, 256)
    args = spec["process"]["args"]
    assert args[args.index("--python") + 1] == loader
    assert [args[i + 1] for i, a in enumerate(args) if a == "--python-arg"] == python[1:]
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert mounts[RUNTIME_MOUNT]["source"] == str(rt)
    assert "ro" in mounts[RUNTIME_MOUNT]["options"]
    assert spec["root"]["path"] == str(tmp_path / "image")


def test_without_boxd_init_agent_py_is_pid_1_on_the_runtimes_python(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    args = _spec.process_args(_agent(tmp_path, native=False), 256, rt)
    assert args[:6] == _spec.runtime_python(rt)
    assert args[6:] == ["-u", "/opt/boxd/agent.py", "--stdio", "--host-clock"]


def test_a_default_machines_spec_is_unchanged(tmp_path: Path) -> None:
    # A restore of a sandbox checkpointed before images existed gets the same PID 1.
    agent = _agent(tmp_path, native=True)
    assert _spec.process_args(agent, 256) == [
        "/opt/boxd/boxd-init", "--stdio", "--host-clock", "--memory-mib", "256",
        "--python", "/usr/bin/python3", "--agent", "/opt/boxd/agent.py", "--",
        "--host-clock"]
    spec = _spec.build("m1", Roots(tmp_path / "root", agent), 256)
    assert RUNTIME_MOUNT not in {m["destination"] for m in spec["mounts"]}


def test_roots_keep_the_runtime_through_json_and_read_the_old_form(tmp_path: Path) -> None:
    roots = Roots(tmp_path / "img", tmp_path / "agent", tmp_path / "rt")
    assert Roots.from_json(json.loads(json.dumps(roots.to_json()))) == roots
    old = {"rootfs": str(tmp_path / "r"), "agent": str(tmp_path / "a")}
    assert Roots.from_json(old) == Roots(tmp_path / "r", tmp_path / "a")
    assert "runtime" not in Roots(tmp_path / "r", tmp_path / "a").to_json()


def test_a_guest_root_without_python_is_a_host_setup_error(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    (rt / "usr/bin/python3.11").unlink()
    with pytest.raises(HostSetupError, match="no dynamic loader or no usr/bin/python3"):
        _spec.runtime_python(rt)


def test_machine_info_shows_the_image(capsys: pytest.CaptureFixture[str]) -> None:
    from boxd.cli import _render

    m = models.Machine(id="m_1", name="a", state=models.MachineState.RUNNING, vcpus=1,
                       memory_mib=256, disk_gib=1, isolated=False, created_at=0,
                       image=models.MachineImage(name="envs/app:v1",
                                                 digest="sha256:" + "ab" * 32))
    _render.machine(m)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("image"))
    assert "envs/app:v1" in line and "abab" in line
    _render.machine(m.model_copy(update={"image": None}))
    assert next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("image")).split() == ["image", "-"]
