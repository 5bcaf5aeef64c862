"""Fork and snapshot lineage: the pure builder (``boxd.sdk._lineage``), the sync and
async SDKs' ``machines.lineage()`` and the CLI's ``machine tree`` / ``snapshots tree``,
against a real daemon over the in-memory fake services."""

from __future__ import annotations

import asyncio
import json

from click.testing import CliRunner, Result
from tests._support import sdk_daemon as support

from boxd import AsyncBoxd, Boxd, MachineNotFound, models
from boxd.api.server import Daemon
from boxd.cli import main
from boxd.sdk import _lineage

daemon = support.daemon  # fixtures
paths = support.paths


def machine(i: str, name: str, parent: str | None = None, snapshot: str | None = None,
            at: float = 0.0) -> models.Machine:
    return models.Machine(id=i, name=name, state=models.MachineState.RUNNING, vcpus=1,
                          memory_mib=1024, disk_gib=8, isolated=False, parent_id=parent,
                          snapshot=snapshot, created_at=at)


def snapshot(i: str, name: str, version: int, hexdigest: str, source: str | None,
             at: float) -> models.Snapshot:
    return models.Snapshot(id=i, name=name, version=version, digest="sha256:" + hexdigest,
                           source_machine=source, created_at=at)


def names(nodes: tuple[_lineage.MachineNode, ...]) -> list[object]:
    """The fork forest as nested [name, [children...]] lists."""
    return [[n.machine.name, names(n.children)] for n in nodes]


def test_build_forks_snapshots_and_origins() -> None:
    ms = [
        machine("m1", "rl-base", at=1),
        machine("m2", "rollout-1", parent="m1", at=2),
        machine("m3", "rollout-2", parent="m1", at=3),
        machine("m4", "rollout-1a", parent="m2", at=4),  # a fork of a fork
        machine("m5", "rl-base-2", snapshot="aa" * 32, at=6),  # from env-v3@1
        machine("m6", "child-of-2", parent="m5", snapshot="aa" * 32, at=7),  # inherits it
        machine("m7", "orphan", parent="gone", at=8),  # its parent was deleted
    ]
    ss = [
        snapshot("s2", "env-v3", 2, "bb" * 32, "rl-base", at=9),
        snapshot("s1", "env-v3", 1, "aa" * 32, "rl-base", at=5),
        snapshot("s3", "old", 1, "cc" * 32, "deleted-machine", at=0.5),
    ]
    lin = _lineage.build(ms, ss)
    assert names(lin.machines) == [
        ["rl-base", [["rollout-1", [["rollout-1a", []]]], ["rollout-2", []]]],
        ["rl-base-2", [["child-of-2", []]]],
        ["orphan", []],
    ]
    base, from_snap, _ = lin.machines
    assert [s.version for s in base.snapshots] == [1, 2]  # oldest first
    assert base.from_snapshot is None
    assert from_snap.from_snapshot is not None and from_snap.from_snapshot.id == "s1"
    assert from_snap.children[0].from_snapshot is None  # inherited, not its own origin
    by = {(n.snapshot.name, n.snapshot.version): n for n in lin.snapshots}
    assert list(by) == [("env-v3", 1), ("env-v3", 2), ("old", 1)]
    assert by["env-v3", 1].source is not None and by["env-v3", 1].source.id == "m1"
    assert [n.machine.name for n in by["env-v3", 1].machines] == ["rl-base-2"]
    assert by["env-v3", 2].machines == ()
    assert by["old", 1].source is None  # saved from a machine that is gone


def test_build_subtree_of_one_machine() -> None:
    ms = [machine("m1", "a", at=1), machine("m2", "b", parent="m1", at=2),
          machine("m3", "c", parent="m2", at=3), machine("m4", "d", at=4)]
    ss = [snapshot("s1", "snap-b", 1, "aa" * 32, "b", at=5),
          snapshot("s2", "snap-d", 1, "bb" * 32, "d", at=6)]
    lin = _lineage.build(ms, ss, "m2")
    assert names(lin.machines) == [["b", [["c", []]]]]
    assert [n.snapshot.name for n in lin.snapshots] == ["snap-b"]


def test_a_newer_namesake_is_not_the_source() -> None:
    # `old` was saved from a machine `a` deleted since; today's `a` was made afterwards
    ms = [machine("m9", "a", at=10)]
    lin = _lineage.build(ms, [snapshot("s1", "old", 1, "aa" * 32, "a", at=5)])
    assert lin.snapshots[0].source is None and lin.machines[0].snapshots == ()


