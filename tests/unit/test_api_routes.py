"""The HTTP API against in-memory fake services: routes, auth, the error map."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests._support.api_fakes import Env


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    yield e
    e.client.close()
    e.db.close()


def _error(resp: object) -> dict[str, object]:
    body = resp.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "hint", "details"}
    return body["error"]  # type: ignore[no-any-return]


def test_health_needs_no_key(env: Env) -> None:
    r = env.client.get("/v1/health", headers={"Authorization": ""})
    assert r.status_code == 200
    body = r.json()
    assert body["ok"] is True and body["version"] and isinstance(body["pid"], int)


def test_info(env: Env) -> None:
    assert env.client.get("/v1/info").json()["engine"] == "fake"


@pytest.mark.parametrize("header", [None, "Bearer boxd_nope", "Basic abc", "Bearer "])
def test_missing_or_unknown_key_is_401(env: Env, header: str | None) -> None:
    headers = {"Authorization": header} if header is not None else {}
    client = TestClient(env.app)
    r = client.get("/v1/machines", headers=headers)
    assert r.status_code == 401
    err = _error(r)
    assert err["code"] == "unauthorized"
    assert "local.key" in str(err["hint"])


def test_machine_lifecycle_and_error_map(env: Env) -> None:
    c = env.client
    r = c.post("/v1/machines", json={"name": "rl-base"})
    assert r.status_code == 201, r.text
    m = r.json()
    assert m["name"] == "rl-base" and m["id"].startswith("m_")
    assert c.get("/v1/machines/rl-base").json()["id"] == m["id"]
    assert c.get(f"/v1/machines/{m['id']}").json()["name"] == "rl-base"
    assert [x["name"] for x in c.get("/v1/machines").json()["machines"]] == ["rl-base"]

    r = c.post("/v1/machines", json={"name": "rl-base"})
    assert r.status_code == 409 and _error(r)["code"] == "already_exists"

    r = c.post("/v1/machines", json={"name": "Bad_Name"})
    assert r.status_code == 400
    err = _error(r)
    assert err["code"] == "invalid_request" and err["details"]["field"] == "name"  # type: ignore[index]

    r = c.get("/v1/machines/nope")
    assert r.status_code == 404
    assert _error(r)["code"] == "machine_not_found"

    assert c.post("/v1/machines/rl-base/wait?timeout=5").status_code == 200
    assert c.delete("/v1/machines/rl-base").status_code == 204
    assert c.get("/v1/machines/rl-base").status_code == 404


def test_validation_error_becomes_400_with_field(env: Env) -> None:
    r = env.client.post("/v1/machines", json={"vcpus": 0})
    assert r.status_code == 400
    err = _error(r)
    assert err["code"] == "invalid_request"
    assert err["details"]["field"] == "vcpus"  # type: ignore[index]
    r = env.client.post(
        "/v1/machines", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and _error(r)["code"] == "invalid_request"
    r = env.client.post("/v1/machines/x/wait?timeout=abc")
    assert r.status_code == 400 and _error(r)["details"]["field"] == "timeout"  # type: ignore[index]


def test_unknown_route_and_method_keep_the_body_shape(env: Env) -> None:
    r = env.client.get("/v1/nothing-here")
    assert r.status_code == 404 and _error(r)["code"] == "not_found"
    r = env.client.patch("/v1/machines")
    assert r.status_code == 405 and _error(r)["code"] == "method_not_allowed"


def test_unexpected_exception_is_500_without_traceback(env: Env) -> None:
    env.client.post("/v1/machines", json={"name": "a"})
    r = env.client.post("/v1/machines/a/exec", json={"command": "crash"})
    assert r.status_code == 500
    err = _error(r)
    assert err["code"] == "internal_error"
    assert "Traceback" not in r.text and "a bug in the service" not in r.text


def test_exec_and_timeout(env: Env) -> None:
    env.client.post("/v1/machines", json={"name": "a"})
    r = env.client.post("/v1/machines/a/exec", json={"command": "echo hi"})
    assert r.status_code == 200 and r.json()["stdout"] == "echo hi\n"
    r = env.client.post("/v1/machines/a/exec", json={"command": "sleep 100", "timeout": 1})
    assert r.status_code == 408
    err = _error(r)
    assert err["code"] == "exec_timeout" and err["details"]["stdout"] == "partial"  # type: ignore[index]


def test_exec_stream_ndjson(env: Env) -> None:
    env.client.post("/v1/machines", json={"name": "a"})
    with env.client.stream("POST", "/v1/machines/a/exec/stream", json={"command": "x"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) for line in r.iter_lines() if line]
    assert [e["type"] for e in events] == ["stdout", "stdout", "stdout", "exit"]
    assert events[0]["data"] == "x 0\n" and events[-1]["exit_code"] == 0

    # An unknown machine fails before the stream starts, with its proper status.
    r = env.client.post("/v1/machines/nope/exec/stream", json={"command": "x"})
    assert r.status_code == 404 and _error(r)["code"] == "machine_not_found"

    # A failure midway ends the stream with one error event.
    r = env.client.post("/v1/machines/a/exec/stream", json={"command": "die"})
    events = [json.loads(line) for line in r.text.splitlines()]
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "machine_failed"


def test_files_roundtrip_bytes(env: Env) -> None:
    env.client.post("/v1/machines", json={"name": "a"})
    data = bytes(range(256)) * 100
    r = env.client.put("/v1/machines/a/files", params={"path": "/home/boxd/x.bin", "mode": 493},
                       content=data)
    assert r.status_code == 200, r.text
    assert r.json()["size"] == len(data) and r.json()["mode"] == 0o755
    r = env.client.get("/v1/machines/a/files", params={"path": "/home/boxd/x.bin"})
    assert r.status_code == 200 and r.content == data
    assert r.headers["content-type"] == "application/octet-stream"
    r = env.client.get("/v1/machines/a/files", params={"path": "/nope"})
    assert r.status_code == 404 and _error(r)["code"] == "guest_file_not_found"
    r = env.client.put("/v1/machines/a/files", params={"path": "relative"}, content=b"x")
    assert r.status_code == 400 and _error(r)["details"]["field"] == "path"  # type: ignore[index]


def test_fork_single_and_batch(env: Env) -> None:
    c = env.client
    c.post("/v1/machines", json={"name": "rl-base"})
    r = c.post("/v1/machines/rl-base/fork", json={"name": "child"})
    assert r.status_code == 201 and r.json()["name"] == "child"
    r = c.post("/v1/machines/rl-base/fork", json={"name": "child"})
    assert r.status_code == 409 and _error(r)["code"] == "already_exists"
    r = c.post("/v1/machines/rl-base/fork")
    assert r.status_code == 201

    r = c.post("/v1/machines/rl-base/fork/batch", json={"count": 3})
    assert r.status_code == 200
    assert [ch["machine"] is not None for ch in r.json()["children"]] == [True] * 3

    r = c.post("/v1/machines/rl-base/fork/batch", json={"names": ["child", "r-1"]})
    children = r.json()["children"]
    assert children[0]["error"]["code"] == "already_exists" and children[0]["machine"] is None
    assert children[1]["machine"]["name"] == "r-1"

    for bad in ({}, {"count": 2, "names": ["a"]}, {"names": ["x", "x"]}, {"names": ["BAD"]},
                {"names": []}, {"count": 65}):
        r = c.post("/v1/machines/rl-base/fork/batch", json=bad)
        assert r.status_code == 400, bad
    r = c.post("/v1/machines/nope/fork/batch", json={"count": 2})
    assert r.status_code == 404


def test_checkpoints(env: Env) -> None:
    c = env.client
    c.post("/v1/machines", json={"name": "a"})
    r = c.post("/v1/machines/a/checkpoints", json={"name": "start"})
    assert r.status_code == 201
    assert [x["name"] for x in c.get("/v1/machines/a/checkpoints").json()["checkpoints"]] == [
        "start"
    ]
    assert c.post("/v1/machines/a/checkpoints/start/restore").json()["name"] == "a"
    r = c.post("/v1/machines/a/checkpoints/nope/restore")
    assert r.status_code == 404 and _error(r)["code"] == "checkpoint_not_found"
    assert c.delete("/v1/machines/a/checkpoints/start").status_code == 204


def test_snapshots_export_import(env: Env, tmp_path: Path) -> None:
    c = env.client
    c.post("/v1/machines", json={"name": "a"})
    r = c.post("/v1/snapshots", json={"machine": "a", "name": "env-v3"})
    assert r.status_code == 201
    assert c.get("/v1/snapshots/env-v3").json()["name"] == "env-v3"
    assert len(c.get("/v1/snapshots").json()["snapshots"]) == 1
    r = c.get("/v1/snapshots/env-v3/export")
    assert r.status_code == 200 and r.content.startswith(b"SNAPSHOT:")
    assert not list(tmp_path.glob("export-*"))  # streamed, then deleted
    r = c.post("/v1/snapshots/import", params={"name": "copy"}, content=r.content)
    assert r.status_code == 201 and r.json()["name"] == "copy"
    assert env.snapshots.imported[-1].startswith(b"SNAPSHOT:env-v3")
    assert not list((tmp_path / "uploads").iterdir())  # spool file removed
    r = c.post("/v1/snapshots/import", content=b"garbage")
    assert r.status_code == 400
    r = c.get("/v1/snapshots/nope")
    assert r.status_code == 404 and _error(r)["code"] == "snapshot_not_found"
    assert c.delete("/v1/snapshots/env-v3").status_code == 204


def test_keys_create_list_revoke(env: Env) -> None:
    c = env.client
    r = c.post("/v1/keys", json={"name": "ci"})
    assert r.status_code == 201
    new = r.json()
    assert new["secret"].startswith("boxd_") and len(new["secret"]) == 37
    assert new["prefix"] == new["secret"][:12]
    listed = c.get("/v1/keys").json()["keys"]
    assert {k["name"] for k in listed} == {"test", "ci"}
    assert all("secret" not in k for k in listed)

    other = TestClient(env.app)
    other.headers["Authorization"] = f"Bearer {new['secret']}"
    assert other.get("/v1/machines").status_code == 200
    assert c.delete(f"/v1/keys/{new['id']}").status_code == 204
    assert c.delete(f"/v1/keys/{new['id']}").status_code == 204  # idempotent
    r = other.get("/v1/machines")
    assert r.status_code == 401 and "revoked" in str(_error(r)["message"])
    assert c.delete("/v1/keys/k_nope").status_code == 404


def test_accounts_are_isolated(env: Env) -> None:
    c = env.client
    c.post("/v1/machines", json={"name": "mine"})
    r = c.post("/v1/keys", json={"name": "alice-key", "account": "alice"})  # admin may
    assert r.status_code == 201
    alice = TestClient(env.app, raise_server_exceptions=False)
    alice.headers["Authorization"] = f"Bearer {r.json()['secret']}"

    assert alice.get("/v1/machines").json()["machines"] == []
    r = alice.get("/v1/machines/mine")
    assert r.status_code == 404 and _error(r)["code"] == "machine_not_found"
    # Alice may not revoke, or even see, the local account's keys.
    local_key = c.get("/v1/keys").json()["keys"][0]["id"]
    assert alice.delete(f"/v1/keys/{local_key}").status_code == 404
    assert [k["name"] for k in alice.get("/v1/keys").json()["keys"]] == ["alice-key"]
    # ...nor create keys for another account; for her own account by name is fine.
    r = alice.post("/v1/keys", json={"name": "x", "account": "local"})
    assert r.status_code == 403 and _error(r)["details"]["field"] == "account"  # type: ignore[index]
    assert alice.post("/v1/keys", json={"name": "x", "account": "alice"}).status_code == 201
    # The admin may add keys to an existing account too; a bad account name is 400.
    assert c.post("/v1/keys", json={"name": "y", "account": "alice"}).status_code == 201
    assert c.post("/v1/keys", json={"name": "y", "account": "Not Valid"}).status_code == 400


def test_openapi_is_typed(env: Env) -> None:
    schema = env.client.get("/openapi.json").json()
    paths = schema["paths"]
    assert paths["/v1/machines"]["post"]["responses"]["201"]["content"]["application/json"][
        "schema"
    ] == {"$ref": "#/components/schemas/Machine"}
    for item in paths.values():
        for op in item.values():
            assert "422" not in op["responses"]
    assert "ErrorResponse" in schema["components"]["schemas"]
    assert paths["/v1/machines/{ref}"]["get"]["responses"]["404"]["content"]["application/json"][
        "schema"
    ] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "security" not in paths["/v1/health"]["get"]
    assert paths["/v1/machines"]["get"]["security"] == [{"apiKey": []}]


def test_error_bodies_never_name_daemon_files(env: Env, tmp_path: Path) -> None:
    """Defect 6: messages, hints and details keep the daemon's paths to its log."""
    from boxd.errors import IntegrityError, ResourceExhausted

    home = tmp_path  # the data directory holding upload_dir
    blob = home / "snapshots" / "blobs" / "sha256" / ("ab" * 32)

    async def corrupt(account: str, ref: str) -> object:
        raise IntegrityError(f"blob {blob} does not match", hint=f"delete {blob}",
                             digest="ab" * 32, path=str(blob))

    async def full(account: str) -> object:
        raise ResourceExhausted(f"disk full: could not write ({home}/disks/l_1.qcow2)")

    env.snapshots.get = corrupt  # type: ignore[method-assign]
    env.snapshots.list = full  # type: ignore[method-assign]
    for url in ("/v1/snapshots/env", "/v1/snapshots"):
        r = env.client.get(url)
        assert r.status_code >= 500
        assert str(home) not in r.text and "<boxd>" in r.text, r.text
    body = _error(env.client.get("/v1/snapshots/env"))
    assert body["details"] == {"digest": "ab" * 32}


