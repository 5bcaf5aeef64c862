"""The E2B front door's pieces without machines: Connect envelopes, ids and keys, the
sandbox records, and the control and envd routes over the in-memory fake services
(tests/integration/test_e2b.py runs the real SDK against real machines)."""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse
from tests._support.api_fakes import FakeMachines

from boxd.e2b._connect import (
    END_STREAM,
    MAX_MESSAGE,
    ConnectError,
    decode_envelopes,
    encode_envelope,
    end_stream,
    read_envelopes,
)
from boxd.e2b._ids import is_sandbox_id, new_sandbox_id
from boxd.e2b._store import SandboxRecord, SandboxStore
from boxd.e2b.app import create_e2b_app
from boxd.e2b.env import from_e2b_key, to_e2b_key
from boxd.errors import AuthError

KEYS = {"boxd_alice": "acct-a", "boxd_bob": "acct-b"}


def _authenticate(secret: str | None) -> str:
    if secret not in KEYS:
        raise AuthError("unknown API key")
    return KEYS[secret]


def _split(body: bytes) -> list[tuple[int, dict[str, object]]]:
    out = []
    at = 0
    while at < len(body):
        flags, n = struct.unpack_from(">BI", body, at)
        out.append((flags, json.loads(body[at + 5:at + 5 + n])))
        at += 5 + n
    return out


# -- envelopes -----------------------------------------------------------------------


def test_envelope_round_trip() -> None:
    data = encode_envelope({"process": {"cmd": "ls"}}) + encode_envelope({"b": 1})
    assert data[:5] == struct.pack(">BI", 0, len(b'{"process":{"cmd":"ls"}}'))
    assert decode_envelopes(data) == [{"process": {"cmd": "ls"}}, {"b": 1}]
    assert decode_envelopes(b"") == []


def test_end_stream_carries_the_error() -> None:
    assert _split(end_stream()) == [(END_STREAM, {})]
    err = ConnectError("not_found", "no such process")
    assert _split(end_stream(err)) == [
        (END_STREAM, {"error": {"code": "not_found", "message": "no such process"}})]


@pytest.mark.parametrize("body, code, words", [
    (b"\x00\x00\x00", "invalid_argument", "fewer than 5"),
    (b"\x00\x00\x00\x00\x09{}", "invalid_argument", "9 bytes announced, 2 sent"),
    (b"\x01\x00\x00\x00\x02{}", "invalid_argument", "compressed"),
    (struct.pack(">BI", 0, MAX_MESSAGE + 1), "resource_exhausted", "limit"),
    (b"\x00\x00\x00\x00\x02[]", "invalid_argument", "JSON object"),
    (b"\x00\x00\x00\x00\x02{x", "invalid_argument", "not JSON"),
])
def test_malformed_envelopes_are_connect_errors(body: bytes, code: str, words: str) -> None:
    with pytest.raises(ConnectError) as info:
        decode_envelopes(body)
    assert info.value.code == code and words in info.value.message


# -- ids, keys, records ------------------------------------------------------------------


def test_a_client_stream_is_read_message_by_message() -> None:
    """StreamInput's body: each message as its envelope completes, however it is cut."""
    import asyncio

    body = encode_envelope({"a": 1}) + encode_envelope({"b": 2})

    async def read(chunks: list[bytes]) -> list[dict[str, object]]:
        async def gen() -> AsyncIterator[bytes]:
            for c in chunks:
                yield c
        return [m async for m in read_envelopes(gen())]

    cut = [body[i:i + 3] for i in range(0, len(body), 3)]
    assert asyncio.run(read(cut)) == [{"a": 1}, {"b": 2}]
    with pytest.raises(ConnectError, match="truncated"):
        asyncio.run(read([body[:-1]]))
    with pytest.raises(ConnectError) as info:
        asyncio.run(read([b"\x00\xff\xff\xff\xff"]))
    assert info.value.code == "resource_exhausted"


def test_sandbox_ids_are_e2b_shaped_machine_names() -> None:
    from boxd import models

    ids = {new_sandbox_id() for _ in range(200)}
    assert len(ids) == 200
    for i in ids:
        assert is_sandbox_id(i) and models.NAME_RE.match(i)
    assert not is_sandbox_id("ABCDEFGHIJKLMNOPQRST")
    assert not is_sandbox_id("a" * 21) and not is_sandbox_id("a" * 19 + "\n")


