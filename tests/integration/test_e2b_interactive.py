"""The unmodified ``e2b`` SDK's interactive calls against a real daemon on gVisor: a
command's stdin (``send_stdin``, ``stream_input``, ``close_stdin``), PTYs (``sbx.pty``:
create, input, resize, kill) and ``files.watch_dir``, sync and async (docs/e2b.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest

from tests._support.daemon import Daemon
from tests._support.e2b import e2b_daemon
from tests.integration.test_bounded_memory import GROWTH_BOUND, MIB, _peak_rss

e2b = pytest.importorskip("e2b", reason="the dev extra installs the e2b SDK")

pytestmark = pytest.mark.vm


_DAEMON: list[Daemon] = []


@pytest.fixture(scope="module")
def e2b_env(daemon: Daemon) -> Iterator[dict[str, str]]:
    with e2b_daemon(daemon, "e2b-interactive") as (d, exports):
        _DAEMON[:] = [d]
        yield exports


@pytest.fixture(scope="module")
def sbx(e2b_env: dict[str, str]) -> Iterator[object]:
    s = e2b.Sandbox.create(timeout=600)
    yield s
    with contextlib.suppress(Exception):
        s.kill()


def _pty_text(handle: object, until: str, timeout: float = 60) -> str:
    """A sync PTY handle's output until ``until`` shows (the handle yields
    (stdout, stderr, pty) triples)."""
    seen = b""
    deadline = time.monotonic() + timeout
    for _, _, pty in handle:  # type: ignore[attr-defined]
        if pty is not None:
            seen += bytes(pty)
        if until.encode() in seen or time.monotonic() > deadline:
            break
    return seen.decode(errors="replace")


def test_send_stdin_and_close_stdin(sbx) -> None:  # type: ignore[no-untyped-def]
    """A command started with stdin=True reads what send_stdin sends, and ends at
    close_stdin; a command without stdin=True keeps /dev/null."""
    h = sbx.commands.run("cat; echo done", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    sbx.commands.send_stdin(h.pid, b"\x00bytes\xff\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.exit_code == 0
    assert r.stdout.encode("utf-8", "surrogateescape").startswith(b"hello\n\x00bytes")
    assert r.stdout.endswith("done\n")
    # stream_input: the chunks in order over one client stream
    h = sbx.commands.run("head -c 9", background=True, stdin=True)
    sbx.commands.stream_input(h.pid, ["abc", b"def", "ghi"])
    assert h.wait().stdout == "abcdefghi"
    # without stdin=True: stdin is /dev/null (cat ends at once), sends are refused
    assert sbx.commands.run("cat; echo eof").stdout == "eof\n"
    h = sbx.commands.run("sleep 30", background=True)
    with pytest.raises(e2b.SandboxException, match="stdin"):
        sbx.commands.send_stdin(h.pid, "x")
    sbx.commands.kill(h.pid)


def test_send_stdin_to_an_unknown_pid_is_not_found(sbx) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(e2b.NotFoundException):
        sbx.commands.send_stdin(987654, "x")
    with pytest.raises(e2b.NotFoundException):
        sbx.commands.close_stdin(987654)
    with pytest.raises(e2b.NotFoundException):
        sbx.pty.resize(987654, e2b.PtySize(rows=10, cols=10))
    assert sbx.pty.kill(987654) is False
    assert sbx.commands.run("echo alive").stdout == "alive\n"  # nothing broke


def test_pty_create_input_resize_kill(sbx) -> None:  # type: ignore[no-untyped-def]
    h = sbx.pty.create(e2b.PtySize(rows=24, cols=80), envs={"PS1": "$ "})
    sbx.pty.send_stdin(h.pid, b"stty size; tty\n")
    out = _pty_text(h, "/dev/pts/")
    assert "24 80" in out and "/dev/pts/" in out, out
    sbx.pty.resize(h.pid, e2b.PtySize(rows=40, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size\n")
    assert "40 100" in _pty_text(h, "40 100")
    # a second client connects to the running pty and sees its output from then on
    again = sbx.pty.connect(h.pid)
    sbx.pty.stream_input(h.pid, [b"echo con$((6", b"*7))nected\n"])
    assert "con42nected" in _pty_text(again, "con42nected")  # the output, not the echo
    again.disconnect()
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.pty.kill(h.pid) is True
    with pytest.raises(e2b.CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sbx.commands.list()]
    # a pty's input is refused on a plain command
    plain = sbx.commands.run("sleep 30", background=True, stdin=True)
    with pytest.raises(e2b.SandboxException, match="pty"):
        sbx.pty.resize(plain.pid, e2b.PtySize(rows=10, cols=10))
    sbx.commands.kill(plain.pid)


def test_a_pty_runs_as_e2bs_user_or_the_one_named(sbx) -> None:  # type: ignore[no-untyped-def]
    h = sbx.pty.create(e2b.PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(h.pid, b"echo who-$(whoami)-$HOME-$PWD\n")
    assert "who-user-/home/user-/home/user" in _pty_text(h, "who-user-")
    sbx.pty.kill(h.pid)
    h = sbx.pty.create(e2b.PtySize(rows=24, cols=80), user="root")
    sbx.pty.send_stdin(h.pid, b"echo who-$(whoami)\n")
    assert "who-root" in _pty_text(h, "who-root")
    sbx.pty.kill(h.pid)


def test_a_flooding_pty_nobody_reads_holds_the_command_not_the_daemon(sbx) -> None:  # type: ignore[no-untyped-def]
    """`yes` on a pty whose client reads nothing: flow control holds the command in
    the guest (agent window, the shim's queue, the HTTP stream), so the daemon's memory
    stays within the bound; the pty still answers a kill."""
    h = sbx.pty.create(e2b.PtySize(rows=24, cols=80))
    with _peak_rss(_DAEMON[0].proc.pid) as rss:
        sbx.pty.send_stdin(h.pid, b"yes 0123456789abcdef0123456789abcdef0123456789\n")
        time.sleep(10)
    assert rss["growth"] < GROWTH_BOUND, f"daemon grew {rss['growth'] / MIB:.0f} MiB"
    assert sbx.pty.kill(h.pid) is True  # it once waited for the reader: a timeout
    h.disconnect()
    # the same for a plain command whose client reads nothing
    flood = sbx.commands.run("yes", background=True)
    time.sleep(3)
    assert sbx.commands.kill(flood.pid) is True
    flood.disconnect()
    assert sbx.commands.run("echo still").stdout == "still\n"


def test_watch_dir_sees_a_written_file(sbx) -> None:  # type: ignore[no-untyped-def]
    sbx.files.make_dir("/home/user/watched")
    w = sbx.files.watch_dir("/home/user/watched")
    sbx.files.write("/home/user/watched/new.txt", "content")
    events: list[object] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            e.name == "new.txt" for e in events):  # type: ignore[attr-defined]
        time.sleep(0.5)
        events += w.get_new_events()
    w.stop()
    assert any(e.name == "new.txt" and e.type == e2b.FilesystemEventType.CREATE  # type: ignore[attr-defined]
               for e in events), events
    with pytest.raises(e2b.NotFoundException):
        sbx.files.watch_dir("/home/user/no-such-dir")


def test_async_sdk_stdin_pty_and_watch(e2b_env: dict[str, str]) -> None:
    async def body() -> None:
        s = await e2b.AsyncSandbox.create(timeout=300)
        try:
            h = await s.commands.run("cat", background=True, stdin=True)
            await s.commands.send_stdin(h.pid, "async in\n")
            await s.commands.close_stdin(h.pid)
            assert (await h.wait()).stdout == "async in\n"
            with pytest.raises(e2b.NotFoundException):
                await s.commands.send_stdin(987654, "x")

            data = bytearray()
            p = await s.pty.create(e2b.PtySize(rows=30, cols=90), on_data=data.extend)
            await s.pty.send_stdin(p.pid, b"stty size\n")
            for _ in range(120):
                if b"30 90" in data:
                    break
                await asyncio.sleep(0.25)
            assert b"30 90" in data, bytes(data)
            await s.pty.resize(p.pid, e2b.PtySize(rows=33, cols=99))
            await s.pty.send_stdin(p.pid, b"stty size; exit 7\n")
            with pytest.raises(e2b.CommandExitException) as info:
                await p.wait()
            assert info.value.exit_code == 7 and b"33 99" in data, bytes(data)

            seen: list[object] = []
            await s.files.make_dir("/home/user/awatched/sub")
            w = await s.files.watch_dir("/home/user/awatched", seen.append, recursive=True)
            await s.files.write("/home/user/awatched/sub/a.txt", "x")
            for _ in range(60):
                if any(e.name == "sub/a.txt" for e in seen):  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.5)
            await s.files.remove("/home/user/awatched/sub/a.txt")
            for _ in range(60):
                if any(e.type == e2b.FilesystemEventType.REMOVE  # type: ignore[attr-defined]
                       for e in seen):
                    break
                await asyncio.sleep(0.5)
            await w.stop()
            names = [(e.name, e.type) for e in seen]  # type: ignore[attr-defined]
            assert ("sub/a.txt", e2b.FilesystemEventType.CREATE) in names, names
            assert ("sub/a.txt", e2b.FilesystemEventType.REMOVE) in names, names
        finally:
            await s.kill()

    asyncio.run(body())