@pytest.mark.parametrize(("body", "field"), [
    ({"command": "echo a\u0000b"}, "command"),
    ({"command": ["echo", "a\u0000b"]}, "command"),
    ({"command": []}, "command"),
    ({"command": "true", "env": {"A=B": "1"}}, "env"),
    ({"command": "true", "env": {"": "1"}}, "env"),
    ({"command": "true", "env": {"A": "x\u0000y"}}, "env"),
    ({"command": "pwd", "cwd": "/tmp\u0000/x"}, "cwd"),
    ({"command": "true", "timeout": 1e308}, "timeout"),
])
def test_exec_input_a_process_cannot_take_is_a_400(
    env: Env, body: dict[str, object], field: str
) -> None:
    """Defects 5 and 8: refused at the API, naming the field, never sent to the guest."""
    m = env.client.post("/v1/machines", json={"name": "m"}).json()
    r = env.client.post(f"/v1/machines/{m['id']}/exec", json=body)
    assert r.status_code == 400, r.text
    assert _error(r)["details"]["field"] == field  # type: ignore[index]


def test_key_names_refuse_control_characters(env: Env) -> None:
    r = env.client.post("/v1/keys", json={"name": "ci\u001b[31m"})
    assert r.status_code == 400 and _error(r)["details"]["field"] == "name"  # type: ignore[index]
    assert env.client.post("/v1/keys", json={"name": "ci runner"}).status_code == 201