def test_e2b_key_spells_the_boxd_key() -> None:
    key = to_e2b_key("boxd_Ab-_9")
    assert key.startswith("e2b_") and set(key[4:]) <= set("0123456789abcdef")
    assert from_e2b_key(key) == "boxd_Ab-_9"
    assert from_e2b_key("boxd_Ab-_9") is None
    assert from_e2b_key("e2b_zz") is None and from_e2b_key("e2b_abc") is None
    assert from_e2b_key("e2b_ff") is None  # not UTF-8


def test_records_survive_a_new_store(tmp_path: Path) -> None:
    store = SandboxStore(tmp_path / "e2b")
    rec = SandboxRecord(sandbox_id="a" * 20, account="acct-a", template="base", token="t",
                        started_at=1.0, end_at=2.0, metadata={"k": "v"}, env_vars={"A": "1"})
    store.put(rec)
    (tmp_path / "e2b" / ("b" * 20 + ".json")).write_text("{not json")
    (tmp_path / "e2b" / ("c" * 20 + ".json")).write_text(json.dumps(
        {**rec.__dict__, "sandbox_id": "d" * 20}))  # a file named for another id
    again = SandboxStore(tmp_path / "e2b")
    assert again.all() == [rec]
    again.remove(rec.sandbox_id)
    assert SandboxStore(tmp_path / "e2b").get(rec.sandbox_id) is None
    assert oct((tmp_path / "e2b").stat().st_mode & 0o777) == "0o700"


# -- the routes over the fakes -----------------------------------------------------------


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[TestClient, FakeMachines]]:
    machines = FakeMachines()
    app = create_e2b_app(machines, _authenticate, tmp_path / "e2b")
    with TestClient(app) as client:
        yield client, machines


ALICE = {"X-API-KEY": to_e2b_key("boxd_alice")}
BOB = {"X-API-KEY": "boxd_bob"}


def _create(client: TestClient, headers: dict[str, str] = ALICE, **body: object) -> dict[
        str, object]:
    r = client.post("/v2/sandboxes", json=body, headers=headers)
    assert r.status_code == 201, r.text
    out: dict[str, object] = r.json()
    return out


def test_create_answers_e2bs_shape(api: tuple[TestClient, FakeMachines]) -> None:
    client, machines = api
    sb = _create(client, timeout=60, metadata={"a": "b"})
    assert set(sb) == {"sandboxID", "templateID", "clientID", "envdVersion",
                       "envdAccessToken"}
    assert sb["templateID"] == "base" and is_sandbox_id(str(sb["sandboxID"]))
    assert tuple(int(x) for x in str(sb["envdVersion"]).split(".")) >= (0, 1, 0)
    (name,) = [m.name for _, m in machines.machines.values()]
    assert name == sb["sandboxID"]  # the machine is named by the sandbox id
    info = client.get(f"/sandboxes/{sb['sandboxID']}", headers=ALICE).json()
    assert info["state"] == "running" and info["metadata"] == {"a": "b"}
    assert "envdAccessToken" in info


def test_a_create_without_timeout_lives_five_minutes(api: tuple[TestClient, FakeMachines]
                                                     ) -> None:
    """SDK 2.63 sends no timeout by default: the sandbox gets E2B's 300 s, not 15 s."""
    import datetime

    client, _ = api
    sid = _create(client)["sandboxID"]
    info = client.get(f"/sandboxes/{sid}", headers=ALICE).json()
    start, end = (datetime.datetime.fromisoformat(info[k]) for k in ("startedAt", "endAt"))
    assert (end - start).total_seconds() == pytest.approx(300, abs=1)


def test_errors_are_code_and_message(api: tuple[TestClient, FakeMachines]) -> None:
    client, _ = api
    sb = _create(client)
    r = client.get(f"/sandboxes/{sb['sandboxID']}", headers=BOB)
    assert (r.status_code, r.json()["code"]) == (404, 404)  # another account's
    r = client.delete(f"/sandboxes/{sb['sandboxID']}", headers=BOB)
    assert r.status_code == 404
    r = client.post("/v2/sandboxes", json={"timeout": -1}, headers=ALICE)
    assert (r.status_code, r.json()["code"]) == (400, 400)
    r = client.post("/v2/sandboxes", content=b"[1]", headers=ALICE)
    assert r.status_code == 400 and "object" in r.json()["message"]
    r = client.post("/v2/sandboxes", json={}, headers={"X-API-KEY": "e2b_00"})
    assert (r.status_code, r.json()["code"]) == (401, 401)
    r = client.get("/no/such/route", headers=ALICE)
    assert r.status_code == 404 and r.json()["code"] == 404


