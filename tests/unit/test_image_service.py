"""A container image's service (issue 41, item 3): ENTRYPOINT + CMD start as the
machine's service once it boots (``service=False`` / ``--no-start`` skips it), its output
is `machines.logs`, and its HEALTHCHECK (else its first EXPOSEd port) decides when
`wait_until_ready` returns.

On the fake engine (its guest runs ``cat`` as its only long-lived program, and no guest
network), with a real image store and SQLite; tests/integration/test_image_machines.py
runs real services on gVisor.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests._support.fake_world import ACCOUNT, World, make_world, run
from tests._support.oci import make_image, write_layout

from boxd import models
from boxd.errors import NotFound, StateError
from boxd.images.oci import import_image
from boxd.node._services import SERVICE_ID, health_argv, ready_port, service_argv
from boxd.state import RunImage
from boxd.storage.oci import ImageStore

IMAGES: dict[str, dict[str, Any]] = {
    "svc": {"Entrypoint": ["cat"], "Cmd": []},
    "bad": {"Cmd": ["/no/such/server", "--port", "8000"]},
    "healthy": {"Entrypoint": ["cat"], "Healthcheck": {"Test": ["CMD", "echo", "ok"]}},
    "sick": {"Entrypoint": ["cat"], "Healthcheck": {"Test": ["CMD", "cat", "/no such"]}},
    "exposed": {"Entrypoint": ["cat"], "ExposedPorts": {"8000/tcp": {}}},
    "plain": {},
}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = make_world(tmp_path, monkeypatch)
    store = ImageStore(w.paths.images_store)
    for name, config in IMAGES.items():
        layout = write_layout(tmp_path / f"layout-{name}",
                              {"v1": make_image([{"srv/x": b"x\n"}], config=config)})
        import_image(store, f"oci:{layout}:v1", f"{ACCOUNT}/{name}:v1")
    yield w
    w.repos.db.close()


def _new(w: World, image: str, timeout: float = 5, **kw: Any) -> models.Machine:
    async def go() -> models.Machine:
        m = await w.machines.create(ACCOUNT, models.MachineCreate(
            name=image, image=f"{image}:v1", **kw))
        return await w.machines.wait_until_ready(ACCOUNT, m.id, timeout=timeout)
    out = run(go())
    assert isinstance(out, models.Machine)
    return out


def _logs(w: World, ref: str) -> models.ServiceLog:
    out = run(w.machines.logs(ACCOUNT, ref, None, 0.0))
    assert isinstance(out, models.ServiceLog)
    return out


def test_the_images_entrypoint_runs_as_the_machines_service(world: World) -> None:
    m = _new(world, "svc")
    assert m.image is not None and m.image.service == ["cat"]
    procs = run(world.machines.processes(ACCOUNT, "svc"))
    assert [(p.id, p.argv, p.state) for p in procs] == [(SERVICE_ID, ["cat"], "running")]  # type: ignore[attr-defined]
    log = _logs(world, "svc")
    assert (log.state, log.argv, log.start, log.data) == ("running", ["cat"], 0, "")


def test_no_start_leaves_it_and_logs_say_there_is_no_service(world: World) -> None:
    m = _new(world, "svc", service=False)
    assert m.image is not None and m.image.service == []
    assert run(world.machines.processes(ACCOUNT, "svc")) == []
    with pytest.raises(NotFound, match="has no service"):
        _logs(world, "svc")
    _new(world, "plain")  # an image without ENTRYPOINT or CMD has none either
    with pytest.raises(NotFound, match="has no service"):
        _logs(world, "plain")


def test_a_service_that_cannot_start_is_an_exited_process_saying_why(world: World) -> None:
    _new(world, "bad")  # the machine runs; its service did not start
    log = _logs(world, "bad")
    assert log.state == "exited" and log.argv == ["/no/such/server", "--port", "8000"]
    assert "could not start" in log.data


def test_a_healthcheck_decides_readiness(world: World) -> None:
    assert _new(world, "healthy").state == models.MachineState.RUNNING
    with pytest.raises(StateError, match="HEALTHCHECK") as caught:
        _new(world, "sick", timeout=1.5)
    assert "boxd machine logs sick" in caught.value.hint


def test_without_a_healthcheck_the_first_exposed_port_decides(world: World) -> None:
    # The fake guest has no network: nothing ever accepts on 8000.
    with pytest.raises(StateError, match="EXPOSEd port 8000"):
        _new(world, "exposed", timeout=1.5)
    run(world.machines.delete(ACCOUNT, "exposed"))
    # without its service started, nothing decides but the agent's answer
    assert _new(world, "exposed", service=False).state == models.MachineState.RUNNING


def test_a_fork_keeps_the_service_description(world: World) -> None:
    _new(world, "svc")
    (child,) = run(world.machines.fork(ACCOUNT, "svc", ["svc-child"]))  # type: ignore[misc]
    assert isinstance(child, models.Machine)
    assert child.image is not None and child.image.service == ["cat"]
    procs = run(world.machines.processes(ACCOUNT, "svc-child"))
    assert [p.id for p in procs] == [SERVICE_ID]  # type: ignore[attr-defined]


# ------------------------------------------------------------------ the rules


def _run_image(**kw: Any) -> RunImage:
    return RunImage("x:v1", "sha256:" + "0" * 64, **kw)


def test_service_argv_is_entrypoint_then_cmd() -> None:
    assert service_argv(_run_image(entrypoint=("python", "-m"), cmd=("srv",))) == [
        "python", "-m", "srv"]
    assert service_argv(_run_image(cmd=("srv",))) == ["srv"]
    assert service_argv(_run_image()) is None
    assert service_argv(_run_image(cmd=("srv",), service=False)) is None
    assert service_argv(None) is None


def test_healthcheck_forms_and_exposed_ports() -> None:
    assert health_argv(_run_image(healthcheck=("CMD", "curl", "-f", "x"))) == [
        "curl", "-f", "x"]
    assert health_argv(_run_image(healthcheck=("CMD-SHELL", "curl -f x || exit 1"))) == [
        "/bin/sh", "-c", "curl -f x || exit 1"]
    assert health_argv(_run_image(healthcheck=("NONE",))) is None
    assert health_argv(_run_image()) is None
    assert ready_port(_run_image(exposed_ports=("53/udp", "8000/tcp", "9000"))) == 8000
    assert ready_port(_run_image(exposed_ports=("53/udp",))) is None


def test_a_run_image_round_trips_and_an_old_record_has_no_service() -> None:
    full = _run_image(env=("A=1",), entrypoint=("e",), cmd=("c",), healthcheck=("NONE",),
                      exposed_ports=("80/tcp",), service=False)
    assert RunImage.from_json(full.to_json()) == full
    old = {"name": "x:v1", "digest": "sha256:" + "0" * 64, "env": [], "working_dir": "",
           "user": ""}
    assert RunImage.from_json(old) == _run_image()
