"""The unmodified ``e2b-code-interpreter`` SDK against a real daemon's E2B listener on
gVisor machines: template ``code-interpreter-v1`` (built on first use), boxd's own
``/execute`` service on guest port 49999, and requests for any other guest port
(docs/e2b.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests._support import ws_echo
from tests._support.daemon import Daemon
from tests._support.e2b import e2b_daemon

e2b = pytest.importorskip("e2b", reason="the dev extra installs the e2b SDK")
ci = pytest.importorskip("e2b_code_interpreter",
                         reason="the dev extra installs the code interpreter SDK")

pytestmark = pytest.mark.vm


#: The daemon's sandbox domain (BOXD_E2B_DOMAIN); .test never resolves: only the Host
#: header carries it here, as a wildcard DNS name in front of the listener would.
DOMAIN = "sbx.boxd.test"
#: The module's daemon (its pid, for the WebSocket relay's memory).
_DAEMON: list[Daemon] = []


@pytest.fixture(scope="module")
def e2b_env(daemon: Daemon) -> Iterator[dict[str, str]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BOXD_E2B_DOMAIN", DOMAIN)
        with e2b_daemon(daemon, "e2bci") as (d, exports):
            _DAEMON[:] = [d]
            yield exports


@pytest.fixture(scope="module")
def sbx(e2b_env: dict[str, str]) -> Iterator[object]:
    """One code interpreter sandbox: the first create builds the template."""
    start = time.monotonic()
    s = ci.Sandbox.create(timeout=900, request_timeout=1800)
    print(f"first code-interpreter-v1 create (template build): "
          f"{time.monotonic() - start:.1f} s")
    yield s
    with contextlib.suppress(Exception):
        s.kill()


def _headers(sandbox: object, port: int) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox.sandbox_id,  # type: ignore[attr-defined]
            "E2b-Sandbox-Port": str(port)}


def test_other_ports_reach_the_guest(e2b_env: dict[str, str]) -> None:
    """A request with another E2b-Sandbox-Port reaches that port in the guest (a Python
    http.server); a port nothing listens on is 502 "port is not open"; an unknown
    sandbox 502 "was not found"."""
    url = e2b_env["E2B_SANDBOX_URL"]
    s = e2b.Sandbox.create(timeout=300)
    try:
        s.commands.run("mkdir -p /tmp/www && echo hello-port > /tmp/www/hello.txt")
        s.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
        deadline = time.monotonic() + 60
        while True:
            r = httpx.get(f"{url}/hello.txt?x=1", headers=_headers(s, 8000), timeout=60)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (r.status_code, r.text) == (200, "hello-port\n")
        # get_host: <port>-<id>.<domain>, the domain the create answered
        host = s.get_host(8000)
        assert host == f"8000-{s.sandbox_id}.{DOMAIN}"
        r = httpx.get(f"{url}/hello.txt", headers={"Host": host}, timeout=60)
        assert (r.status_code, r.text) == (200, "hello-port\n")
        r = httpx.get(f"{url}/sandboxes", headers={"Host": host}, timeout=60)
        assert r.status_code == 404 and "Directory listing" not in r.text  # the guest's
        envd = s.get_host(49983)
        r = httpx.get(f"{url}/health", timeout=60, headers={
            "Host": envd, "X-Access-Token": s._envd_access_token})
        assert r.status_code in (200, 204)
        r = httpx.post(f"{url}/nothing", headers=_headers(s, 8000), content=b"x" * 100_000,
                       timeout=60)
        assert r.status_code == 501  # http.server has no POST: the guest's own answer
        r = httpx.get(f"{url}/", headers=_headers(s, 8001), timeout=120)
        assert r.status_code == 502 and "port is not open" in r.json()["message"]
        r = httpx.get(f"{url}/", headers={**_headers(s, 8000), "E2b-Sandbox-Port": "x"})
        assert r.status_code == 400
    finally:
        s.kill()
    r = httpx.get(f"{url}/hello.txt", headers=_headers(s, 8000), timeout=60)
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def _peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1])


def test_websockets_reach_the_guest(e2b_env: dict[str, str]) -> None:
    """A WebSocket to another port reaches the guest's server (a stdlib echo server,
    tests/_support/ws_echo.py) by the headers and by a <port>-<id>.<domain> Host: text
    and binary messages, the subprotocol the guest chose, the path, close codes both
    ways; a message over the bound (either way) closes with 1009 and the daemon's memory
    does not grow by it; a killed sandbox ends its WebSockets (1014); a closed port,
    envd's port, no sandbox and an unknown sandbox are refused with E2B's status and
    message, and a guest's own refusal passes as it is."""
    url = e2b_env["E2B_SANDBOX_URL"]
    ws_url = "ws" + url.removeprefix("http")
    where = urlsplit(url)
    s = e2b.Sandbox.create(timeout=300)
    try:
        s.files.write("/tmp/ws_echo.py", Path(ws_echo.__file__).read_text())
        s.commands.run("python3 /tmp/ws_echo.py 8765 /tmp/ws-closes.log", background=True)
        asyncio.run(_websocket_checks(s, ws_url, (where.hostname or "", where.port or 0)))
        closes = s.files.read("/tmp/ws-closes.log").splitlines()
        # The client's closes reached the guest; so did the over-the-bound ones (1009).
        assert closes[:2] == ["4001 bye", "1000 by host"]
        assert closes[2].startswith("1009 ") and all(c.startswith("1009 ") for c in closes[2:])
        asyncio.run(_killed_mid_connection(s, ws_url))
    finally:
        s.kill()
    with pytest.raises(InvalidStatus) as info:
        asyncio.run(_open(f"{ws_url}/", _headers(s, 8765)))
    assert info.value.response.status_code == 502
    assert "was not found" in json.loads(info.value.response.body or b"")["message"]