def test_list_filters_and_pages(api: tuple[TestClient, FakeMachines]) -> None:
    client, _ = api
    made = [_create(client, metadata={"job": "x"})["sandboxID"] for _ in range(3)]
    _create(client, metadata={"job": "y"})
    _create(client, BOB, metadata={"job": "x"})
    seen: list[object] = []
    token = None
    while True:
        params = {"metadata": "job=x", "limit": "2", **({"nextToken": token} if token else {})}
        r = client.get("/v2/sandboxes", params=params, headers=ALICE)
        assert r.status_code == 200
        seen += [s["sandboxID"] for s in r.json()]
        token = r.headers.get("x-next-token")
        if token is None:
            break
    assert sorted(map(str, seen)) == sorted(map(str, made))
    client.post(f"/sandboxes/{made[0]}/pause", headers=ALICE)
    r = client.get("/v2/sandboxes", params={"state": "paused"}, headers=ALICE)
    assert [s["sandboxID"] for s in r.json()] == [made[0]]
    assert len(client.get("/sandboxes", headers=ALICE).json()) == 3  # v1: running only
    r = client.get("/v2/sandboxes", params={"state": "gone"}, headers=ALICE)
    assert r.status_code == 400


def test_list_order_template_and_started_after(api: tuple[TestClient, FakeMachines]) -> None:
    """The JS SDK's list query: newest first unless order=asc, template and startedAfter
    filters; a bad value is a 400."""
    client, _ = api
    made = [_create(client)["sandboxID"] for _ in range(3)]
    listed = [s["sandboxID"] for s in client.get("/v2/sandboxes", headers=ALICE).json()]
    assert listed == made[::-1]
    r = client.get("/v2/sandboxes", params={"order": "asc"}, headers=ALICE)
    assert [s["sandboxID"] for s in r.json()] == made
    r = client.get("/v2/sandboxes", params={"template": "base"}, headers=ALICE)
    assert len(r.json()) == 3
    r = client.get("/v2/sandboxes", params={"template": "other"}, headers=ALICE)
    assert r.json() == []
    started = client.get(f"/sandboxes/{made[1]}", headers=ALICE).json()["startedAt"]
    r = client.get("/v2/sandboxes", params={"startedAfter": started, "order": "asc"},
                   headers=ALICE)
    assert [s["sandboxID"] for s in r.json()] == made[1:]
    for bad in ({"order": "up"}, {"startedAfter": "yesterday"}):
        r = client.get("/v2/sandboxes", params=bad, headers=ALICE)
        assert r.status_code == 400 and r.json()["code"] == 400


def test_pause_connect_and_fork(api: tuple[TestClient, FakeMachines]) -> None:
    client, _ = api
    sid = _create(client, envVars={"A": "1"})["sandboxID"]
    assert client.post(f"/sandboxes/{sid}/pause", headers=ALICE).status_code == 204
    assert client.post(f"/sandboxes/{sid}/pause", headers=ALICE).status_code == 409
    r = client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 30}, headers=ALICE)
    assert r.status_code == 201 and r.json()["sandboxID"] == sid  # woken
    r = client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 30}, headers=ALICE)
    assert r.status_code == 200
    r = client.post(f"/sandboxes/{sid}/fork", json={"count": 3}, headers=ALICE)
    assert r.status_code == 201
    kids = [item["sandbox"]["sandboxID"] for item in r.json()]
    assert len(set(kids)) == 3 and sid not in kids
    assert client.post(f"/sandboxes/{sid}/fork", json={"count": 0},
                       headers=ALICE).status_code == 400


