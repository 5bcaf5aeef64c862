"""Where users meet images (issue 41 item 5), on real gVisor machines of one daemon of
its own that serves E2B too:

- OpenEnv: the example env's Dockerfile (``examples/openenv/Dockerfile``: a builder
  stage installing openenv-core into a venv, a runtime stage serving openenv-core's
  ``create_app`` app with uvicorn on port 8000, a HEALTHCHECK) is built with ``boxd
  image build``; unmodified openenv-core clients call ``from_docker_image(IMAGE,
  provider=BoxdProvider(client))``: every session is a fork of one baseline machine
  started from the image;
- E2B: the unmodified ``e2b`` SDK creates a sandbox whose template names a busybox
  image; its commands run in the image;
- ``boxd.rl.VectorEnv(..., image=)`` steps CartPole in forks of a machine of an image
  built FROM the same Python base with gymnasium installed.

Offline: the Python base is boxd's own guest root as an OCI layout
(`tests._support.py_image`), imported under the name the Dockerfile's FROM uses; the
builds install wheels the host downloaded (its pip configuration) from their context,
with ``--no-index``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd import Boxd, errors
from tests._support.bench import load_path as _load
from tests._support.daemon import REPO, Daemon
from tests._support.e2b import e2b_daemon
from tests._support.oci import make_image, write_layout
from tests._support.py_image import python_base_layout
from tests._support.rl_guest import _host_wheels
from tests.integration.test_image_machines import _busybox

pytestmark = pytest.mark.vm

EXAMPLES = REPO / "examples" / "openenv"
OPENENV_WHEELS = REPO / ".cache" / "wheels-openenv"
IMAGE = "openenv-counter:v1"


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[Boxd]:
    """A client of a gVisor daemon of its own (E2B's variables set for its listener),
    with the Python base imported as ``python:3.11-slim``."""
    with e2b_daemon(daemon, "imgenvs") as _, Boxd() as b:
        b.images.import_(f"oci:{python_base_layout()}", "python:3.11-slim")
        yield b


@pytest.fixture
def made(client: Boxd) -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for ref in ids:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(ref)


def _machines(client: Boxd) -> set[str]:
    return {m.id for m in client.machines.list()}


def test_openenv_from_docker_image_serves_sessions_from_a_built_image(
        client: Boxd, made: list[str], tmp_path: Path) -> None:
    pytest.importorskip("openenv.core.containers.runtime",
                        reason="openenv-core is not installed (pip install 'boxd[openenv]')")
    recipe = _load(EXAMPLES / "serve_sessions.py")
    try:
        wheels = recipe.download_wheels(OPENENV_WHEELS)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"host cannot download the openenv wheels: {(exc.stderr or '')[-500:]}")
    assert wheels
    example = _load(EXAMPLES / "serve_image.py")
    counter = _load(EXAMPLES / "counter_env.py")
    image = example.build(client, IMAGE, example.build_context(tmp_path / "ctx",
                                                               OPENENV_WHEELS))
    assert image.config.exposed_ports == ["8000/tcp"] and image.config.healthcheck
    assert image.config.cmd[0] == "uvicorn"
    before = _machines(client)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two sessions at once
        results = list(pool.map(lambda i: example.session(client, counter, IMAGE, i),
                                range(2)))
    (first0, counts0, base0), (first1, counts1, base1) = results
    assert base0 is not None and base0 == base1  # one baseline, made by one of them
    made.append(base0)
    baseline = client.machines.get(base0)
    assert baseline.image is not None and baseline.image.digest == image.digest
    # the same server process in both forks (its nonce is drawn at start) ...
    assert first0 == first1 and first0.count == 0
    # ... each session its own steps
    assert counts0 == [1, 2, 3] and counts1 == [2, 4, 6]
    assert _machines(client) == before | {base0}  # the sessions' forks went at close
    # a later session forks the same baseline, warm: the same first observation
    first2, _, base2 = example.session(client, counter, IMAGE, 0)
    assert base2 == base0 and first2 == first0


BASH = b"#!/bin/busybox sh\nexec /bin/busybox sh \"$@\"\n"


def test_an_e2b_template_may_name_an_image(client: Boxd, tmp_path: Path) -> None:
    """The e2b SDK runs commands as ``/bin/bash -l -c CMD``: the image's /bin/bash is
    busybox's shell behind a two-line script (busybox has no bash applet)."""
    e2b = pytest.importorskip("e2b", reason="the dev extra installs the e2b SDK")
    bb = _busybox()
    files = {f"bin/{n}": bb for n in ("busybox", "sh", "mkdir", "cat", "ls")}
    img = make_image([{**files, "bin/bash": BASH,
                       "etc/image-marker": b"an image's own file\n"}],
                     config={"Env": ["PATH=/bin", "FROM_IMAGE=yes"]})
    write_layout(tmp_path / "layout", {"v1": img})
    client.images.import_(f"oci:{tmp_path / 'layout'}:v1", "e2b/busybox:v1")
    sbx = e2b.Sandbox.create(template="e2b/busybox:v1", timeout=300)
    try:
        assert sbx.get_info().template_id == "e2b/busybox:v1"
        r = sbx.commands.run("cat /etc/image-marker; echo $FROM_IMAGE; pwd; "
                             "ls /usr/bin | wc -l")
        assert r.exit_code == 0, r
        marker, env, cwd, usr_bin = r.stdout.splitlines()
        assert (marker, env, cwd) == ("an image's own file", "yes", "/home/user")
        assert usr_bin.strip() == "0"  # not boxd's Debian: the image has no /usr/bin
        sbx.files.write("/home/user/note.txt", "written through envd")
        assert sbx.files.read("/home/user/note.txt") == "written through envd"
        machine = client.machines.get(sbx.sandbox_id)
        assert machine.image is not None and machine.image.name == "e2b/busybox:v1"
    finally:
        sbx.kill()
    with pytest.raises(e2b.exceptions.SandboxException, match="no snapshot and no image"):
        e2b.Sandbox.create(template="e2b/none:v1", timeout=60)
    # `boxd e2b warm` of the image's name: its creates fork one machine of the image
    warm = subprocess.run([sys.executable, "-m", "boxd", "e2b", "warm", "e2b/busybox:v1",
                           "--forks", "1", "--json"], capture_output=True, text=True,
                          check=True, env=dict(os.environ))
    source = json.loads(warm.stdout)["machine"]
    try:
        assert client.machines.get(source).image is not None
        sbx = e2b.Sandbox.create(template="e2b/busybox:v1", timeout=300)
        try:
            assert client.machines.get(sbx.sandbox_id).parent_id == source
            assert sbx.commands.run("cat /etc/image-marker").stdout == "an image's own file\n"
        finally:
            sbx.kill()
    finally:
        client.machines.delete(source)
    bad = subprocess.run([sys.executable, "-m", "boxd", "e2b", "warm", "e2b/none:v1"],
                         capture_output=True, text=True, env=dict(os.environ))
    assert bad.returncode == 1 and "no snapshot and no image" in bad.stderr, bad


RL_DOCKERFILE = """\
FROM python:3.11-slim
COPY wheels/ /wheels/
RUN python3 -m pip install --no-index --find-links /wheels gymnasium numpy cloudpickle \\
    && rm -rf /wheels
"""


def test_a_vector_env_from_an_image(client: Boxd, tmp_path: Path) -> None:
    gym = pytest.importorskip("gymnasium")
    from boxd.rl import VectorEnv

    ctx = tmp_path / "ctx"
    (ctx / "wheels").mkdir(parents=True)
    for whl in _host_wheels():
        shutil.copy2(whl, ctx / "wheels" / whl.name)
    (ctx / "Dockerfile").write_text(RL_DOCKERFILE)
    image = client.images.build(ctx, "rl/cartpole:v1")
    before = _machines(client)
    env = VectorEnv("CartPole-v1", 2, image="rl/cartpole:v1", boxd=client)
    try:
        for m in env.machines:
            got = client.machines.get(m or "")
            assert got.image is not None and got.image.digest == image.digest
        obs, _ = env.reset(seed=7)
        local = [gym.make("CartPole-v1").reset(seed=7 + i)[0] for i in range(2)]
        assert obs.tolist() == [o.tolist() for o in local]
        obs, rewards, _, _, _ = env.step([0, 1])
        assert rewards.tolist() == [1.0, 1.0]
    finally:
        env.close()
    assert _machines(client) == before  # the baseline and the forks went at close
