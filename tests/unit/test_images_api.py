"""``/v1/images`` through the real app and the SDK (sync and async), in process: import,
list, inspect, remove; each account sees only its own names; errors are typed."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, make_world
from tests._support.oci import make_image, sha, write_layout

from boxd import AsyncBoxd, Boxd, errors, models
from boxd.api.services.images import ImageService
from boxd.config import Paths
from boxd.images.oci import list_images, unpack_image
from boxd.storage.oci import ImageStore

paths = support.paths  # fixtures
no_daemon = support.no_daemon


@dataclass
class Api:
    app: object
    key: str
    other_key: str
    layout: Path
    store: Path
    operator_key: str
    service: ImageService
    account: str  # the id of `key`'s account (not the operator's)

    def seed(self, account: str, source: str, name: str) -> models.Image:
        """Import through the service, as an account whose route would refuse the
        source (a path): the service's per-account rules are what is tested."""
        return asyncio.run(self.service.import_(account, models.ImageImport(
            source=source, name=name)))


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_daemon: Paths) -> Iterator[Api]:
    w = make_world(tmp_path, monkeypatch)
    service = ImageService(tmp_path / "oci")
    app, keys = support.world_app(w, tmp_path, images=service)
    key = keys.create(ACCOUNT, "sdk").secret
    other = keys.create(w.repos.keys.add_account("other", 10), "sdk").secret
    local = w.repos.keys.account_id("local") or w.repos.keys.add_account("local", 10)
    operator = keys.create(local, "operator").secret
    img = make_image([{"bin/x": b"x"}], config={"Cmd": ["/bin/x"], "Env": ["A=1"]})
    layout = write_layout(tmp_path / "layout", {"v1": img})
    yield Api(app, key, other, layout, tmp_path / "oci", operator, service, ACCOUNT)
    w.repos.db.close()


def _client(api: Api, key: str) -> Boxd:
    return Boxd(api_key=key, transport=support.SyncASGITransport(api.app))  # type: ignore[arg-type]


def test_import_list_inspect_remove(api: Api) -> None:
    with _client(api, api.operator_key) as b:
        img = b.images.import_(f"oci:{api.layout}:v1", "envs/tool:v1")
        assert img.name == "envs/tool:v1" and img.config.cmd == ["/bin/x"]
        assert [i.name for i in b.images.list()] == ["envs/tool:v1"]
        assert b.images.get("envs/tool:v1").digest == img.digest
        with pytest.raises(errors.NotFound, match="no image named 'envs/tool:v2'"):
            b.images.get("envs/tool:v2")
        assert b.images.remove("envs/tool:v1").digest == img.digest
        assert b.images.list() == []
        with pytest.raises(errors.NotFound):
            b.images.remove("envs/tool:v1")


def test_accounts_see_only_their_own_images(api: Api) -> None:
    with _client(api, api.operator_key) as mine, _client(api, api.key) as theirs:
        mine.images.import_(f"oci:{api.layout}", "shared-name")
        assert theirs.images.list() == []
        with pytest.raises(errors.NotFound):
            theirs.images.get("shared-name")
        with pytest.raises(errors.NotFound):
            theirs.images.remove("shared-name")
        api.seed(api.account, f"oci:{api.layout}", "shared-name")
        assert [i.name for i in theirs.images.list()] == ["shared-name:latest"]
        theirs.images.remove("shared-name")
        assert [i.name for i in mine.images.list()] == ["shared-name:latest"]


def test_paths_and_private_registries_are_the_operators(api: Api) -> None:
    """An account other than the operator imports only from registries on public
    addresses: a path names a file of the daemon's host (its answer would tell whether
    it exists), and a registry on loopback or a private range is a service the daemon
    itself would connect to."""
    with _client(api, api.key) as b:
        for source in (f"oci:{api.layout}", "oci-archive:/etc/shadow",
                       "docker-archive:/root/x.tar"):
            with pytest.raises(errors.Forbidden, match="paths on the daemon's host"):
                b.images.import_(source, "x")
        for host in ("127.0.0.1:5000", "localhost:5000", "10.1.2.3", "[::1]:5000",
                     "169.254.169.254"):
            with pytest.raises(errors.Forbidden, match="loopback, private or reserved"):
                b.images.import_(f"docker://{host}/x:y", "x", insecure=True)
        with pytest.raises(errors.InvalidRequest, match="source: String should match pattern"):
            b.images.import_("ftp:x", "x")
        assert b.images.list() == []


def test_bad_input_is_a_typed_error(api: Api) -> None:
    with _client(api, api.operator_key) as b:
        with pytest.raises(errors.InvalidRequest, match="source: String should match pattern"):
            b.images.import_("ftp://x", "a")
        with pytest.raises(errors.InvalidRequest, match="name: String should match pattern"):
            b.images.import_(f"oci:{api.layout}", "Bad Name")
        with pytest.raises(errors.NotFound):
            b.images.import_(f"oci:{api.layout}:nope", "a")
        with pytest.raises(errors.InvalidRequest, match="cannot reach the registry"):
            # a closed loopback port: refused at once
            b.images.import_("docker://127.0.0.1:9/x:y", "a", insecure=True)
        assert b.images.list() == []


