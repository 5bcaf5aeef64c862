"""The code interpreter's pieces without machines: the guest service's translation of
Jupyter messages and its HTTP answers (over contexts without a kernel: the guest has
ipykernel, this host need not), and the E2B app's routing of other guest ports
(tests/integration/test_e2b_interpreter.py runs the real SDK against real kernels)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from tests._support.api_fakes import FakeMachines

from boxd import models
from boxd.e2b.app import create_e2b_app
from boxd.e2b.env import to_e2b_key
from boxd.e2b.interpreter import server
from boxd.errors import AuthError

# -- translation ---------------------------------------------------------------------


def test_iopub_messages_become_the_sdks_lines() -> None:
    out = server.translate({"msg_type": "stream", "content": {"name": "stderr", "text": "e"}})
    assert out is not None and (out["type"], out["text"]) == ("stderr", "e")
    assert isinstance(out["timestamp"], int)
    assert server.translate({"msg_type": "execute_result", "content": {"data": {
        "text/plain": "2", "text/html": "<b>2</b>", "application/x-thing": {"a": 1}}}}) == {
        "type": "result", "is_main_result": True, "text": "2", "html": "<b>2</b>",
        "extra": {"application/x-thing": {"a": 1}}}
    shown = server.translate({"msg_type": "display_data",
                              "content": {"data": {"image/png": "iVBOR"}}})
    assert shown == {"type": "result", "is_main_result": False, "png": "iVBOR"}
    assert server.translate({"msg_type": "error", "content": {
        "ename": "ValueError", "evalue": "bad", "traceback": ["a", "b"]}}) == {
        "type": "error", "name": "ValueError", "value": "bad", "traceback": "a\nb"}
    assert server.translate({"msg_type": "execute_input",
                             "content": {"execution_count": 3}}) == {
        "type": "number_of_executions", "execution_count": 3}
    assert server.translate({"msg_type": "status", "content": {}}) is None


def test_env_vars_are_set_and_undone() -> None:
    set_env, reset_env = server.env_code({"A": "1", "B": "it's"})
    scope: dict[str, Any] = {}
    import os

    os.environ.pop("A", None)
    os.environ["B"] = "before"
    try:
        exec(set_env, scope)
        assert (os.environ["A"], os.environ["B"]) == ("1", "it's")
        exec(reset_env, scope)
        assert "A" not in os.environ and os.environ["B"] == "before"
    finally:
        os.environ.pop("B", None)


# -- the service's HTTP answers, over contexts without a kernel -------------------------


class _Script(server.Context):
    """A context whose cells print their code back; ``raise`` makes the cell fail."""

    def start(self) -> None:
        self.count = 0
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1

    def shutdown(self) -> None:
        pass

    def quiet(self, code: str) -> None:
        pass

    def run(self, code: str, gone: Callable[[], bool]) -> Iterator[server.Line]:
        if code == "boom":
            raise RuntimeError("the kernel died")
        self.count += 1
        yield {"type": "number_of_executions", "execution_count": self.count}
        yield {"type": "stdout", "text": code, "timestamp": 0}
        yield {"type": "end_of_execution"}


@pytest.fixture
def service() -> Iterator[str]:
    srv = server.serve(0, server.Contexts(_Script), host="127.0.0.1")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _lines(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in r.text.splitlines()]


def test_execute_streams_lines_and_contexts_are_kept(service: str) -> None:
    r = httpx.post(f"{service}/execute", json={"code": "x = 1"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    assert [line["type"] for line in _lines(r)] == [
        "number_of_executions", "stdout", "end_of_execution"]
    r = httpx.post(f"{service}/execute", json={"code": "x", "language": "Python"})
    assert _lines(r)[0]["execution_count"] == 2  # the same default context
    ctx = httpx.post(f"{service}/contexts", json={"cwd": "/tmp"}).json()
    assert (ctx["language"], ctx["cwd"]) == ("python", "/tmp")
    r = httpx.post(f"{service}/execute", json={"code": "y", "context_id": ctx["id"]})
    assert _lines(r)[0]["execution_count"] == 1
    listed = httpx.get(f"{service}/contexts").json()
    assert ctx in listed and len(listed) == 2
    assert httpx.post(f"{service}/contexts/{ctx['id']}/restart").status_code == 200
    assert httpx.delete(f"{service}/contexts/{ctx['id']}").status_code == 200
    assert ctx not in httpx.get(f"{service}/contexts").json()
    assert httpx.get(f"{service}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("method, path, body, status, words", [
    ("POST", "/execute", {"code": "1", "context_id": "nope"}, 404, "not found"),
    ("POST", "/contexts/nope/restart", None, 404, "not found"),
    ("DELETE", "/contexts/nope", None, 404, "not found"),
    ("POST", "/execute", {"code": 1}, 400, "code must be a string"),
    ("POST", "/execute", {"code": "1", "language": "cobol"}, 400, "cobol"),
    ("POST", "/execute", {"code": "1", "language": "python", "context_id": "x"}, 400,
     "not both"),
    ("POST", "/execute", {"code": "1", "env_vars": {"A": 1}}, 400, "env_vars"),
    ("POST", "/execute", [1], 400, "JSON object"),
    ("POST", "/contexts", {"cwd": "relative"}, 400, "absolute"),
    ("GET", "/nothing", None, 404, "no such path"),
    ("DELETE", "/contexts", None, 404, "no such path"),
])
def test_bad_input_is_a_clear_4xx(service: str, method: str, path: str, body: object,
                                  status: int, words: str) -> None:
    r = httpx.request(method, f"{service}{path}",
                      content=None if body is None else json.dumps(body))
    assert r.status_code == status and words in r.json()["error"]


def test_not_json_and_a_failing_kernel_are_answered(service: str) -> None:
    r = httpx.post(f"{service}/execute", content=b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    r = httpx.post(f"{service}/execute", json={"code": "boom"})
    # The head was sent: the failure is the cell's error line, and the stream ends well.
    assert r.status_code == 200
    assert _lines(r)[-1] == {"type": "error", "name": "InterpreterError",
                             "value": "RuntimeError: the kernel died", "traceback": ""}
    assert httpx.get(f"{service}/health").status_code == 200


# -- the E2B app: other ports --------------------------------------------------------


KEYS = {"boxd_alice": "acct-a"}
ALICE = {"X-API-KEY": to_e2b_key("boxd_alice")}


def _authenticate(secret: str | None) -> str:
    if secret not in KEYS:
        raise AuthError("unknown API key")
    return KEYS[secret]


class _Guest(BaseHTTPRequestHandler):
    """Stands in for a guest's server behind a machine URL: echoes what it got."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length")
        body = self.rfile.read(int(length)) if length else b""
        data = json.dumps({"path": self.path, "body": body.decode(),
                           "probe": self.headers.get("x-probe"),
                           "framing": self.headers.get("Transfer-Encoding")}).encode()
        self.send_response(201)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Guest", "yes")
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST


class _UrlMachines(FakeMachines):
    """FakeMachines whose machines have a URL (a local server standing in for the
    machine URL proxy) unless ``url`` is None."""

    url: str | None = None

    async def get(self, account: str, ref: str) -> models.Machine:
        m = await super().get(account, ref)
        return m.model_copy(update={"url": self.url})


@pytest.fixture
def e2b(tmp_path: Path) -> Iterator[tuple[TestClient, _UrlMachines, str]]:
    guest = ThreadingHTTPServer(("127.0.0.1", 0), _Guest)
    thread = threading.Thread(target=guest.serve_forever, daemon=True)
    thread.start()
    machines = _UrlMachines()
    app = create_e2b_app(machines, _authenticate, tmp_path / "e2b", domain="sbx.test")
    try:
        with TestClient(app) as client:
            yield client, machines, f"http://127.0.0.1:{guest.server_address[1]}/tok"
    finally:
        guest.shutdown()
        guest.server_close()


def test_other_ports_are_relayed_through_the_machine_url(
        e2b: tuple[TestClient, _UrlMachines, str]) -> None:
    client, machines, url = e2b
    r = client.post("/v2/sandboxes", json={}, headers=ALICE)
    assert r.status_code == 201 and r.json()["domain"] == "sbx.test"
    sid = r.json()["sandboxID"]
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000", "X-Probe": "p"}
    r = client.post("/a/b?q=1", content=b"payload", headers=headers)
    assert r.status_code == 502 and "no network" in r.json()["message"]  # no URL
    machines.url = url
    r = client.post("/a/b?q=1", content=b"payload", headers=headers)
    assert r.status_code == 201 and r.headers["x-guest"] == "yes"
    assert r.json() == {"path": "/tok.8000/a/b?q=1", "body": "payload", "probe": "p",
                        "framing": None}
    r = client.get("/empty", headers=headers)  # no body: none sent (not an empty chunked)
    assert r.status_code == 201 and r.json()["framing"] is None
    r = client.post("/sandboxes", content=b"x", headers={"Host": f"8000-{sid}.sbx.test"})
    assert r.status_code == 201 and r.json()["path"] == "/tok.8000/sandboxes"
    r = client.post("/x", content=b"x", headers={**headers, "E2b-Sandbox-Port": "99999"})
    assert r.status_code == 400 and "1-65535" in r.json()["message"]
    machines.url = "http://127.0.0.1:1/tok"  # nothing listens
    r = client.post("/x", content=b"x", headers=headers)
    assert r.status_code == 502 and "port is not open" in r.json()["message"]
    with contextlib.suppress(Exception):
        client.delete(f"/sandboxes/{sid}", headers=ALICE)
    r = client.post("/x", content=b"x", headers=headers)
    assert r.status_code == 502 and "was not found" in r.json()["message"]
    r = client.get("/x", headers={"Host": f"8000-{'0' * 20}.sbx.test"})
    assert r.status_code == 502 and "was not found" in r.json()["message"]