async def _killed_mid_connection(s: object, ws_url: str) -> None:
    """A sandbox killed under an open WebSocket ends it with 1014 (bad gateway)."""
    async with await _open(f"{ws_url}/", _headers(s, 8765)) as ws:
        await ws.send("still here")
        assert await ws.recv() == "still here"
        await asyncio.to_thread(s.kill)  # type: ignore[attr-defined]
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1014


async def _open(url: str, headers: dict[str, str], **kw: object) -> ClientConnection:
    return await connect(url, additional_headers=headers, proxy=None, open_timeout=120,
                         **kw)  # type: ignore[arg-type]


async def _refused(url: str, headers: dict[str, str]) -> tuple[int, str]:
    with pytest.raises(InvalidStatus) as info:
        await _open(url, headers)
    answer = info.value.response
    return answer.status_code, json.loads(answer.body or b"")["message"]


async def _websocket_checks(s: object, ws_url: str, listener: tuple[str, int]) -> None:
    deadline = time.monotonic() + 60
    while True:  # until the guest's server listens
        try:
            ws = await _open(f"{ws_url}/chat?room=1", _headers(s, 8765),
                             subprotocols=["nope", "echo.v1"], max_size=None,
                             origin="http://app.example")
            break
        except InvalidStatus:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
    async with ws:
        assert ws.subprotocol == "echo.v1"
        await ws.send("hello")
        assert await ws.recv() == "hello"
        await ws.send(b"\x00\xffbin")
        assert await ws.recv() == b"\x00\xffbin"
        big = bytes(range(256)) * 4096  # 1 MiB: within the bound, it passes
        await ws.send(big)
        assert await ws.recv() == big
        await ws.send("whoami")
        assert json.loads(await ws.recv()) == {
            "path": "/chat?room=1", "origin": "http://app.example", "protocol": "echo.v1"}
        await ws.close(4001, "bye")
    # <port>-<id>.<domain>: the Host names the sandbox's port (the listener's address
    # is where a wildcard DNS name would lead).
    host = s.get_host(8765)  # type: ignore[attr-defined]
    sock = socket.create_connection(listener)
    async with connect(f"ws://{host}/by-host", sock=sock, proxy=None) as ws:
        await ws.send("whoami")
        assert json.loads(await ws.recv())["path"] == "/by-host"
        await ws.send("close 4002 done")  # the guest's close reaches the client
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4002, "done")
    async with await _open(f"{ws_url}/", _headers(s, 8765)) as ws:
        await ws.close(1000, "by host")
    with pytest.raises(InvalidStatus) as info:  # the guest's refusal is the client's
        await _open(f"{ws_url}/deny", _headers(s, 8765))
    answer = info.value.response
    assert (answer.status_code, answer.body, answer.headers.get("x-why")) == (
        403, b"no way", "test")
    await _over_the_bound(s, ws_url)
    status, message = await _refused(f"{ws_url}/", _headers(s, 8766))
    assert status == 502 and "port is not open" in message
    status, message = await _refused(f"{ws_url}/", _headers(s, 49983))
    assert status == 404 and "no WebSocket" in message
    status, message = await _refused(f"{ws_url}/", {})
    assert status == 404 and "E2b-Sandbox-Id" in message


async def _over_the_bound(s: object, ws_url: str) -> None:
    """64 MiB messages, each way, against the 16 MiB bound: closed with 1009, and the
    daemon's peak memory grows by less than the bound (the client offers compression,
    which the listener declines: a small deflated frame cannot become a big message)."""
    pid = _DAEMON[0].server_pid()
    assert pid is not None
    before = _peak_rss_kib(pid)
    n = 64 * 1024 * 1024
    async with await _open(f"{ws_url}/", _headers(s, 8765), max_size=None) as ws:
        with contextlib.suppress(ConnectionClosed):
            await ws.send(bytes(n))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    async with await _open(f"{ws_url}/", _headers(s, 8765), max_size=None) as ws:
        await ws.send(f"big {n}")
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        assert "over the 16777216-byte limit" in closed.value.rcvd.reason
    grown = _peak_rss_kib(pid) - before
    print(f"the daemon's peak RSS grew by {grown} KiB over two 64 MiB messages")
    assert grown < 16 * 1024, f"the daemon's peak RSS grew by {grown} KiB"


