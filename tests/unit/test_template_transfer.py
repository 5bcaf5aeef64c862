"""A fork template moving from one node runtime to another (the cross-node fork of a
cluster, `Offers.offer_template` → `Templates.receive` → `Forks.fork_received`), on the
fake engine: two node runtimes with their own data directories, the receiving one
fetching chunks straight from the other (on Ray, `NodeActor.read_chunk` does it). The
real engines' transfer runs in tests/integration/test_cluster.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tests._support.fake_world import ACCOUNT, World, make_world, running, sh

from boxd import models
from boxd.errors import InvalidRequest
from boxd.node._transfer import Fetch, FileOffer


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


def _claim(w: World, names: list[str], src_id: str) -> list[str]:
    return [w.repos.machines.claim(
        ACCOUNT, n, machine_id=f"m_{n}", vcpus=1, memory_mib=256, disk_gib=1,
        isolated=True, image="img1", node_id=w.node.id, engine="fake", parent_id=src_id,
        default_quota=100).id for n in names]


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
        for cid in ids:
            out = await b.node.exec(cid, models.ExecRequest(command="cat /root/state"))
            assert out.stdout == "before-the-fork"
        # the source unchanged: the same offer, and nothing crosses again
        fetched.clear()
        again = await b.node.receive_template(await a.node.offer_template(src.id),
                                              _fetch_from(a, fetched))
        assert again.id == tpl.id and fetched == []

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
