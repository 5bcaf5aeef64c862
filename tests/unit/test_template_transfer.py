"""A fork template moving from one node runtime to another (the cross-node fork of a
cluster, `Offers.offer_template` → `Templates.receive` → `Forks.fork_received`), on the
fake engine: two node runtimes with their own data directories, the receiving one
fetching chunks straight from the other (on Ray, `NodeActor.read_chunk` does it). The
real engines' transfer runs in tests/integration/test_cluster.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tests._support.fake_world import ACCOUNT, World, make_world, running, sh

from boxd import models
from boxd.errors import InvalidRequest, NotFound
from boxd.node._transfer import Fetch, FileOffer
from boxd.state import RunImage


def _fetch_from(world: World, counter: list[str]) -> Fetch:
    async def fetch(f: FileOffer, offset: int, length: int) -> bytes:
        counter.append(f.kind)
        return await world.node.read_chunk(f.kind, f.key, offset, length)
    return fetch


def _two_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[World, World]:
    a = make_world(tmp_path / "a", monkeypatch)
    b = make_world(tmp_path / "b", monkeypatch)
    a.paths.ensure()  # BOXD_SHM is b's now: both nodes' tmpfs directories in one place
    return a, b


def _claim(w: World, names: list[str], src_id: str,
           run_image: RunImage | None = None) -> list[str]:
    return [w.repos.machines.claim(
        ACCOUNT, n, machine_id=f"m_{n}", vcpus=1, memory_mib=256, disk_gib=1,
        isolated=True, image="img1", node_id=w.node.id, engine="fake", parent_id=src_id,
        default_quota=100, run_image=run_image).id for n in names]


def test_a_template_of_any_portable_engine_moves_and_is_kept_while_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before issue 39: the sending node refused every engine but QEMU by its name.
    a, b = _two_nodes(tmp_path, monkeypatch)

    async def main() -> None:
        src = await running(a)
        await sh(a, src.id, "write /root/state before-the-fork")
        fetched: list[str] = []
        offer = await a.node.offer_template(src.id)
        tpl = await b.node.receive_template(offer, _fetch_from(a, fetched))
        assert {"mem", "state", "layer"} <= set(fetched)
        assert "retarget_disk" in b.engine.calls and "receive_image" in b.engine.calls
        rec = a.repos.machines.get(src.id)
        assert rec is not None
        ids = _claim(b, ["k1", "k2"], src.id)
        assert await b.node.fork_received(rec, tpl, ids) == [None, None]
        b.node.unpin_template(tpl.id)  # the receive pinned it for the children's start
        assert b.node.templates.refs.holders(tpl.id) == {f"received:{src.id}": 1}
        for cid in ids:
            out = await b.node.exec(cid, models.ExecRequest(command="cat /root/state"))
            assert out.stdout == "before-the-fork"
        # the source unchanged: the same offer, and nothing crosses again
        fetched.clear()
        again = await b.node.receive_template(await a.node.offer_template(src.id),
                                              _fetch_from(a, fetched))
        assert again.id == tpl.id and fetched == []
        b.node.unpin_template(again.id)
        # the source deleted on its node: the receiver lets the template go, once the
        # children that map it are gone too (before: kept until the node restarted)
        assert b.node.templates.drop_received(src.id)
        assert (b.paths.templates / tpl.id).exists()  # k1 and k2 map it
        for cid in ids:
            await b.node.delete(cid)
        assert not (b.paths.templates / tpl.id).exists()
        assert b.repos.layers.template(tpl.id) is None
        assert not b.node.templates.drop_received(src.id)  # said twice: nothing kept

    asyncio.run(main())


def test_a_template_whose_engine_cannot_move_it_is_refused_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _two_nodes(tmp_path, monkeypatch)
    b.engine.portable = False

    async def main() -> None:
        src = await running(a)
        offer = await a.node.offer_template(src.id)
        fetched: list[str] = []
        with pytest.raises(InvalidRequest, match="fake engine's templates cannot move"):
            await b.node.receive_template(offer, _fetch_from(a, fetched))
        assert fetched == []
        assert not b.paths.templates.exists() or not any(b.paths.templates.iterdir())

    asyncio.run(main())


def test_a_root_each_node_makes_of_an_image_goes_along_once_and_comes_back_as_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 41: QEMU packs an image's tree into disks each node makes its own way, and
    # a machine's frozen layers sit on them block by block, so an image machine's forks
    # stayed on its node. The sender's root files now go with the template, named by
    # their bytes: a receiver fetches each once, and the node that made one uses its own.
    a, b = _two_nodes(tmp_path, monkeypatch)
    a.engine.made_roots, b.engine.made_roots = tmp_path / "a-roots", tmp_path / "b-roots"
    layout, digest = _image_layout(tmp_path)
    _import(a, layout)
    _import(b, layout)
    hexd = digest.split(":", 1)[1]

    async def main() -> None:
        src = await _image_source(a, "one")
        offer = await a.node.offer_template(src.id)
        (root,) = offer.roots
        own_a = tmp_path / "a-roots" / f"{(a.paths.image_roots / hexd).resolve().name}.root"
        assert root.kind == "root" and root.key.endswith("." + own_a.read_text())
        fetched: list[str] = []
        tpl = await b.node.receive_template(offer, _fetch_from(a, fetched))
        assert fetched.count("root") == 1
        base = b.repos.layers.chain(tpl.layer_id)[-1]
        assert _backing(b, base.id) == tmp_path / "b-roots" / root.key  # a's bytes, kept here
        assert base.base == str(tmp_path / "b-roots" / root.key)  # a collapse goes down to it
        rec = a.repos.machines.get(src.id)
        assert rec is not None
        (kid,) = _claim(b, ["k1"], src.id, rec.run_image)
        assert await b.node.fork_received(rec, tpl, [kid]) == [None]
        b.node.unpin_template(tpl.id)
        out = await b.node.exec(kid, models.ExecRequest(command="cat /root/state"))
        assert out.stdout == "one"
        # the source changes: its next template crosses, its root does not again
        await sh(a, src.id, "write /root/state two")
        fetched.clear()
        tpl2 = await b.node.receive_template(await a.node.offer_template(src.id),
                                             _fetch_from(a, fetched))
        b.node.unpin_template(tpl2.id)
        assert "layer" in fetched and "root" not in fetched
        # the child forks back to the node that made the root: that node uses its own
        back = await b.node.offer_template(kid)
        assert [r.key for r in back.roots] == [root.key]
        fetched.clear()
        tpl3 = await a.node.receive_template(back, _fetch_from(b, fetched))
        assert "root" not in fetched
        assert _backing(a, a.repos.layers.chain(tpl3.layer_id)[-1].id) == own_a
        kid_rec = b.repos.machines.get(kid)
        assert kid_rec is not None
        (grand,) = _claim(a, ["g1"], kid, kid_rec.run_image)
        assert await a.node.fork_received(kid_rec, tpl3, [grand]) == [None]
        a.node.unpin_template(tpl3.id)
        out = await a.node.exec(grand, models.ExecRequest(command="cat /root/state"))
        assert out.stdout == "one"

    asyncio.run(main())


def test_an_offered_template_outlives_its_source_changing_until_the_peer_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the offer unpinned the template as soon as it was described, so a source
    # that changed (and a gc that followed) while a peer fetched it removed the files
    # under the peer: NotFound mid-transfer. The offer now holds the template (an
    # "offer" reference in `TemplateRefs`) until the peer says it is done.
    a, b = _two_nodes(tmp_path, monkeypatch)

    async def main() -> None:
        src = await running(a)
        await sh(a, src.id, "write /root/state first")
        offer = await a.node.offer_template(src.id)
        assert a.node.templates.refs.holders(offer.template_id) == {"offer": 1}
        await sh(a, src.id, "write /root/state second")  # the source changes ...
        await a.node.offer_template(src.id)  # ... a newer template is made
        a.node.templates.collect()  # and a gc runs before the peer fetched a byte
        tpl = await b.node.receive_template(offer, _fetch_from(a, []))
        rec = a.repos.machines.get(src.id)
        assert rec is not None
        (cid,) = _claim(b, ["late"], src.id)
        assert await b.node.fork_received(rec, tpl, [cid]) == [None]
        b.node.unpin_template(tpl.id)
        out = await b.node.exec(cid, models.ExecRequest(command="cat /root/state"))
        assert out.stdout == "first"
        # Done: the stale template goes at once (its reference was the last holder).
        a.node.offer_done(offer.template_id)
        assert a.node.templates.refs.holders(offer.template_id) == {}
        assert not (a.paths.templates / offer.template_id).exists()
        with pytest.raises(NotFound):
            await a.node.read_chunk("mem", offer.template_id, 0, 1)

    asyncio.run(main())


def test_an_offer_a_peer_never_finishes_is_let_go_after_its_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A peer that crashed mid-fetch never says it is done: the reference lapses once no
    # chunk of the template was read for OFFER_LEASE seconds; each read renews it.
    from boxd.node import _offers

    monkeypatch.setattr(_offers, "OFFER_LEASE", 0.3)
    a, _ = _two_nodes(tmp_path, monkeypatch)

    async def main() -> None:
        src = await running(a)
        offer = await a.node.offer_template(src.id)
        await sh(a, src.id, "write /root/state changed")
        await a.node.offer_template(src.id)
        for _ in range(4):  # reads keep it alive past the lease
            await asyncio.sleep(0.15)
            await a.node.read_chunk("mem", offer.template_id, 0, 1)
        assert a.node.templates.refs.holders(offer.template_id) == {"offer": 1}
        await asyncio.sleep(0.6)
        assert a.node.templates.refs.holders(offer.template_id) == {}
        assert not (a.paths.templates / offer.template_id).exists()

    asyncio.run(main())


def _import(w: World, layout: Path) -> None:
    from boxd.images.oci import import_image
    from boxd.storage.oci import ImageStore

    import_image(ImageStore(w.paths.images_store), f"oci:{layout}:v1", f"{ACCOUNT}/it/x:v1")


def _image_layout(tmp_path: Path) -> tuple[Path, str]:
    """An image of one file as an OCI layout (tag v1): the layout and the image's digest."""
    from tests._support.oci import make_image, write_layout

    img = make_image([{"srv/hello.txt": b"from the image\n"}])
    return write_layout(tmp_path / "layout", {"v1": img}), img.digest