def test_control_calls_with_sandbox_headers_reach_control(
        api: tuple[TestClient, FakeMachines]) -> None:
    """e2b 2.7-2.2x send E2b-Sandbox-Id/Port on POST /sandboxes/{id}/connect: a control
    path is the control API's whatever its headers say; envd paths still go to envd."""
    client, _ = api
    sid = _create(client)["sandboxID"]
    headers = {**ALICE, "E2b-Sandbox-Id": str(sid), "E2b-Sandbox-Port": "49983"}
    r = client.post(f"/sandboxes/{sid}/connect", json={"timeout": 30}, headers=headers)
    assert r.status_code == 200 and r.json()["sandboxID"] == sid
    assert client.get(f"/sandboxes/{sid}", headers=headers).json()["sandboxID"] == sid
    r = client.get(f"/sandboxes/{sid}", headers={**headers, "E2b-Sandbox-Port": "49999"})
    assert r.status_code == 200 and r.json()["sandboxID"] == sid
    r = client.post("/process.Process/List", json={}, headers=headers)
    assert r.status_code == 401  # envd's: no X-Access-Token


def test_an_envd_call_named_by_its_token_alone(api: tuple[TestClient, FakeMachines]) -> None:
    """e2b 2.7-2.25.0 send a connected sandbox's envd calls with X-Access-Token only:
    the token names the sandbox; a token of no sandbox is not routed to envd."""
    client, _ = api
    sb = _create(client)
    _create(client)  # another sandbox: its token is not this one's
    token = {"X-Access-Token": str(sb["envdAccessToken"])}
    r = client.post("/files", params={"path": "/t.txt"},
                    files={"file": ("t.txt", b"by token")}, headers=token)
    assert r.status_code == 200, r.text
    r = client.get("/files", params={"path": "/t.txt"}, headers=_envd(client, sb))
    assert r.content == b"by token"
    r = client.post("/process.Process/List", json={}, headers={"X-Access-Token": "nope"})
    assert r.status_code == 404 and r.json()["code"] == 404  # the control API's


def test_timeout_ends_the_sandbox(api: tuple[TestClient, FakeMachines]) -> None:
    """The reaper kills a sandbox at its end of life, and pauses one with autoPause."""
    client, machines = api
    killed = _create(client, timeout=0)["sandboxID"]
    paused = _create(client, timeout=0, autoPause=True)["sandboxID"]
    deadline = time.monotonic() + 10
    while True:
        states = {m.name: m.state.value for _, m in machines.machines.values()}
        if killed not in states and states.get(str(paused)) == "hibernated":
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.05)
    assert client.get(f"/sandboxes/{killed}", headers=ALICE).status_code == 404


def _envd(client: TestClient, sb: dict[str, object]) -> dict[str, str]:
    return {"E2b-Sandbox-Id": str(sb["sandboxID"]), "E2b-Sandbox-Port": "49983",
            "X-Access-Token": str(sb["envdAccessToken"])}