def test_state_is_kept_between_cells(sbx) -> None:  # type: ignore[no-untyped-def]
    first = sbx.run_code("x = 1")
    assert first.error is None and first.results == []
    second = sbx.run_code("x + 1")
    assert second.text == "2" and second.error is None
    assert second.execution_count is not None and second.execution_count > \
        (first.execution_count or 0)


def test_stdout_stderr_and_errors(sbx) -> None:  # type: ignore[no-untyped-def]
    seen: list[str] = []
    ex = sbx.run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)",
                      on_stdout=lambda m: seen.append(m.line))
    assert ex.logs.stdout == ["out\n"] and ex.logs.stderr == ["err\n"]
    assert seen == ["out\n"]
    ex = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()")
    assert ex.error is not None
    assert (ex.error.name, ex.error.value) == ("ValueError", "bad value")
    assert "f()" in ex.error.traceback and "ValueError" in ex.error.traceback


def test_display_data_and_reprs(sbx) -> None:  # type: ignore[no-untyped-def]
    ex = sbx.run_code("from IPython.display import HTML, display\n"
                      "display(HTML('<b>bold</b>'))\n"
                      "{'a': [1, 2]}")
    shown, main = ex.results
    assert shown.html == "<b>bold</b>" and not shown.is_main_result
    assert main.is_main_result and main.text == "{'a': [1, 2]}"
    ex = sbx.run_code("import os\nos.environ.get('CI_VAR')", envs={"CI_VAR": "set"})
    assert ex.text == "'set'"
    assert sbx.run_code("os.environ.get('CI_VAR') is None").text == "True"


def test_contexts(sbx) -> None:  # type: ignore[no-untyped-def]
    """A context is a kernel of its own: its own state and working directory; restart
    forgets its state; remove ends it; an unknown one is the SDK's NotFoundException."""
    ctx = sbx.create_code_context(cwd="/tmp")
    assert (ctx.language, ctx.cwd) == ("python", "/tmp")
    sbx.run_code("y = 5", context=ctx)
    assert sbx.run_code("y * 2", context=ctx).text == "10"
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
    assert sbx.run_code("'y' in dir()").text == "False"  # the default context's
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    assert sbx.run_code("y", context=ctx).error.name == "NameError"
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(e2b.NotFoundException):
        sbx.run_code("1", context=ctx)
    with pytest.raises(e2b.NotFoundException):
        sbx.restart_code_context("no-such-context")
    with pytest.raises(e2b.NotFoundException):
        sbx.remove_code_context("no-such-context")
    with pytest.raises(e2b.SandboxException) as info:
        sbx.run_code("1", language="cobol")
    assert "400" in str(info.value) and "cobol" in str(info.value)


def test_timeout_interrupts_the_cell(sbx) -> None:  # type: ignore[no-untyped-def]
    """The SDK's timeout ends the request; the cell is interrupted, so the context takes
    the next cell at once."""
    with pytest.raises(e2b.TimeoutException):
        sbx.run_code("import time\ntime.sleep(120)", timeout=3)
    start = time.monotonic()
    assert sbx.run_code("'next'", timeout=60).text == "'next'"
    # not a speed bound: without the interrupt the cell would wait out the sleep (~2 min)
    assert time.monotonic() - start < 60


def test_a_dead_kernel_is_an_error_and_is_restarted(sbx) -> None:  # type: ignore[no-untyped-def]
    ctx = sbx.create_code_context()
    ex = sbx.run_code("import os\nos._exit(1)", context=ctx, timeout=60)
    assert ex.error is not None and "kernel died" in ex.error.value
    assert sbx.run_code("1 + 1", context=ctx).text == "2"
    sbx.remove_code_context(ctx)


def test_commands_still_work(sbx) -> None:  # type: ignore[no-untyped-def]
    assert sbx.commands.run("echo $((6 * 7))").stdout == "42\n"
    sbx.files.write("/home/user/data.txt", "from files")
    assert sbx.run_code("open('/home/user/data.txt').read()").text == "'from files'"


def test_async_sandbox_and_a_second_create(e2b_env: dict[str, str], sbx) -> None:  # type: ignore[no-untyped-def]
    """A later create of the template starts from the built snapshot (no new build): a
    fresh kernel, none of the first sandbox's state."""
    sbx.run_code("only_in_first = 1")

    async def run() -> tuple[str | None, str | None, float]:
        start = time.monotonic()
        s = await ci.AsyncSandbox.create(timeout=300)
        took = time.monotonic() - start
        try:
            a = await s.run_code("'only_in_first' in dir()")
            b = await s.run_code("21 * 2")
            return a.text, b.text, took
        finally:
            await s.kill()

    fresh, answer, took = asyncio.run(run())
    assert (fresh, answer) == ("False", "42")
    print(f"a later code-interpreter-v1 create: {took:.2f} s")