async def _image_source(w: World, state: str) -> models.Machine:
    """A running machine of the image `_import` named, its /root/state written."""
    src = await w.machines.create(ACCOUNT, models.MachineCreate(name="img", image="it/x:v1"))
    await w.machines.wait_until_ready(ACCOUNT, src.id, timeout=5)
    await sh(w, src.id, f"write /root/state {state}")
    return src


def _backing(w: World, layer_id: str) -> Path:
    """What a fake engine's layer file sits on."""
    return Path(json.loads(w.node.templates.layer_path(layer_id).read_text())["backing"])


def test_an_image_machines_template_moves_onto_the_receivers_own_tree_of_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 41: the template of a container image's machine named the image's tree on
    # its node; the receiving node re-points its base layer at its own tree of that
    # image (unpacked from its own store: the control plane pushed the blobs before)
    a, b = _two_nodes(tmp_path, monkeypatch)
    layout, digest = _image_layout(tmp_path)
    _import(a, layout)
    hexd = digest.split(":", 1)[1]

    async def main() -> None:
        src = await _image_source(a, "before-the-fork")
        offer = await a.node.offer_template(src.id)
        assert offer.run_image is not None and offer.run_image.digest == digest
        # a node whose store lacks the image refuses it, typed, and keeps nothing
        with pytest.raises(NotFound):
            await b.node.receive_template(offer, _fetch_from(a, []))
        assert not b.paths.templates.exists() or not any(b.paths.templates.iterdir())
        assert b.repos.layers.ids() == set()
        # an engine that cannot move an image machine's template refuses it
        _import(b, layout)
        b.engine.portable_images = False
        with pytest.raises(InvalidRequest, match="container image's machine cannot move"):
            await b.node.receive_template(offer, _fetch_from(a, []))
        b.engine.portable_images = True
        tpl = await b.node.receive_template(offer, _fetch_from(a, []))
        base = b.repos.layers.chain(tpl.layer_id)[-1]
        ours = (b.paths.image_roots / hexd).resolve()
        assert _backing(b, base.id) == ours and base.base == str(ours)
        assert (ours / "srv/hello.txt").read_bytes() == b"from the image\n"
        assert not str(_backing(b, base.id)).startswith(str(a.paths.home))
        rec = a.repos.machines.get(src.id)
        assert rec is not None
        ids = _claim(b, ["k1"], src.id, rec.run_image)
        assert await b.node.fork_received(rec, tpl, ids) == [None]
        b.node.unpin_template(tpl.id)
        out = await b.node.exec(ids[0], models.ExecRequest(command="cat /root/state"))
        assert out.stdout == "before-the-fork"

    asyncio.run(main())
