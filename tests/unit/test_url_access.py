"""Who a machine's URL admits, and that the request which wakes it is served
(node/_proxy.py, docs/lifecycle.md#urls).

The node runtime and control plane run against the fake engine; the "guest's port
8080" is a real loopback server of the test's (the fake machines' ``open_http`` is
pointed at it), so every byte the guest would see is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from tests._support.fake_world import ACCOUNT, World, make_world

from boxd import models
from boxd.engine.fake import FakeMachine
from boxd.errors import InvalidRequest
from boxd.models import MachineState
from boxd.node._ports import free_port
from boxd.node._proxy import Access, PortProxy, Upstream

S = MachineState


class Guest:
    """A guest's port 8080: answers each request with its path, records what it saw."""

    def __init__(self) -> None:
        self.connections = 0
        self.seen: list[bytes] = []  # every byte received, per connection
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        got = bytearray()
        self.seen.append(b"")
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                got += head
                self.seen[-1] = bytes(got)
                path = head.split(b" ")[1]
                body = b"path=" + path
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
                await w.drain()
                if b"connection: close" in head.lower():
                    break
                if b"content-length: " in head.lower():
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r")[0])
                    got += await r.readexactly(length)
                    self.seen[-1] = bytes(got)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = make_world(tmp_path, monkeypatch)
    yield w
    w.repos.db.close()