def test_async_client(api: Api) -> None:
    async def run() -> None:
        transport = httpx.ASGITransport(app=api.app)  # type: ignore[arg-type]
        async with AsyncBoxd(api_key=api.operator_key, transport=transport) as b:
            img = await b.images.import_(f"oci:{api.layout}", "a:b")  # the operator's key
            assert (await b.images.get("a:b")).digest == img.digest
            assert len(await b.images.list()) == 1
            await b.images.remove("a:b")

    asyncio.run(run())


def test_a_manifest_alone_claims_no_other_accounts_layer(api: Api, tmp_path: Path) -> None:
    """A layout (or a registry) that names another account's layer by digest without
    its bytes imports nothing: the store's copy counts only for its own account's
    images. The account that holds it re-imports without fetching it again."""
    secret = make_image([{"secret": b"another account's data"}])
    with _client(api, api.operator_key) as mine, _client(api, api.key) as theirs:
        mine.images.import_(f"oci:{write_layout(tmp_path / 'full', {'s': secret})}", "s")
        bare = write_layout(tmp_path / "bare", {"s": secret})
        (bare / "blobs" / "sha256" / sha(secret.layers[0])[7:]).unlink()
        with pytest.raises(errors.CorruptData, match="lacks blobs/sha256"):
            api.seed(api.account, f"oci:{bare}", "stolen")
        assert theirs.images.list() == []
        # Its owner holds the layer: the same manifest without the bytes is enough.
        assert mine.images.import_(f"oci:{bare}", "again").digest == secret.digest


@pytest.mark.skipif(shutil.which("buildah") is None or not Path("/bin/busybox").exists()
                    or os.geteuid() != 0,
                    reason="needs root, buildah and busybox-static (scripts/setup-host.sh "
                           "server,dev installs them); test_image_build.py covers the "
                           "Dockerfile check without them")
def test_build_through_the_sdk(api: Api, tmp_path: Path) -> None:
    bb = Path("/bin/busybox").read_bytes()
    base = make_image([{f"bin/{n}": bb for n in ("busybox", "sh")}], config={"Env": ["PATH=/bin"]})
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text('FROM base\nARG V=1\nRUN echo "$V" > /v\nCOPY . /src/\n'
                                    'WORKDIR /src\nCMD ["/bin/sh"]\n')
    (ctx / "keep").write_text("k")
    (ctx / "secret.key").write_text("s")
    (ctx / ".dockerignore").write_text("*.key\n")
    with _client(api, api.operator_key) as b, _client(api, api.key) as theirs:
        b.images.import_(f"oci:{write_layout(tmp_path / 'base', {'b': base})}", "base")
        img = b.images.build(ctx, "app:v1", build_args={"V": "7"})
        assert img.name == "app:v1" and img.config.working_dir == "/src"
        assert [i.name for i in b.images.list()] == ["app:v1", "base:latest"]
        with pytest.raises(errors.InvalidRequest, match="line 2: ONBUILD"):
            (ctx / "Dockerfile").write_text("FROM base\nONBUILD RUN x\n")
            b.images.build(ctx, "app:v2")
        # RUN steps run on the daemon's host: no other account may start a build.
        (ctx / "Dockerfile").write_text("FROM base\n")
        with pytest.raises(errors.Forbidden, match="only the operator"):
            theirs.images.build(ctx, "app:v1")
    store = ImageStore(api.store)
    info = next(i for i in list_images(store) if i.name.endswith("/app:v1"))
    root = unpack_image(store, info, tmp_path / "roots")
    assert (root / "v").read_text() == "7\n"
    assert sorted(p.name for p in (root / "src").iterdir()) == [".dockerignore", "Dockerfile",
                                                               "keep"]


def test_import_with_progress_streams_then_answers(api: Api, tmp_path: Path) -> None:
    big = make_image([{"big": os.urandom(3 << 20)}, {"small": b"s"}])
    layout = write_layout(tmp_path / "big", {"b": big})
    seen: list[tuple[str, float | None]] = []
    with _client(api, api.operator_key) as b:
        img = b.images.import_(f"oci:{layout}", "big:v1",
                               progress=lambda step, f: seen.append((step, f)))
        assert img.digest == big.digest
        fractions = [f for _, f in seen if f is not None]
        assert any(s.startswith("layer 1/2") for s, _ in seen)
        assert fractions == sorted(fractions) and 0 < fractions[-1] <= 1.0
        # The same import again: its layers are stored, and it says so.
        seen.clear()
        b.images.import_(f"oci:{layout}", "big:v2", progress=lambda s, f: seen.append((s, f)))
        assert any("(stored)" in s for s, _ in seen)
        # An error arrives as the stream's last line and is raised typed.
        with pytest.raises(errors.NotFound):
            b.images.import_(f"oci:{tmp_path / 'none'}", "x", progress=lambda s, f: None)