def make_family() -> None:
    """rl-base -> rollout-1 -> rollout-1a, rl-base -> rollout-2; env-v3@1 of rl-base,
    rl-base-2 from env-v3."""
    with Boxd() as b:
        b.machines.new("rl-base")
        b.machines.fork("rl-base", "rollout-1")
        b.machines.fork("rl-base", "rollout-2")
        b.machines.fork("rollout-1", "rollout-1a")
        b.snapshots.save("rl-base", "env-v3")
        b.machines.new("rl-base-2", from_snapshot="env-v3")


def test_sync_and_async_lineage_agree(daemon: Daemon) -> None:
    make_family()

    async def both() -> tuple[_lineage.Lineage, _lineage.Lineage]:
        async with AsyncBoxd() as a:
            return await a.machines.lineage(), await a.machines.lineage("rollout-1")

    with Boxd() as b:
        sync_all, sync_sub = b.machines.lineage(), b.machines.lineage("rollout-1")
        try:
            b.machines.lineage("nope")
        except MachineNotFound:
            pass
        else:
            raise AssertionError("lineage of an unknown machine did not raise")
    async_all, async_sub = asyncio.run(both())
    assert sync_all == async_all and sync_sub == async_sub
    assert names(sync_sub.machines) == [["rollout-1", [["rollout-1a", []]]]]
    assert names(sync_all.machines) == [
        ["rl-base", [["rollout-1", [["rollout-1a", []]]], ["rollout-2", []]]],
        ["rl-base-2", []],
    ]


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_machine_tree_draws_forks_and_snapshots(daemon: Daemon) -> None:
    make_family()
    r = run("machine", "tree")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    at = {n: next(i for i, line in enumerate(lines) if f" {n} " in f" {line} ")
          for n in ("rl-base", "rollout-1", "rollout-1a", "rollout-2", "rl-base-2")}
    indent = {n: len(lines[i]) - len(lines[i].lstrip(" │├└─")) for n, i in at.items()}
    assert indent["rl-base"] == 0 and indent["rl-base-2"] == 0
    assert indent["rollout-1"] == indent["rollout-2"] > 0
    assert indent["rollout-1a"] > indent["rollout-1"]  # the fork of a fork, one deeper
    assert at["rl-base"] < at["rollout-1"] < at["rollout-1a"] < at["rollout-2"]
    assert any("snapshot env-v3@1 sha256:" in line for line in lines[at["rl-base"]:])
    assert "from snapshot env-v3@1" in lines[at["rl-base-2"]]

    r = run("machine", "tree", "rollout-1")
    assert "rollout-1a" in r.stdout and "rollout-2" not in r.stdout
    assert run("machine", "tree", "ghost").exit_code == 1

    data = json.loads(run("machine", "tree", "--json").stdout)
    root = data["machines"][0]
    assert root["machine"]["name"] == "rl-base"
    assert [c["machine"]["name"] for c in root["children"]] == ["rollout-1", "rollout-2"]
    assert root["children"][0]["children"][0]["machine"]["name"] == "rollout-1a"
    assert root["snapshots"][0]["name"] == "env-v3"
    assert data["machines"][1]["from_snapshot"]["name"] == "env-v3"


def test_snapshots_tree_draws_versions_sources_and_machines(daemon: Daemon) -> None:
    make_family()
    with Boxd() as b:
        b.snapshots.save("rollout-1a", "env-v3", new_version=True)
    r = run("snapshots", "tree")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == "env-v3"
    v1 = next(i for i, line in enumerate(lines) if "@1 sha256:" in line)
    v2 = next(i for i, line in enumerate(lines) if "@2 sha256:" in line)
    assert "saved from rl-base" in lines[v1] and "saved from rollout-1a" in lines[v2]
    assert v1 < v2 and "rl-base-2" in "\n".join(lines[v1:v2])  # made from version 1
    data = json.loads(run("snapshots", "tree", "--json").stdout)
    assert [(s["snapshot"]["version"], s["source"]["name"]) for s in data["snapshots"]] == [
        (1, "rl-base"), (2, "rollout-1a")]
    assert data["snapshots"][0]["machines"][0]["machine"]["name"] == "rl-base-2"


def test_empty_trees(daemon: Daemon) -> None:
    assert "no machines" in run("machine", "tree").stdout
    assert "no snapshots" in run("snapshots", "tree").stdout
