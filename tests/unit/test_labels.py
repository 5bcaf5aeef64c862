"""Machine labels (issue 42, item 2): checked on new and fork, inherited by forks,
selected by `machines.list(labels=, state=)` a page at a time, deleted by
`machines.delete_many(labels=)` and `boxd machine delete --label`.

The SDK talks in process to the real FastAPI app on the real control plane, node
runtime and SQLite state over the fake engine (tests/_support/fake_world.py); the
10,000-machine pages are real SQLite rows.
"""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World

from boxd import Boxd, errors, models
from boxd.api.server import Daemon
from boxd.cli import main
from boxd.state import Database, Repos

paths = support.paths  # fixtures
no_daemon = support.no_daemon
daemon = support.daemon


world = support.world  # fixture


boxd = support.world_boxd  # fixture


RUN = {"boxd.rl/run": "r-1", "boxd.rl/owner": "env"}


# ------------------------------------------------------------------- validation


@pytest.mark.parametrize("labels, what", [
    ({"": "x"}, "invalid label key"),
    ({"-lead": "x"}, "invalid label key"),
    ({"a b": "x"}, "invalid label key"),
    ({"k=v": "x"}, "invalid label key"),
    ({"k" * 129: "x"}, "invalid label key"),
    ({"k": "v" * 257}, "invalid value"),
    ({"k": "line\nbreak"}, "invalid value"),
    ({f"k{i}": "v" for i in range(33)}, "33 labels: the limit is 32"),
])
def test_bad_labels_are_refused_by_the_sdk_and_by_the_daemon(
    boxd: Boxd, world: World, labels: dict[str, str], what: str,
) -> None:
    with pytest.raises(errors.InvalidRequest, match=what) as caught:
        boxd.machines.new("m", labels=labels)
    assert caught.value.details["field"] == "labels"
    # the daemon checks too (a client that skips the SDK's check gets the same 400)
    resp = boxd._client().post("/v1/machines", json={"name": "m", "labels": labels})
    assert resp.status_code == 400, resp.text
    body = resp.json()["error"]
    assert body["code"] == "invalid_request" and body["details"]["field"] == "labels"
    assert what in body["message"]
    assert world.repos.machines.list(ACCOUNT) == []  # nothing half-made


def test_a_non_string_value_is_refused(boxd: Boxd) -> None:
    resp = boxd._client().post("/v1/machines", json={"name": "m", "labels": {"k": 7}})
    assert resp.status_code == 400 and "invalid value" in resp.json()["error"]["message"]


# ------------------------------------------------------------------- new, fork, info


def test_labels_are_shown_and_survive_a_daemon_restart(boxd: Boxd, world: World) -> None:
    m = boxd.machines.new("base", labels=RUN)
    assert m.labels == RUN
    assert boxd.machines.get("base").labels == RUN
    world.restart()  # a new node runtime on the same records
    reopened = Repos(Database(world.paths.db))  # and a new connection to the file
    try:
        rec = reopened.machines.get(m.id)
        assert rec is not None and rec.labels == RUN
        page = reopened.machines.page(ACCOUNT, labels={"boxd.rl/run": "r-1"})
        assert [r.id for r in page] == [m.id]
    finally:
        reopened.db.close()
    assert boxd.machines.get("base").labels == RUN


def test_forks_inherit_the_source_labels_merged_with_their_own(boxd: Boxd) -> None:
    boxd.machines.new("base", labels={"team": "a", "boxd.rl/owner": "env"})
    boxd.machines.wait_until_ready("base")
    one = boxd.machines.fork("base", "one", labels={"boxd.rl/owner": "verify", "x": "1"})
    assert one.labels == {"team": "a", "boxd.rl/owner": "verify", "x": "1"}
    items = boxd.machines.fork("base", count=2, labels={"branch": "b-1"})
    assert all(isinstance(i, models.Machine) for i in items)
    assert [i.labels for i in items if isinstance(i, models.Machine)] == [
        {"team": "a", "boxd.rl/owner": "env", "branch": "b-1"}] * 2
    plain = boxd.machines.fork("base", "plain")
    assert plain.labels == {"team": "a", "boxd.rl/owner": "env"}
    grandchild = boxd.machines.fork("one", "two")
    assert grandchild.labels == one.labels


