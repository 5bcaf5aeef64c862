"""The console app over the API tests' fake services: login, account scoping, pages,
JSON, actions (the browser tests in tests/integration/test_console.py drive the same
routes through Chromium against real machines)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from tests._support.api_fakes import FakeMachines, FakeSnapshots

from boxd import models
from boxd.console import views
from boxd.console.app import create_console_app
from boxd.console.sessions import COOKIE, Logins
from boxd.errors import AuthError

KEYS = {"key-alice": "alice", "key-bob": "bob"}


def authenticate(secret: str | None) -> str:
    if secret not in KEYS:
        raise AuthError("unknown API key")
    return KEYS[secret]


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.machines = FakeMachines()
        self.snapshots = FakeSnapshots(self.machines, tmp)
        self.logins = Logins()
        self.app = create_console_app(self.machines, self.snapshots, authenticate,
                                      self.logins)

    def add(self, account: str, name: str, parent: str | None = None,
            labels: dict[str, str] | None = None) -> models.Machine:
        return self.machines._add(account, name, parent=parent, labels=labels)

    def client(self, key: str | None = "key-alice") -> TestClient:
        """A browser logged in with ``key`` (None: not logged in)."""
        c = TestClient(self.app, base_url="http://127.0.0.1:7071")
        if key is not None:
            r = c.post("/login-tokens", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            login = c.get(r.json()["url"], follow_redirects=False)
            assert login.status_code == 303
            assert login.headers["location"] == "/"
        return c


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    yield Fleet(tmp_path)


def test_login_sets_an_httponly_samesite_strict_cookie_and_leaves_the_token_url(
        fleet: Fleet) -> None:
    c = TestClient(fleet.app, base_url="http://127.0.0.1:7071")
    r = c.post("/login-tokens", headers={"Authorization": "Bearer key-alice"})
    body = r.json()
    assert body["url"].startswith("http://127.0.0.1:7071/login?token=")
    assert r.headers["cache-control"] == "no-store"
    login = c.get(body["url"], follow_redirects=False)
    cookie = login.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert "token" not in login.headers["location"]
    again = TestClient(fleet.app).get(body["url"], follow_redirects=False)
    assert again.status_code == 401  # once only
    assert COOKIE not in again.headers.get("set-cookie", "")


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic key-alice", "key-alice"])
def test_no_login_token_without_a_valid_api_key(fleet: Fleet, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    r = TestClient(fleet.app).post("/login-tokens", headers=headers)
    assert r.status_code == 401
    assert "url" not in r.json()


def test_without_a_session_no_page_or_json_has_data(fleet: Fleet) -> None:
    m = fleet.add("alice", "secret-machine")
    c = fleet.client(None)
    for path in ("/", f"/machines/{m.id}", "/snapshots", "/api/machines",
                 f"/api/machines/{m.id}/graph", "/api/events", f"/api/machines/{m.id}/events",
                 f"/api/machines/{m.id}/processes/p-1/output"):
        r = c.get(path)
        assert r.status_code == 401, path
        assert "secret-machine" not in r.text and m.id not in r.text, path
    c.cookies.set(COOKIE, "forged")
    assert c.get("/api/machines").status_code == 401
    bad = c.get("/login?token=forged", follow_redirects=False)
    assert bad.status_code == 401 and "set-cookie" not in bad.headers


def test_the_table_lists_the_accounts_machines_only(fleet: Fleet) -> None:
    mine = fleet.add("alice", "mine", labels={"run": "a"})
    theirs = fleet.add("bob", "theirs")
    c = fleet.client("key-alice")
    page = c.get("/")
    assert page.status_code == 200
    assert "mine" in page.text and "theirs" not in page.text
    assert "run=a" in page.text
    rows = c.get("/api/machines").json()["machines"]
    assert [r["id"] for r in rows] == [mine.id]
    assert c.get(f"/machines/{theirs.id}").status_code == 404
    assert c.get(f"/api/machines/{theirs.id}/graph").status_code == 404
    r = c.post(f"/api/machines/{theirs.id}/actions/delete", headers={"X-Boxd-Console": "1"})
    assert r.status_code == 404
    assert asyncio.run(fleet.machines.get("bob", theirs.id)).id == theirs.id


def test_pages_send_a_strict_content_security_policy(fleet: Fleet) -> None:
    r = fleet.client().get("/")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp
    assert r.headers["referrer-policy"] == "no-referrer"


def test_an_action_needs_the_console_header(fleet: Fleet) -> None:
    m = fleet.add("alice", "m1")
    c = fleet.client()
    r = c.post(f"/api/machines/{m.id}/actions/suspend")
    assert r.status_code == 401
    assert asyncio.run(fleet.machines.get("alice", m.id)).state == "running"
    ok = c.post(f"/api/machines/{m.id}/actions/suspend", headers={"X-Boxd-Console": "1"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["result"]["state"] == "suspended"


def test_fork_checkpoint_snapshot_and_delete_actions(fleet: Fleet) -> None:
    m = fleet.add("alice", "src")
    c = fleet.client()
    h = {"X-Boxd-Console": "1"}
    child = c.post(f"/api/machines/{m.id}/actions/fork", json={"name": "kid"}, headers=h)
    assert child.json()["result"]["parent_id"] == m.id
    cp = c.post(f"/api/machines/{m.id}/actions/checkpoint", json={}, headers=h)
    assert cp.status_code == 200 and cp.json()["result"]["name"].startswith("console-")
    no_name = c.post(f"/api/machines/{m.id}/actions/snapshot", json={}, headers=h)
    assert no_name.status_code == 400
    snap = c.post(f"/api/machines/{m.id}/actions/snapshot", json={"name": "s1"}, headers=h)
    assert snap.json()["result"]["name"] == "s1"
    assert c.post(f"/api/machines/{m.id}/actions/explode", headers=h).status_code == 404
    gone = c.post(f"/api/machines/{m.id}/actions/delete", headers=h)
    assert gone.status_code == 200
    assert c.get(f"/machines/{m.id}").status_code == 404


def test_the_graph_has_ancestors_descendants_snapshots_and_checkpoints(fleet: Fleet) -> None:
    root = fleet.add("alice", "root")
    mid = fleet.add("alice", "mid", parent=root.id)
    leaf = fleet.add("alice", "leaf", parent=mid.id)
    grand = fleet.add("alice", "grand", parent=leaf.id)
    fleet.add("alice", "cousin", parent=root.id)
    fleet.add("alice", "stranger")
    asyncio.run(fleet.machines.checkpoint_save("alice", mid.id, "cp1"))
    asyncio.run(fleet.snapshots.save("alice", leaf.id, "snap"))
    elements = fleet.client().get(f"/api/machines/{mid.id}/graph").json()["elements"]
    nodes = {e["data"]["id"]: e["data"] for e in elements if "source" not in e["data"]}
    edges = {(e["data"]["source"], e["data"]["target"]) for e in elements
             if "source" in e["data"]}
    labels = {d["label"] for d in nodes.values()}
    assert {"root", "mid", "leaf", "grand", "cp1", "snap@1"} == labels  # not the cousin
    assert (root.id, mid.id) in edges and (leaf.id, grand.id) in edges
    assert nodes[mid.id]["focus"] and not nodes[root.id]["focus"]
    kinds = {d["label"]: d["kind"] for d in nodes.values()}
    assert kinds["cp1"] == "checkpoint" and kinds["snap@1"] == "snapshot"
    assert nodes[grand.id]["href"] == f"/machines/{grand.id}"
    page = fleet.client().get(f"/machines/{mid.id}")
    assert page.status_code == 200 and "grand" in page.text and "cp1" in page.text


def test_the_snapshots_page_lists_the_accounts_snapshots(fleet: Fleet) -> None:
    m = fleet.add("alice", "m")
    b = fleet.add("bob", "b")
    asyncio.run(fleet.snapshots.save("alice", m.id, "mine"))
    asyncio.run(fleet.snapshots.save("bob", b.id, "theirs"))
    page = fleet.client().get("/snapshots")
    assert "mine" in page.text and "theirs" not in page.text


def test_a_machine_row_names_its_parent_and_snapshot() -> None:
    parent = models.Machine(id="m-1", name="p", state="running", vcpus=1, memory_mib=512,
                            disk_gib=1, isolated=False, created_at=0.0)
    snap = models.Snapshot(id="s", name="base", version=2, digest="sha256:ab", created_at=0)
    child = parent.model_copy(update={"id": "m-2", "name": "c", "parent_id": "m-1",
                                      "snapshot": "sha256:ab", "idle_seconds": 75.0,
                                      "labels": {"b": "2", "a": "1"}})
    row = views.machine_row(child, {"m-1": "p"}, {"sha256:ab": snap}, now=3700.0)
    assert row["parent"] == "p" and row["source"] == "base@2"
    assert row["age"] == "1h01m" and row["idle"] == "1m" and row["memory"] == "512 MiB"
    assert list(row["labels"]) == ["a", "b"]
