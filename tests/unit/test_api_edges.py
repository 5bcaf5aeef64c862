"""The API's edges: 405 answers name every method of the path, the schema states the
rules the routes enforce, names and key labels refuse what they must (issue 14, defect 8)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._support.api_fakes import Env

from boxd import models

_METHODS = ("get", "put", "post", "delete", "patch")


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    yield e
    e.client.close()
    e.db.close()


def _concrete(template: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", template)


def test_405_allow_names_every_method_of_the_path(api: Env) -> None:
    paths = api.client.get("/openapi.json").json()["paths"]
    def regex(template: str) -> re.Pattern[str]:
        return re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")

    for template in paths:
        path = _concrete(template)
        # /v1/snapshots/import is also /v1/snapshots/{ref}: both templates' methods.
        documented = {m.upper() for t, i in paths.items() if regex(t).match(path)
                      for m in i if m in _METHODS}
        wrong = next(m for m in ("PUT", "PATCH", "DELETE", "POST") if m not in documented)
        r = api.client.request(wrong, path)
        assert r.status_code == 405, (wrong, template)
        allow = {m.strip() for m in r.headers["allow"].split(",")}
        assert allow == documented, (template, r.headers["allow"])
        assert r.json()["error"]["code"] == "method_not_allowed"


def test_schema_states_the_name_rules(api: Env) -> None:
    schema = api.client.get("/openapi.json").json()
    comps = schema["components"]["schemas"]

    def string_of(prop: dict[str, object]) -> dict[str, object]:
        for option in prop.get("anyOf", [prop]):  # type: ignore[attr-defined]
            if option.get("type") == "string":
                return option  # type: ignore[no-any-return]
        raise AssertionError(prop)

    for model, field in [("MachineCreate", "name"), ("ForkRequest", "name"),
                         ("CheckpointCreate", "name"), ("SnapshotCreate", "name"),
                         ("ApiKeyCreate", "account")]:
        s = string_of(comps[model]["properties"][field])
        assert (s["pattern"], s["maxLength"]) == (models.NAME_PATTERN, 63), (model, field)
    names = comps["ForkBatchRequest"]["properties"]["names"]
    assert names["uniqueItems"] and names["maxItems"] == 64
    assert names["anyOf"][0]["items"]["pattern"] == models.NAME_PATTERN
    env = comps["ExecRequest"]["properties"]["env"]
    assert env["propertyNames"]["pattern"] == r"^[^=\x00]+$"
    params = {
        (path, p["name"]): p["schema"]
        for path, item in schema["paths"].items() for op in item.values()
        for p in op.get("parameters", [])
    }
    assert params[("/v1/machines/{ref}/files", "path")]["pattern"] == models.GUEST_PATH_PATTERN
    assert params[("/v1/snapshots/import", "name")]["pattern"] == models.NAME_PATTERN
    assert params[("/v1/machines/{ref}/checkpoints/{name}/restore", "name")]["pattern"] \
        == models.NAME_PATTERN


@pytest.mark.parametrize("name", ["abc\n", "a" * 64, "", "-a", "A", "a_b", "é"])
def test_bad_names_are_refused(api: Env, name: str) -> None:
    # "abc\n": Python's "$" also matches before a final newline.
    for path, body in [("/v1/machines", {"name": name}),
                       ("/v1/snapshots", {"machine": "m", "name": name}),
                       ("/v1/keys", {"account": name})]:
        r = api.client.post(path, json=body)
        assert r.status_code == 400, (path, name, r.text)
        assert r.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("label", ["a\x1b[31mred", "tab\there", "nul\x00", "del\x7f", "",
                                   "x" * 65])
def test_key_labels_refuse_control_characters(api: Env, label: str) -> None:
    r = api.client.post("/v1/keys", json={"name": label})
    assert r.status_code == 400 and r.json()["error"]["details"]["field"] == "name"


def test_key_for_another_account_is_forbidden_not_malformed(api: Env) -> None:
    alice = api.keys.create(api.keys.ensure_account("alice"), "a").secret
    r = api.client.post("/v1/keys", json={"account": "bob"},
                        headers={"Authorization": f"Bearer {alice}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = api.client.patch("/v1/accounts/alice", json={"max_machines": 9},
                         headers={"Authorization": f"Bearer {alice}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_schema_engine_names_are_the_registry_s() -> None:
    from boxd.engine.registry import ENGINES

    assert models.ENGINE_NAMES == ENGINES