def test_a_fork_whose_merged_labels_pass_the_limit_is_refused(boxd: Boxd, world: World) -> None:
    boxd.machines.new("base", labels={f"s{i}": "v" for i in range(30)})
    boxd.machines.wait_until_ready("base")
    with pytest.raises(errors.InvalidRequest, match="33 labels"):
        boxd.machines.fork("base", "child", labels={f"c{i}": "v" for i in range(3)})
    assert [r.name for r in world.repos.machines.list(ACCOUNT)] == ["base"]


# ------------------------------------------------------------------- selection


def test_list_selects_by_every_label_and_by_state(boxd: Boxd) -> None:
    boxd.machines.new("a", labels={"run": "1", "owner": "env"})
    boxd.machines.new("b", labels={"run": "1", "owner": "verify"})
    boxd.machines.new("c", labels={"run": "2", "owner": "env"})
    boxd.machines.new("d")
    for n in "abcd":
        boxd.machines.wait_until_ready(n)
    boxd.machines.suspend("b")

    def names(**kw: object) -> list[str]:
        return [m.name for m in boxd.machines.list(**kw)]  # type: ignore[arg-type]

    assert names() == ["a", "b", "c", "d"]
    assert names(labels={"run": "1"}) == ["a", "b"]
    assert names(labels={"run": "1", "owner": "env"}) == ["a"]
    assert names(labels={"run": "1", "owner": "nobody"}) == []
    assert names(labels={"run": "1"}, state="suspended") == ["b"]
    assert names(state="running") == ["a", "c", "d"]
    with pytest.raises(errors.InvalidRequest):
        boxd.machines.list(state="asleep")
    with pytest.raises(errors.InvalidRequest, match="cursor"):
        boxd.machines.list_page(cursor="not-a-cursor")


def _insert(repos: Repos, n: int, labels: dict[str, str], start: int = 0) -> list[str]:
    """``n`` machine rows (and their label rows) straight into the real SQLite file:
    what 10,000 claims would leave, without booting 10,000 fakes."""
    ids = [f"m_bulk{i:06d}" for i in range(start, start + n)]
    now = time.time()
    with repos.db.transaction() as conn:
        conn.executemany(
            "INSERT INTO machines (id, account_id, name, state, vcpus, memory_mib, disk_gib,"
            " image, created_at, labels) VALUES (?,?,?,'running',1,128,1,'img',?,?)",
            [(mid, ACCOUNT, f"bulk-{i}", now + i * 1e-3, json.dumps(labels))
             for i, mid in zip(range(start, start + n), ids, strict=True)])
        conn.executemany("INSERT INTO machine_labels (machine_id, key, value) VALUES (?,?,?)",
                         [(mid, k, v) for mid in ids for k, v in labels.items()])
    return ids


def test_pages_walk_ten_thousand_machines_once_each_in_order(
    boxd: Boxd, world: World,
) -> None:
    run = _insert(world.repos, 10_000, {"run": "big"})
    _insert(world.repos, 500, {"run": "other"}, start=10_000)
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        page = boxd.machines.list_page(labels={"run": "big"}, limit=1000, cursor=cursor)
        seen += [m.id for m in page.machines]
        pages += 1
        assert pages <= 11
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == run  # each once, oldest first, none of the other run
    assert len(boxd.machines.list(labels={"run": "other"})) == 500
    # a machine made while paging shows up on the last page, after the cursor
    first = boxd.machines.list_page(labels={"run": "big"}, limit=3)
    assert [m.id for m in first.machines] == run[:3]
    late = _insert(world.repos, 1, {"run": "big"}, start=20_000)
    rest = boxd.machines.list_page(labels={"run": "big"}, limit=1000, cursor=first.next_cursor)
    assert rest.machines[0].id == run[3]
    with pytest.raises(errors.InvalidRequest, match="limit"):
        boxd.machines.list_page(limit=1001)
    assert boxd.machines.list(labels={"run": "big"})[-1].id == late[0]