def test_process_start_streams_envelopes(api: tuple[TestClient, FakeMachines]) -> None:
    client, _ = api
    sb = _create(client)
    body = encode_envelope({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "hi"]}})
    r = client.post("/process.Process/Start", content=body, headers={
        **_envd(client, sb), "Content-Type": "application/connect+json"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/connect+json"
    frames = _split(r.content)
    assert "pid" in frames[0][1]["event"]["start"]  # type: ignore[index]
    out = b"".join(base64.b64decode(f[1]["event"]["data"]["stdout"])  # type: ignore[index]
                   for f in frames if "data" in f[1].get("event", {}))  # type: ignore[union-attr]
    assert out == b"/bin/bash -l -c hi 0\n/bin/bash -l -c hi 1\n/bin/bash -l -c hi 2\n"
    assert frames[-2][1]["event"]["end"] == {  # type: ignore[index]
        "exitCode": 0, "exited": True, "status": "exit status 0"}
    assert frames[-1] == (END_STREAM, {})


def _frames_until(lines: Iterator[bytes], buf: bytearray, count: int
                  ) -> list[tuple[int, dict[str, object]]]:
    """Read a response stream until ``count`` whole envelopes are in ``buf``."""
    while True:
        try:
            frames = _split(bytes(buf))
            if len(frames) >= count:
                return frames
        except (AssertionError, IndexError, ValueError, struct.error):
            pass
        buf += next(lines)


def test_interactive_commands_take_input(api: tuple[TestClient, FakeMachines]) -> None:
    """Start with stdin: true, then SendInput, StreamInput, Update (a pty's size) and
    CloseStdin reach the command in order; its output is its bytes (``pty`` data on a
    pty); a plain command refuses pty input."""
    client, _ = api
    sb = _create(client)
    headers = _envd(client, sb)
    stream_headers = {**headers, "Content-Type": "application/connect+json"}
    start = encode_envelope({"process": {"cmd": "cat"}, "stdin": True,
                             "pty": {"size": {"rows": 24, "cols": 80}}})
    with client.stream("POST", "/process.Process/Start", content=start,
                       headers=stream_headers) as r:
        lines = r.iter_bytes()
        buf = bytearray()
        pid = _frames_until(lines, buf, 1)[0][1]["event"]["start"]["pid"]  # type: ignore[index]
        sel = {"pid": pid}
        ok = client.post("/process.Process/SendInput", headers=headers, json={
            "process": sel, "input": {"pty": base64.b64encode(b"\x00one\n").decode()}})
        assert ok.status_code == 200, ok.text
        body = b"".join(encode_envelope(m) for m in [
            {"start": {"process": sel}},
            {"data": {"input": {"pty": base64.b64encode(b"two").decode()}}},
            {"keepalive": {}},
            {"data": {"input": {"pty": base64.b64encode(b"three").decode()}}}])
        streamed = client.post("/process.Process/StreamInput", content=body,
                               headers=stream_headers)
        assert _split(streamed.content) == [(0, {}), (END_STREAM, {})]
        assert client.post("/process.Process/Update", headers=headers, json={
            "process": sel, "pty": {"size": {"rows": 50, "cols": 120}}}).status_code == 200
        assert client.post("/process.Process/CloseStdin", headers=headers,
                           json={"process": sel}).status_code == 200
        frames = _split(bytes(buf) + b"".join(lines))
    out = b"".join(base64.b64decode(f[1]["event"]["data"]["pty"])  # type: ignore[index]
                   for f in frames if "data" in f[1].get("event", {}))  # type: ignore[union-attr]
    assert out == b"size 24 80\n\x00one\ntwothreesize 50 120\n"
    assert frames[-2][1]["event"]["end"]["exitCode"] == 0  # type: ignore[index]
    # pty input or a size for a command without a pty: refused; a closed stdin: refused
    plain = encode_envelope({"process": {"cmd": "echo"}, "stdin": True})
    with client.stream("POST", "/process.Process/Start", content=plain,
                       headers=stream_headers) as r:
        lines = r.iter_bytes()
        pid = _frames_until(lines, bytearray(), 1)[0][1]["event"]["start"][  # type: ignore[index]
            "pid"]
        bad = client.post("/process.Process/SendInput", headers=headers, json={
            "process": {"pid": pid}, "input": {"pty": "eA=="}})
        assert bad.status_code == 400 and bad.json()["code"] == "failed_precondition"
        bad = client.post("/process.Process/Update", headers=headers, json={
            "process": {"pid": pid}, "pty": {"size": {"rows": 5, "cols": 5}}})
        assert bad.json()["code"] == "failed_precondition"
        client.post("/process.Process/CloseStdin", headers=headers,
                    json={"process": {"pid": pid}})
        again = client.post("/process.Process/CloseStdin", headers=headers,
                            json={"process": {"pid": pid}})
        assert again.json()["code"] in ("failed_precondition", "not_found")
        b"".join(lines)


def test_envd_requests_are_checked(api: tuple[TestClient, FakeMachines]) -> None:
    client, _ = api
    sb = _create(client)
    headers = _envd(client, sb)
    r = client.post("/process.Process/List", json={}, headers={**headers,
                                                                "X-Access-Token": "x"})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = client.post("/process.Process/Start", content=b"\x00\x00\x00",
                    headers={**headers, "Content-Type": "application/connect+json"})
    assert r.status_code == 200
    assert _split(r.content)[0][1]["error"]["code"] == "invalid_argument"  # type: ignore[index]
    r = client.post("/process.Process/SendInput", json={}, headers=headers)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = client.post("/process.Process/SendInput", json={
        "process": {"pid": 99999}, "input": {"stdin": "aGk="}}, headers=headers)
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = client.post("/process.Process/SendInput", json={
        "process": {"pid": 1}, "input": {"stdin": "not base64!"}}, headers=headers)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = client.post("/process.Process/Update", json={
        "process": {"pid": 1}, "pty": {"size": {"rows": 0, "cols": 80}}}, headers=headers)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = client.post("/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": "nope"},
                    headers=headers)
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = client.get("/health", headers={**headers, "E2b-Sandbox-Port": "8080"})
    assert r.status_code == 502 and "port is not open" in r.json()["message"]
    client.delete(f"/sandboxes/{sb['sandboxID']}", headers=ALICE)
    r = client.get("/health", headers=headers)
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_websockets_are_refused_as_requests_are(
        api: tuple[TestClient, FakeMachines]) -> None:
    """A WebSocket that names no sandbox, envd's port, no port, a port that does not
    answer, or a sandbox that is gone gets an HTTP denial with E2B's status and message
    (tests/integration/test_e2b_interpreter.py relays them to a guest's server)."""
    client, _ = api
    sb = _create(client)
    headers = {**_envd(client, sb), "E2b-Sandbox-Port": "8080"}

    def denied(extra: dict[str, str]) -> tuple[int, str]:
        with pytest.raises(WebSocketDenialResponse) as info, \
                client.websocket_connect("/ws", headers={**headers, **extra}):
            pass
        return info.value.status_code, str(info.value.json()["message"])

    with pytest.raises(WebSocketDenialResponse) as info, \
            client.websocket_connect("/sandboxes"):
        pass
    assert info.value.status_code == 404 and "E2b-Sandbox-Id" in info.value.json()["message"]
    status, message = denied({"E2b-Sandbox-Port": "49983"})
    assert status == 404 and "no WebSocket" in message
    status, message = denied({"E2b-Sandbox-Port": "x"})
    assert status == 400
    status, message = denied({})
    assert status == 502 and "port is not open" in message
    client.delete(f"/sandboxes/{sb['sandboxID']}", headers=ALICE)
    status, message = denied({})
    assert status == 502 and "was not found" in message


def test_files_round_trip(api: tuple[TestClient, FakeMachines]) -> None:
    client, _ = api
    sb = _create(client)
    headers = _envd(client, sb)
    r = client.post("/files", params={"path": "dir/a.txt", "username": "user"},
                    files={"file": ("dir/a.txt", b"hello")}, headers=headers)
    assert r.status_code == 200
    assert r.json() == [{"name": "a.txt", "type": "file", "path": "/home/user/dir/a.txt"}]
    r = client.get("/files", params={"path": "/home/user/dir/a.txt"}, headers=headers)
    assert r.content == b"hello"
    r = client.post("/files", params={"path": "/b.bin"}, content=b"\x00\x01",
                    headers={**headers, "Content-Type": "application/octet-stream"})
    assert r.json()[0]["path"] == "/b.bin"
    r = client.get("/files", params={"path": "/nope"}, headers=headers)
    assert r.status_code == 404 and r.json()["code"] == 404


def test_a_paused_sandbox_outlives_its_timeout(api: tuple[TestClient, FakeMachines]) -> None:
    """On E2B a paused sandbox's timeout stops; connect starts a new one."""
    client, machines = api
    sid = _create(client, timeout=1)["sandboxID"]
    assert client.post(f"/sandboxes/{sid}/pause", headers=ALICE).status_code == 204
    time.sleep(1.5)
    assert client.get(f"/sandboxes/{sid}", headers=ALICE).json()["state"] == "paused"
    r = client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 1}, headers=ALICE)
    assert r.status_code == 201
    deadline = time.monotonic() + 10
    while sid in [m.name for _, m in machines.machines.values()]:
        assert time.monotonic() < deadline, "the woken sandbox outlived its new timeout"
        time.sleep(0.05)


