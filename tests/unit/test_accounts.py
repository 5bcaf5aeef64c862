"""Accounts and their limits over HTTP: the operator (account local) sees and changes
every account; other accounts see only themselves and change nothing. Real SQLite;
the machine services are the in-memory fakes (no VMs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests._support.api_fakes import FakeMachines, FakeSnapshots, host_info

from boxd.api import create_app
from boxd.api.services.keys import KeyService
from boxd.state import Database


class Env:
    def __init__(self, tmp: Path) -> None:
        self.db = Database(tmp / "state.db")
        self.keys = KeyService(self.db)
        machines = FakeMachines()
        self.app = create_app(
            machines=machines, snapshots=FakeSnapshots(machines, tmp), keys=self.keys,
            host_info=host_info, upload_dir=tmp / "uploads",
        )
        local = self.keys.ensure_local_account()
        self.op = TestClient(self.app, raise_server_exceptions=False)
        self.op.headers["Authorization"] = f"Bearer {self.keys.create(local, 'op').secret}"
        other = self.keys.create_for(local, "k", "team-a").secret
        self.user = TestClient(self.app, raise_server_exceptions=False)
        self.user.headers["Authorization"] = f"Bearer {other}"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    monkeypatch.setenv("BOXD_DEFAULT_MAX_MACHINES", "7")
    e = Env(tmp_path)
    yield e
    e.op.close()
    e.user.close()
    e.db.close()


def test_the_operator_lists_every_account_with_the_default_limit(env: Env) -> None:
    r = env.op.get("/v1/accounts")
    assert r.status_code == 200
    by_name = {a["name"]: a for a in r.json()["accounts"]}
    assert set(by_name) == {"local", "team-a"}
    assert by_name["team-a"]["max_machines"] == 7  # BOXD_DEFAULT_MAX_MACHINES
    assert by_name["team-a"]["machines"] == 0


def test_the_operator_raises_a_limit(env: Env) -> None:
    r = env.op.patch("/v1/accounts/team-a", json={"max_machines": 200})
    assert r.status_code == 200 and r.json()["max_machines"] == 200
    assert env.user.get("/v1/accounts/team-a").json()["max_machines"] == 200


def test_an_account_sees_only_itself_and_cannot_change_limits(env: Env) -> None:
    mine = env.user.get("/v1/accounts").json()["accounts"]
    assert [a["name"] for a in mine] == ["team-a"]
    assert env.user.get("/v1/accounts/local").status_code == 404  # tells nothing
    r = env.user.patch("/v1/accounts/team-a", json={"max_machines": 1000})
    assert r.status_code in (401, 403)
    err = r.json()["error"]
    assert "operator" in err["message"] and "--max-machines" in err["hint"]
    assert env.op.get("/v1/accounts/team-a").json()["max_machines"] == 7


@pytest.mark.parametrize("body", [{"max_machines": -1}, {"max_machines": "lots"}, {}])
def test_bad_limits_are_400(env: Env, body: dict[str, object]) -> None:
    r = env.op.patch("/v1/accounts/team-a", json=body)
    assert r.status_code == 400