def test_a_page_is_one_indexed_query(world: World) -> None:
    """No page reads the account's machines into Python: SQLite walks the
    (account, created_at, id) index from the cursor and probes each label's key."""
    plan = " ".join(str(tuple(r)) for r in world.repos.db.all(
        "EXPLAIN QUERY PLAN SELECT m.* FROM machines m WHERE m.account_id=? AND"
        " m.state!='deleting' AND (m.created_at, m.id) > (?, ?) AND EXISTS (SELECT 1 FROM"
        " machine_labels l WHERE l.machine_id=m.id AND l.key=? AND l.value=?)"
        " ORDER BY m.created_at, m.id LIMIT ?", (ACCOUNT, 0.0, "", "k", "v", 10)))
    assert "USING INDEX machines_by_account" in plan
    assert "USING PRIMARY KEY" in plan
    assert "TEMP B-TREE" not in plan  # no sort of the whole selection per page


# ------------------------------------------------------------------- delete by labels


def test_delete_many_removes_exactly_the_selection(boxd: Boxd, world: World) -> None:
    keep = boxd.machines.new("keep", labels={"run": "2"})
    boxd.machines.new("base", labels={"run": "1"})
    boxd.machines.wait_until_ready("base")
    boxd.machines.fork("base", count=3)
    result = boxd.machines.delete_many({"run": "1"})
    assert len(result.deleted) == 4 and result.errors == []
    assert {m.name for m in result.deleted} >= {"base"}
    assert [m.id for m in boxd.machines.list()] == [keep.id]
    assert world.repos.db.one(
        "SELECT COUNT(*) FROM machine_labels WHERE value='1'")[0] == 0  # type: ignore[index]
    again = boxd.machines.delete_many({"run": "1"})
    assert again.deleted == [] and again.errors == []


def test_delete_many_refuses_an_empty_selector(boxd: Boxd) -> None:
    boxd.machines.new("keep")
    with pytest.raises(errors.InvalidRequest, match="at least one label"):
        boxd.machines.delete_many({})
    # The daemon refuses it too, by its schema: the selector is required, each KEY=VALUE.
    resp = boxd._client().delete("/v1/machines")
    assert resp.status_code == 400 and "label: Field required" in resp.json()["error"]["message"]
    resp = boxd._client().delete("/v1/machines", params={"label": "no-equals-sign"})
    assert resp.status_code == 400 and "label: String should match pattern" in \
        resp.json()["error"]["message"]
    assert [m.name for m in boxd.machines.list()] == ["keep"]


def _cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def test_cli_new_label_info_list_and_delete_by_label(daemon: Daemon) -> None:
    code, out, _ = _cli("machine", "new", "a", "--label", "run=r-9", "-l", "team=x", "--json")
    assert code == 0 and json.loads(out)["labels"] == {"run": "r-9", "team": "x"}
    assert "run=r-9, team=x" in _cli("machine", "info", "a")[1]
    assert _cli("machine", "new", "b", "--label", "run=r-8")[0] == 0
    _, out, _ = _cli("machine", "list", "--label", "run=r-9", "--json")
    assert [m["name"] for m in json.loads(out)] == ["a"]
    assert _cli("machine", "new", "c", "--label", "novalue")[0] == 2
    assert _cli("machine", "delete")[0] == 2  # no name, no label: refused
    assert _cli("machine", "delete", "a", "--label", "run=r-9")[0] == 2
    code, out, _ = _cli("machine", "delete", "--label", "run=r-9")
    assert code == 0 and "deleted a" in out
    _, out, _ = _cli("machine", "list", "--json")
    assert [m["name"] for m in json.loads(out)] == ["b"]


def test_a_selector_asking_one_key_two_values_matches_nothing(boxd: Boxd) -> None:
    """A machine has one value per key: such a selector is valid and selects nothing
    (the same item twice is once)."""
    boxd.machines.new("a", labels={"k": "1"})
    c = boxd._client()
    r = c.get("/v1/machines", params=[("label", "k=1"), ("label", "k=2")])
    assert r.status_code == 200 and r.json()["machines"] == []
    r = c.get("/v1/machines", params=[("label", "k=1"), ("label", "k=1")])
    assert [m["name"] for m in r.json()["machines"]] == ["a"]
    r = c.delete("/v1/machines", params=[("label", "k=1"), ("label", "k=2")])
    assert r.status_code == 200 and r.json()["deleted"] == []
    assert [m.name for m in boxd.machines.list()] == ["a"]