def test_ended_commands_leave_no_table_behind(tmp_path: Path) -> None:
    """Memory stays bounded: a sandbox whose commands all ended holds no process table."""
    app = create_e2b_app(FakeMachines(), _authenticate, tmp_path / "e2b")
    with TestClient(app) as client:
        sb = _create(client)
        body = encode_envelope({"process": {"cmd": "true"}})
        for _ in range(3):
            r = client.post("/process.Process/Start", content=body, headers={
                **_envd(client, sb), "Content-Type": "application/connect+json"})
            assert _split(r.content)[-1] == (END_STREAM, {})
        assert app.state.e2b.processes._procs == {}


def test_snapshots_are_boxd_snapshots(tmp_path: Path) -> None:
    """create_snapshot -> a boxd snapshot version; list by sandbox; create from its id;
    delete it through DELETE /templates/{id}."""
    from tests._support.api_fakes import FakeSnapshots

    machines = FakeMachines()
    snapshots = FakeSnapshots(machines, tmp_path)
    app = create_e2b_app(machines, _authenticate, tmp_path / "e2b", snapshots)
    with TestClient(app) as client:
        sid = _create(client)["sandboxID"]
        r = client.post(f"/sandboxes/{sid}/snapshots", json={"name": "env-v1"}, headers=ALICE)
        assert r.status_code == 201 and r.json() == {"snapshotID": "env-v1@1",
                                                     "names": ["env-v1"]}
        r = client.post(f"/sandboxes/{sid}/snapshots", json={"name": "Bad Name"},
                        headers=ALICE)
        assert r.status_code == 400
        listed = client.get("/snapshots", params={"sandboxID": sid}, headers=ALICE).json()
        assert listed == [{"snapshotID": "env-v1@1", "names": ["env-v1"]}]
        assert client.get("/snapshots", headers=BOB).json() == []
        child = _create(client, templateID="env-v1@1")
        assert child["templateID"] == "env-v1@1"
        assert client.delete("/templates/env-v1@1", headers=BOB).status_code == 404
        assert client.delete("/templates/env-v1@1", headers=ALICE).status_code == 204
        assert client.delete("/templates/env-v1@1", headers=ALICE).status_code == 404