def _point_at(
    monkeypatch: pytest.MonkeyPatch, guest: Guest, others: dict[int, Guest] | None = None
) -> None:
    """The fake machines' port 8080 is ``guest``, their port N ``others[N]``."""
    ports = {8080: guest, **(others or {})}

    async def open_http(
        self: FakeMachine, port: int = 8080
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if port not in ports:
            raise ConnectionRefusedError(f"nothing on guest port {port}")
        return await asyncio.open_connection("127.0.0.1", ports[port].port)

    monkeypatch.setattr(FakeMachine, "open_http", open_http)


async def _exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection and read until the proxy closes it."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    try:
        return await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()


async def _get(url: str, path: str = "/", timeout: float = 10.0) -> bytes:
    """One GET of ``url + path`` (connection: close); the whole answer."""
    u = urlsplit(url + path)
    target = u.path + (f"?{u.query}" if u.query else "")
    return await _exchange(
        u.port or 80, f"GET {target} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode(),
        timeout)


async def _machine(w: World, name: str = "web", public: bool = False) -> models.Machine:
    m = await w.machines.create(ACCOUNT, models.MachineCreate(name=name, public=public))
    return await w.machines.wait_until_ready(ACCOUNT, m.id, timeout=5)


def test_a_connection_without_the_token_gets_no_guest_bytes_and_wakes_nothing(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        guest = Guest()
        await guest.start()
        _point_at(monkeypatch, guest)
        m = await _machine(world)
        assert m.url and m.port and not m.public
        token = urlsplit(m.url).path.strip("/")
        assert len(token) == 32 and m.url == f"http://127.0.0.1:{m.port}/{token}"
        await world.machines.hibernate(ACCOUNT, m.id)
        bare = f"http://127.0.0.1:{m.port}"
        wrong = token[:-1] + ("0" if token[-1] != "0" else "1")
        for attempt in (
            b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",  # the bare URL
            f"GET /{wrong}/ HTTP/1.1\r\nhost: x\r\n\r\n".encode(),  # another token
            f"GET /x/{token} HTTP/1.1\r\nhost: x\r\n\r\n".encode(),  # not the first segment
            b"SSH-2.0-OpenSSH_9.2\r\n\r\n",  # not HTTP
            b"",  # nothing at all: the client half-closes at once
        ):
            r, w = await asyncio.open_connection("127.0.0.1", m.port)
            w.write(attempt)
            w.write_eof()
            got = await asyncio.wait_for(r.read(), 10)
            w.close()
            assert got.startswith(b"HTTP/1.1 404 "), (attempt, got)
            assert b"path=" not in got
        assert (await _get(bare, "/")).startswith(b"HTTP/1.1 404 ")
        assert guest.connections == 0  # the guest saw none of them
        assert world.state(m.id) == S.HIBERNATED  # and none of them woke it
        guest.server.close()  # type: ignore[union-attr]

    asyncio.run(main())


def test_with_the_token_the_request_is_served_with_its_own_path_and_wakes_the_machine(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        guest = Guest()
        await guest.start()
        _point_at(monkeypatch, guest)
        m = await _machine(world)
        assert m.url
        token = urlsplit(m.url).path.strip("/")
        await world.machines.hibernate(ACCOUNT, m.id)
        got = await _get(m.url, "/a/b?c=1")
        assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"path=/a/b?c=1")
        assert world.state(m.id) == S.RUNNING  # the request woke it
        assert (await _get(m.url, "")).endswith(b"path=/")  # the URL itself is the root
        # keep-alive: every request on the connection has the token taken out; one that
        # does not carry it (a browser's absolute link) passes as it is
        port = m.port or 0
        got = await _exchange(port, (
            f"GET /{token}/one HTTP/1.1\r\nhost: x\r\nreferer: {m.url}/one\r\n\r\n"
            f"POST /{token}/two HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello"
            f"GET /three HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").encode())
        assert got.count(b"HTTP/1.1 200 ") == 3
        assert b"path=/one" in got and b"path=/two" in got and b"path=/three" in got
        # a browser's request for the page's own absolute link, on a new connection:
        # admitted by its Referer
        got = await _exchange(port, (
            f"GET /style.css HTTP/1.1\r\nhost: x\r\nreferer: {m.url}/index.html\r\n"
            "connection: close\r\n\r\n").encode())
        assert got.endswith(b"path=/style.css")
        assert all(token.encode() not in seen for seen in guest.seen)  # never the token
        guest.server.close()  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_port_suffix_on_the_token_reaches_that_guest_port_and_nothing_else(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        web, api = Guest(), Guest()
        await web.start()
        await api.start()
        _point_at(monkeypatch, web, {8000: api})
        m = await _machine(world)
        assert m.url and m.port
        token = urlsplit(m.url).path.strip("/")
        url = m.url_for(8000)
        assert url == f"{m.url}.8000" and m.url_for() == m.url_for(8080) == m.url
        got = await _get(url, "/a?b=1")
        assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"path=/a?b=1")
        assert api.connections == 1 and web.connections == 0
        # a browser's absolute link from a page of port 8000 goes to port 8000
        got = await _exchange(m.port, (
            f"GET /app.js HTTP/1.1\r\nhost: x\r\nreferer: {url}/index.html\r\n"
            "connection: close\r\n\r\n").encode())
        assert got.endswith(b"path=/app.js") and api.connections == 2
        assert (await _get(m.url, "/x")).endswith(b"path=/x") and web.connections == 1
        # a port nothing listens on: the proxy says so (the machine answered before)
        assert (await _get(m.url_for(9000), "/")).startswith(b"HTTP/1.1 502 ")
        for suffix in ("0", "65536", "08000", "80a", "", "-1"):
            got = await _get(f"http://127.0.0.1:{m.port}/{token}.{suffix}", "/")
            assert got.startswith(b"HTTP/1.1 404 "), (suffix, got)
        assert api.connections == 2 and web.connections == 1
        for seen in web.seen + api.seen:
            assert token.encode() not in seen and b".8000" not in seen
        for bad in (0, 65536):
            with pytest.raises(InvalidRequest, match="not a TCP port"):
                m.url_for(bad)
        pub = await _machine(world, "pub", public=True)
        assert pub.url_for(8080) == pub.url
        with pytest.raises(InvalidRequest, match="public"):
            pub.url_for(8000)
        web.server.close()  # type: ignore[union-attr]
        api.server.close()  # type: ignore[union-attr]

    asyncio.run(main())


def test_after_delete_and_recreate_the_old_token_fails(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        guest = Guest()
        await guest.start()
        _point_at(monkeypatch, guest)
        old = await _machine(world, "same")
        assert old.url and (await _get(old.url)).startswith(b"HTTP/1.1 200 ")
        await world.machines.delete(ACCOUNT, old.id)
        new = await _machine(world, "same")
        assert new.url and new.url != old.url
        # the same port again, if the new machine got it, must still refuse the old token
        port = new.port or 0
        old_path = urlsplit(old.url).path
        got = await _exchange(
            port, f"GET {old_path}/ HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        assert got.startswith(b"HTTP/1.1 404 ")
        if old.port != new.port:  # the old machine's port serves nothing any more
            with contextlib.suppress(ConnectionError):
                assert not (await _get(old.url)).startswith(b"HTTP/1.1 200 ")
        before = guest.connections
        assert (await _get(new.url)).startswith(b"HTTP/1.1 200 ")
        assert guest.connections == before + 1
        guest.server.close()  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_public_machine_has_the_bare_url_and_relays_any_bytes(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        guest = Guest()
        await guest.start()
        _point_at(monkeypatch, guest)
        m = await _machine(world, public=True)
        assert m.public and m.url == f"http://127.0.0.1:{m.port}"
        await world.machines.hibernate(ACCOUNT, m.id)
        got = await _get(m.url, "/x")
        assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"path=/x")
        assert world.state(m.id) == S.RUNNING
        child = (await world.machines.fork(ACCOUNT, m.id, ["kid"]))[0]
        assert isinstance(child, models.Machine) and child.public  # a fork keeps it
        private = await _machine(world, "private")
        assert not private.public and private.url != f"http://127.0.0.1:{private.port}"
        guest.server.close()  # type: ignore[union-attr]

    asyncio.run(main())


# ----------------------------------------------------- the request that wakes it


async def _through_proxy(
    handler: object, request: bytes, process: object = "vm-1", answered_before: bool = False,
) -> tuple[bytes, int]:
    """``request`` through a public URL whose upstream runs ``handler``; the answer and
    how many upstream connections were opened."""
    opened = 0
    up = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    up_port = up.sockets[0].getsockname()[1]

    async def open_up(guest_port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        nonlocal opened
        assert guest_port == 8080  # a public machine's relay: always its port 8080
        opened += 1
        return await asyncio.open_connection("127.0.0.1", up_port)

    @contextlib.asynccontextmanager
    async def connect(machine_id: str) -> AsyncIterator[Upstream]:
        yield open_up

    proxy = PortProxy(connect, lambda mid: Access(None, True, process))
    if answered_before:
        proxy._answered["m"] = process
    port = free_port()
    assert await proxy.open("m", port)
    try:
        return await _exchange(port, request, timeout=20), opened
    finally:
        await proxy.close_all()
        up.close()


def _flaky(drops: int) -> object:
    """An upstream whose first ``drops`` connections end with no byte (passt into a
    guest that is not reachable yet), then answers with what it received."""
    calls = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal calls
        calls += 1
        if calls <= drops:
            w.close()
            return
        data = await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
        await w.drain()
        w.close()

    return handler


def test_the_request_that_finds_a_new_vm_process_unreachable_is_resent_and_served() -> None:
    request = b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n"
    got, opened = asyncio.run(_through_proxy(_flaky(2), request))
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(request), got
    assert opened == 3


def test_a_vm_process_that_answered_before_is_not_retried() -> None:
    """Once a process answered, a connection it ends with no byte ends the client's at
    once (the guest's server closed it: resending could repeat a request)."""
    got, opened = asyncio.run(_through_proxy(_flaky(1), b"GET / HTTP/1.1\r\n\r\n",
                                             answered_before=True))
    assert (got, opened) == (b"", 1)


def test_a_websocket_upgrade_is_relayed_byte_for_byte_after_the_token_is_checked(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def echo_ws(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await r.readuntil(b"\r\n\r\n")
        assert head.startswith(b"GET /ws ")
        w.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                b"connection: upgrade\r\n\r\n")
        while data := await r.read(1024):
            w.write(data)
            await w.drain()
        w.close()

    async def main() -> None:
        up = await asyncio.start_server(echo_ws, "127.0.0.1", 0)
        up_port = up.sockets[0].getsockname()[1]

        async def open_http(self: FakeMachine, port: int = 8080) -> tuple[
                asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection("127.0.0.1", up_port)

        monkeypatch.setattr(FakeMachine, "open_http", open_http)
        m = await _machine(world)
        assert m.url and m.port
        token = urlsplit(m.url).path.strip("/")
        r, w = await asyncio.open_connection("127.0.0.1", m.port)
        w.write(f"GET /{token}/ws HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\n"
                "upgrade: websocket\r\n\r\n".encode())
        await w.drain()
        assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101 ")
        frame = f"GET /{token}/not-http\r\n\r\n".encode()  # bytes after the upgrade: as sent
        w.write(frame)
        await w.drain()
        assert await asyncio.wait_for(r.readexactly(len(frame)), 5) == frame
        w.close()
        up.close()

    asyncio.run(main())


def test_httpx_and_websockets_clients_work_with_the_url_exactly_as_given(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """httpx with ``base_url=m.url``, and a WebSocket client on the URL turned ws:// with
    ``/ws`` appended (what OpenEnv's client does to its base URL)."""
    import httpx
    import websockets

    async def main() -> None:
        async def ws_echo(conn: websockets.ServerConnection) -> None:
            assert conn.request is not None
            async for msg in conn:
                await conn.send(f"{conn.request.path} {msg}")

        server = await websockets.serve(ws_echo, "127.0.0.1", 0)
        ws_port = server.sockets[0].getsockname()[1]
        guest = Guest()
        await guest.start()
        m_http = await _machine(world, "h")
        m_ws = await _machine(world, "w")
        ports = {m_http.id: guest.port, m_ws.id: ws_port}

        async def open_http(self: FakeMachine, port: int = 8080) -> tuple[
                asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection("127.0.0.1", ports[self.config.id])

        monkeypatch.setattr(FakeMachine, "open_http", open_http)
        assert m_http.url and m_ws.url
        async with httpx.AsyncClient(base_url=m_http.url) as client:
            for path in ("/reset", "/step", "/state?x=1"):
                got = await client.get(path)
                assert got.status_code == 200 and got.text == f"path={path}"
        ws_url = "ws://" + m_ws.url.rstrip("/")[len("http://"):] + "/ws"
        async with websockets.connect(ws_url) as ws:
            await ws.send("hi")
            assert await ws.recv() == "/ws hi"
        server.close()
        guest.server.close()  # type: ignore[union-attr]

    asyncio.run(main())


def _plain_machine(**kw: object) -> models.Machine:
    fields: dict[str, object] = {
        "id": "m-1", "name": "web", "state": MachineState.RUNNING, "vcpus": 1,
        "memory_mib": 256, "disk_gib": 1, "isolated": False, "created_at": 0.0,
        "port": 41000, "url": "http://127.0.0.1:41000/tok"}
    fields.update(kw)
    return models.Machine.model_validate(fields)


@pytest.mark.parametrize(("port", "why"), [
    (8000.0, "not float 8000.0"), (True, "not bool True"), (False, "not bool False"),
    ("80", "not str '80'"), ("http", "not str 'http'"), (None, "not NoneType"),
    (0, "port 0 is not a TCP port"), (65536, "port 65536 is not a TCP port"),
])
def test_url_for_refuses_what_is_not_a_tcp_port_with_a_typed_error(port: object,
                                                                    why: str) -> None:
    m = _plain_machine()
    with pytest.raises(InvalidRequest, match=why) as got:
        m.url_for(port)  # type: ignore[arg-type]
    assert got.value.details["field"] == "port"
    if port == "80":
        assert got.value.hint == "convert it first: int('80')"
    # the SDK's machines.url checks the port before it looks the machine up (the
    # address below answers nothing: a lookup would be a ConnectionError)
    from boxd.sdk import Boxd

    with Boxd(base_url="http://127.0.0.1:9") as boxd, pytest.raises(InvalidRequest, match=why):
        boxd.machines.url("web", port)  # type: ignore[arg-type]


def test_url_for_takes_any_integer_type() -> None:
    import numpy as np

    m = _plain_machine()
    assert m.url_for(np.int64(8000)) == m.url_for(8000) == "http://127.0.0.1:41000/tok.8000"  # type: ignore[arg-type]
    assert m.url_for(np.int32(8080)) == m.url  # type: ignore[arg-type]
