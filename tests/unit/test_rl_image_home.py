"""``boxd.rl`` from an image (issue 41 item 5): ``VectorEnv(..., image=NAME)`` (and
``Env``, ``sb3.VecEnv``) fork a baseline machine started from the boxd image instead of
a machine the user prepared; the baseline carries the run's labels and goes at close.

The SDK talks in process to the real app, control plane, image store and SQLite over the
fake engine (no env server runs here: tests/integration/test_image_envs.py steps a
real VectorEnv in a gVisor machine of a built image).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World
from tests._support.oci import make_image, write_layout

from boxd import Boxd, errors
from boxd.api.services.images import ImageService
from boxd.images.oci import import_image
from boxd.rl import VectorEnv
from boxd.rl._cleanup import RUN_LABEL
from boxd.rl._env import resolve_home
from boxd.rl._machines import MachineHome
from boxd.storage.oci import ImageStore

paths = support.paths  # fixtures
no_daemon = support.no_daemon
world = support.world


@pytest.fixture
def boxd(world: World, tmp_path: Path) -> Iterator[Boxd]:
    layout = write_layout(tmp_path / "layout", {"v1": make_image([{"srv/x": b"x"}])})
    import_image(ImageStore(world.paths.images_store), f"oci:{layout}:v1",
                 f"{ACCOUNT}/envs/tiny:v1")
    app, keys = support.world_app(world, tmp_path,
                                  images=ImageService(world.paths.images_store))
    with Boxd(api_key=keys.create(ACCOUNT, "sdk").secret,
              transport=support.SyncASGITransport(app)) as b:
        yield b


def test_an_image_home_forks_a_baseline_of_the_image_that_close_deletes(boxd: Boxd) -> None:
    home = resolve_home(None, boxd, image="envs/tiny:v1")
    assert isinstance(home, MachineHome)
    base = boxd.machines.get(home.source)
    assert base.image is not None and base.image.name == "envs/tiny:v1"
    assert base.labels[RUN_LABEL] == home.labels[RUN_LABEL]
    assert base.state == "running"
    home.close()
    assert boxd.machines.list() == []


def test_source_or_image_and_an_unknown_image_leaves_nothing(boxd: Boxd) -> None:
    boxd.machines.new("base")
    with pytest.raises(errors.InvalidRequest, match="not both"):
        resolve_home("base", boxd, image="envs/tiny:v1")
    with pytest.raises(errors.InvalidRequest, match="image="):
        resolve_home(None, boxd)
    with pytest.raises(errors.InvalidRequest, match="image="):
        VectorEnv("CartPole-v1", 2, boxd=boxd)
    with pytest.raises(errors.NotFound, match="no image 'envs/none:v1'"):
        VectorEnv("CartPole-v1", 2, image="envs/none:v1", boxd=boxd)
    assert [m.name for m in boxd.machines.list()] == ["base"]
