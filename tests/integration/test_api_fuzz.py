"""Schemathesis against the real daemon (issue 14, "Keep it tested").

Two runs over the served schema, each request checked for no 5xx, status codes and
content types the schema lists, response bodies matching it, and schema-valid requests
accepted (positive data) / invalid ones refused:

- every operation with the key of an account whose quota is 0: no machine can be
  created, so it is cheap however many examples run (still bounded for CI);
- ``POST /v1/machines`` with a key of an account allowed 1 machine, a few examples,
  every machine it made deleted after its request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from tests._support.daemon import Daemon

pytestmark = pytest.mark.vm

_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
           response_schema_conformance, negative_data_rejection, positive_data_acceptance]


def _client(daemon: Daemon, secret: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)),
                        base_url="http://boxd", timeout=120,
                        headers={"Authorization": f"Bearer {secret}"})


def _account_key(daemon: Daemon, name: str, max_machines: int) -> str:
    with _client(daemon, (daemon.home / "local.key").read_text().strip()) as op:
        r = op.post("/v1/keys", json={"name": "fuzz", "account": name})
        assert r.status_code == 201, r.text
        r2 = op.patch(f"/v1/accounts/{name}", json={"max_machines": max_machines})
        assert r2.status_code == 200, r2.text
        return str(r.json()["secret"])


@pytest.fixture(scope="module")
def fuzz_api(daemon: Daemon) -> Iterator[tuple[Any, httpx.Client, httpx.Client]]:
    zero = _client(daemon, _account_key(daemon, "fuzz-zero", 0))
    one = _client(daemon, _account_key(daemon, "fuzz-one", 1))
    schema = schemathesis.openapi.from_dict(zero.get("/openapi.json").json())
    yield schema, zero, one
    for m in one.get("/v1/machines").json()["machines"]:
        one.delete(f"/v1/machines/{m['id']}")
    zero.close()
    one.close()


def _offline(case: schemathesis.Case) -> None:
    """Keep the daemon off the network: an image import from a registry names a closed
    loopback port instead of a generated host (no DNS query, no connection out)."""
    body = case.body
    if case.operation.path == "/v1/images" and isinstance(body, dict) \
            and str(body.get("source", "")).startswith("docker://"):
        body["source"] = "docker://127.0.0.1:9/fuzz:latest"
    # An egress entry may be a host name the daemon resolves (a DNS query out): each
    # becomes a documentation address (RFC 5737), which needs no lookup.
    if case.operation.path == "/v1/machines" and isinstance(body, dict) \
            and isinstance(body.get("egress"), list):
        body["egress"] = ["203.0.113.7"] * len(body["egress"])


def _send(client: httpx.Client, case: schemathesis.Case) -> httpx.Response:
    _offline(case)
    kw = case.as_transport_kwargs(base_url="http://boxd")
    body = kw.get("json")
    content = json.dumps(body).encode() if "json" in kw else kw.get("data")
    headers = {k: v for k, v in (kw.get("headers") or {}).items()
               if k.lower() != "authorization"}
    if "json" in kw:
        headers["Content-Type"] = "application/json"
    return client.request(kw["method"], kw["url"], params=kw.get("params"),
                          headers=headers, content=content)


def _unstatable(case: schemathesis.Case) -> bool:
    """Requests valid by the schema that break a rule JSON Schema cannot state."""
    if case.operation.path == "/v1/snapshots/import":
        return True  # the body must be a boxd export, not any bytes
    if case.operation.path == "/v1/machines" and (case.query or {}).get("cursor") is not None:
        return True  # a cursor must be a page's next_cursor, not any string
    body = case.body
    if case.operation.path == "/v1/machines" and isinstance(body, dict):
        ports = body.get("expose_host") or []
        if any(isinstance(p, int | float) and p >= 20000 for p in ports):
            # boxd's own port bands (from the host's ephemeral range); a JSON number
            # without a fraction (29395.0) is such a port too
            return True
        if body.get("isolated") and (ports or body.get("egress") is not None):
            return True  # an isolated machine has no network to apply them to
    if case.operation.path.endswith("/metrics"):
        query = case.query or {}
        start, end = query.get("start"), query.get("end")
        if isinstance(start, int | float) and isinstance(end, int | float) and start > end:
            return True  # a window whose start is after its end
    if case.operation.path.endswith("/fork/batch") and isinstance(body, dict):
        names, count = body.get("names"), body.get("count")
        return isinstance(names, list) and count is not None and count != len(names)
    return False


def _check(case: schemathesis.Case, response: httpx.Response) -> None:
    checks = [c for c in _CHECKS if not (_unstatable(case) and c is positive_data_acceptance)]
    case.validate_response(response, checks=checks)


def _run(schema: Any, client: httpx.Client, max_examples: int,
         path: str | None = None, method: str | None = None,
         prepare: Any = None, after: Any = None) -> int:
    """Run every selected operation's strategy; a failed check fails the test."""
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if (path is not None and op.path != path) or (
                method is not None and op.method.upper() != method):
            continue

        @settings(max_examples=max_examples, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(op.as_strategy())
        def one(case: schemathesis.Case) -> None:
            if prepare is not None:
                prepare(case)
            try:
                _check(case, _send(client, case))
            finally:
                if after is not None:
                    after()

        one()
        ran += 1
    return ran


def test_quota_zero_account(fuzz_api: tuple[Any, httpx.Client, httpx.Client]) -> None:
    schema, zero, _ = fuzz_api
    assert _run(schema, zero, max_examples=25) >= 30  # every operation of the schema


def test_machine_creation_bounded(fuzz_api: tuple[Any, httpx.Client, httpx.Client]) -> None:
    schema, _, one = fuzz_api

    def small(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict):
            # Small machines: this run checks the API, not how much the host holds.
            case.body.update(memory_mib=256, disk_gib=1, vcpus=1)

    def clean() -> None:
        for m in one.get("/v1/machines").json()["machines"]:
            one.delete(f"/v1/machines/{m['id']}")

    assert _run(schema, one, max_examples=4, path="/v1/machines", method="POST",
                prepare=small, after=clean) == 1
