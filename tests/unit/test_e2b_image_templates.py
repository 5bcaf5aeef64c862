"""An E2B template may name a boxd image (issue 41 item 5): ``POST /v2/sandboxes`` with
``templateID`` ``NAME[:TAG]`` of one of the account's images starts the sandbox's machine
from that image, when no snapshot has that name; a template that is neither is a 404
naming both. Over the real control plane and image store on the fake engine
(tests/integration/test_image_envs.py runs the e2b SDK against a real gVisor machine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from tests._support.fake_world import ACCOUNT, World, make_world, run
from tests._support.oci import make_image, write_layout

from boxd.e2b.app import create_e2b_app
from boxd.e2b.env import to_e2b_key
from boxd.errors import AuthError
from boxd.images.oci import import_image
from boxd.storage.oci import ImageStore

KEY = {"X-API-KEY": to_e2b_key("boxd_key")}


def _authenticate(secret: str | None) -> str:
    if secret != "boxd_key":
        raise AuthError("unknown API key")
    return ACCOUNT


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = make_world(tmp_path, monkeypatch)
    img = make_image([{"etc/marker": b"from the image\n"}], config={"Env": ["A=1"]})
    layout = write_layout(tmp_path / "layout", {"v1": img})
    import_image(ImageStore(w.paths.images_store), f"oci:{layout}:v1",
                 f"{ACCOUNT}/envs/tool:v1")
    yield w
    w.repos.db.close()


@pytest.fixture
def client(world: World, tmp_path: Path) -> Iterator[TestClient]:
    app = create_e2b_app(world.machines, _authenticate, tmp_path / "e2b", world.snapshots)
    with TestClient(app) as c:
        yield c


def test_a_template_naming_an_image_starts_the_sandbox_from_it(
        world: World, client: TestClient) -> None:
    r = client.post("/v2/sandboxes", json={"templateID": "envs/tool:v1"}, headers=KEY)
    assert r.status_code == 201, r.text
    sb = r.json()
    assert sb["templateID"] == "envs/tool:v1"
    machine = run(world.machines.get(ACCOUNT, sb["sandboxID"]))
    digest = ImageStore(world.paths.images_store).refs()[f"{ACCOUNT}/envs/tool:v1"].digest
    assert machine.image is not None  # type: ignore[attr-defined]
    assert (machine.image.name, machine.image.digest) == (  # type: ignore[attr-defined]
        "envs/tool:v1", digest)
    # the base template is still boxd's default image
    base = client.post("/v2/sandboxes", json={}, headers=KEY).json()
    assert run(world.machines.get(ACCOUNT, base["sandboxID"])).image is None  # type: ignore[attr-defined]


def test_a_snapshot_of_the_name_wins_and_an_unknown_template_is_a_404(
        world: World, client: TestClient, tmp_path: Path) -> None:
    layout = write_layout(tmp_path / "layout2", {"v1": make_image([{"x": b"x"}])})
    import_image(ImageStore(world.paths.images_store), f"oci:{layout}:v1", f"{ACCOUNT}/tool")
    source = client.post("/v2/sandboxes", json={}, headers=KEY).json()["sandboxID"]
    run(world.snapshots.save(ACCOUNT, source, "tool"))
    r = client.post("/v2/sandboxes", json={"templateID": "tool"}, headers=KEY)
    assert r.status_code == 201, r.text
    made = run(world.machines.get(ACCOUNT, r.json()["sandboxID"]))
    assert made.snapshot and made.image is None  # type: ignore[attr-defined]
    before = {m.name for m in run(world.machines.list(ACCOUNT))}  # type: ignore[attr-defined]
    r = client.post("/v2/sandboxes", json={"templateID": "envs/none:v1"}, headers=KEY)
    assert r.status_code == 404
    assert "no snapshot and no image" in r.json()["message"]
    after = {m.name for m in run(world.machines.list(ACCOUNT))}  # type: ignore[attr-defined]
    assert after == before  # nothing was left of the refused create