def test_idempotency_key_makes_one_sandbox(api: tuple[TestClient, FakeMachines]) -> None:
    client, machines = api
    first = _create(client, {**ALICE, "Idempotency-Key": "job-1"})
    again = _create(client, {**ALICE, "Idempotency-Key": "job-1"})
    assert again["sandboxID"] == first["sandboxID"]
    assert len(machines.machines) == 1
    other = _create(client, {**BOB, "Idempotency-Key": "job-1"})  # another account's key
    assert other["sandboxID"] != first["sandboxID"]
    client.delete(f"/sandboxes/{first['sandboxID']}", headers=ALICE)
    fresh = _create(client, {**ALICE, "Idempotency-Key": "job-1"})  # the first is gone
    assert fresh["sandboxID"] != first["sandboxID"]


def test_signed_file_urls_name_their_sandbox(api: tuple[TestClient, FakeMachines]) -> None:
    """E2B's download_url / upload_url: no header names the sandbox, the signature (made
    with its envdAccessToken, as the SDK's own get_signature makes it) does; a wrong, an
    expired or a missing one is envd's 401."""
    get_signature = pytest.importorskip("e2b.sandbox.signature").get_signature
    client, _ = api
    sb = _create(client)
    _create(client)  # another sandbox: its token signs nothing of this one's
    token = str(sb["envdAccessToken"])

    def signed(path: str, op: str, expires: int | None = None, **extra: str) -> dict[str, str]:
        sig = get_signature(path, op, extra.get("username"), token, expires)
        params = {"path": path, "signature": sig["signature"], **extra}
        if sig["expiration"] is not None:
            params["signature_expiration"] = str(sig["expiration"])
        return params

    r = client.post("/files", params=signed("up/s.txt", "write", 60),
                    files={"file": ("s.txt", b"signed upload")})
    assert r.status_code == 200, r.text
    assert r.json()[0]["path"] == "/home/user/up/s.txt"
    r = client.get("/files", params=signed("up/s.txt", "read"))
    assert r.status_code == 200 and r.content == b"signed upload"
    r = client.get("/files", params=signed("up/s.txt", "read", username="root"))
    assert r.content == b"signed upload"  # the username is part of what is signed
    # a write signature does not read; another path, user or token is not this one's
    for params in (signed("up/s.txt", "write"), {**signed("up/s.txt", "read"), "path": "x"},
                   {**signed("up/s.txt", "read"), "username": "root"},
                   {"path": "up/s.txt", "signature": "v1_bm9wZQ"}):
        r = client.get("/files", params=params)
        assert (r.status_code, r.json()) == (401, {"code": 401,
                                                   "message": "invalid signature"}), params
    expired = signed("up/s.txt", "read", -10)
    r = client.get("/files", params=expired)
    assert (r.status_code, r.json()["message"]) == (401, "signature is already expired")
    r = client.get("/files", params={"path": "up/s.txt"})
    assert r.status_code == 401 and "access token" in r.json()["message"]
    # with the sandbox header (BOXD_E2B_DOMAIN's host names set it too), the same checks
    named = {"E2b-Sandbox-Id": str(sb["sandboxID"])}
    assert client.get("/files", params=signed("up/s.txt", "read"),
                      headers=named).content == b"signed upload"
    r = client.get("/files", params=expired, headers=named)
    assert (r.status_code, r.json()["message"]) == (401, "signature is already expired")
    r = client.get("/files", params={"path": "up/s.txt"}, headers=named)
    assert r.status_code == 401 and "missing signature" in r.json()["message"]
    # a token sent with it is judged alone, as envd does
    r = client.get("/files", params=signed("up/s.txt", "read"),
                   headers={**named, "X-Access-Token": "wrong"})
    assert r.status_code == 401