def test_openapi_carries_the_exec_rules(env: Env) -> None:
    schema = env.client.get("/openapi.json").json()["components"]["schemas"]["ExecRequest"]
    text = json.dumps(schema)
    assert "\\\\x00" in text and "propertyNames" in text and "604800" in text


def test_a_machine_credential_counts_only_on_its_own_relayed_connection(env: Env) -> None:
    import hashlib

    from boxd.api.guest import _with_caller
    from boxd.services import GuestCaller

    secret = "boxdm_" + "x" * 32
    current: list[str | None] = [hashlib.sha256(secret.encode()).hexdigest()]
    caller = GuestCaller("m_1", env.local, lambda: current[0])
    other = GuestCaller("m_2", env.local, lambda: hashlib.sha256(b"boxdm_other").hexdigest())
    auth = {"Authorization": f"Bearer {secret}"}
    inside = TestClient(_with_caller(env.app, caller), raise_server_exceptions=False)
    assert inside.get("/v1/machines", headers=auth).status_code == 200
    # The daemon's own socket (no relayed caller) refuses it ...
    r = TestClient(env.app).get("/v1/machines", headers=auth)
    assert r.status_code == 401 and "own API socket" in str(_error(r)["message"])
    # ... and so does another machine's socket.
    r = TestClient(_with_caller(env.app, other)).get("/v1/machines", headers=auth)
    assert r.status_code == 401 and "current credential" in str(_error(r)["message"])
    # An account key still works from inside (BOXD_API_KEY in a guest wins).
    r = inside.get("/v1/machines", headers={"Authorization": f"Bearer {env.secret}"})
    assert r.status_code == 200
    for now in ("0" * 64, None):  # replaced (fork, restore, wake), revoked (delete)
        current[0] = now
        r = inside.get("/v1/machines", headers=auth)
        assert r.status_code == 401 and "current credential" in str(_error(r)["message"])


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/keys", {"name": "p"}),
    ("POST", "/v1/keys", {"name": "p", "account": "someone-else"}),
    ("GET", "/v1/keys", None),
    ("DELETE", "/v1/keys/k_1", None),
    ("GET", "/v1/accounts", None),
    ("GET", "/v1/accounts/local", None),
    ("PATCH", "/v1/accounts/local", {"max_machines": 1000}),
])
def test_a_machine_credential_administers_no_keys_or_accounts(
    env: Env, method: str, path: str, body: dict[str, object] | None
) -> None:
    """Round 3, defect 2: code in a machine (of the operator's own ``local`` account
    here) cannot mint a key that outlives the machine, nor use the operator's rights."""
    import hashlib

    from boxd.api.guest import _with_caller
    from boxd.services import GuestCaller

    secret = "boxdm_" + "y" * 32
    caller = GuestCaller("m_1", env.local, lambda: hashlib.sha256(secret.encode()).hexdigest())
    inside = TestClient(_with_caller(env.app, caller), raise_server_exceptions=False)
    before = env.client.get("/v1/keys").json()["keys"]
    r = inside.request(method, path, json=body, headers={"Authorization": f"Bearer {secret}"})
    assert r.status_code == 403, r.text
    err = _error(r)
    assert err["code"] == "forbidden" and "machine's credential" in str(err["message"])
    assert "BOXD_API_KEY" in str(err["hint"])
    # Nothing was made or changed.
    assert env.client.get("/v1/keys").json()["keys"] == before
    assert env.client.get("/v1/accounts/local").json()["max_machines"] != 1000
    # The same credential still does what a rollout needs.
    auth = {"Authorization": f"Bearer {secret}"}
    assert inside.get("/v1/machines", headers=auth).status_code == 200
    assert inside.post("/v1/machines", json={"name": "r"}, headers=auth).status_code == 201