def test_metrics_answer_e2bs_shape(api: tuple[TestClient, FakeMachines]) -> None:
    client, _ = api
    sb = _create(client)
    r = client.get(f"/sandboxes/{sb['sandboxID']}/metrics", headers=ALICE)
    assert r.status_code == 200, r.text
    [m] = r.json()
    assert set(m) == {"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed",
                      "memTotal", "memCache", "diskUsed", "diskTotal"}
    assert m["cpuUsedPct"] == 12.5 and m["timestamp"].endswith("Z")
    later = m["timestampUnix"] + 1
    assert client.get(f"/sandboxes/{sb['sandboxID']}/metrics", params={"start": later},
                      headers=ALICE).json() == []
    assert len(client.get(f"/sandboxes/{sb['sandboxID']}/metrics",
                          params={"end": m["timestampUnix"]}, headers=ALICE).json()) == 1
    r = client.get("/sandboxes/metrics", params={"sandbox_ids": f"{sb['sandboxID']},nope"},
                   headers=ALICE)
    assert list(r.json()["sandboxes"]) == [sb["sandboxID"]]
    r = client.get(f"/sandboxes/{sb['sandboxID']}/metrics", headers=BOB)
    assert r.status_code == 404  # another account's
    r = client.get(f"/sandboxes/{sb['sandboxID']}/metrics", params={"start": "soon"},
                   headers=ALICE)
    assert r.status_code == 400
    client.post(f"/sandboxes/{sb['sandboxID']}/pause", headers=ALICE)
    assert client.get(f"/sandboxes/{sb['sandboxID']}/metrics", headers=ALICE).json() == []


def test_network_on_create_is_boxd_s_egress_allow_list(
        api: tuple[TestClient, FakeMachines]) -> None:
    """E2B's deny-all-but-allowOut is boxd's egress allow-list; no denyOut is the
    default; a deny-list, unsupported fields and update_network are clear 400s."""
    client, machines = api

    def egress(network: object) -> object:
        sb = _create(client, network=network)
        (m,) = [m for _, m in machines.machines.values() if m.name == sb["sandboxID"]]
        return m.egress

    assert egress({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1", "8.8.8.0/24"]}) \
        == ["1.1.1.1/32", "8.8.8.0/24"]
    assert egress({"denyOut": ["0.0.0.0/0"]}) == []
    assert egress({"allowOut": ["1.1.1.1"]}) is None  # nothing denied: all allowed
    for network, words in (({"denyOut": ["1.1.1.1"]}, "allow-list"),
                           ({"rules": {"x": [1]}}, "network.rules"),
                           ({"allowOut": "1.1.1.1"}, "list of addresses")):
        r = client.post("/v2/sandboxes", json={"network": network}, headers=ALICE)
        assert r.status_code == 400 and words in r.json()["message"], r.text
    sb = _create(client)
    r = client.put(f"/sandboxes/{sb['sandboxID']}/network", json={"allowOut": []},
                   headers=ALICE)
    assert r.status_code == 400 and "cannot be changed" in r.json()["message"]
    r = client.put(f"/sandboxes/{sb['sandboxID']}/network", json={}, headers=BOB)
    assert r.status_code == 404
