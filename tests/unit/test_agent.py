"""The guest agent and its host client, end to end over real sockets and real processes.

No VM: the real ``agent.py`` runs as a host subprocess with ``--connect``, and `FakeQemu`
stands in for QEMU's virtio-serial chardev: a persistent guest side (the agent) and a unix
socket server the host `AgentClient` connects to, one host connection at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests._support import agent_guest
from tests._support.agent_guest import FakeQemu, Guest, _children, run, with_client

import boxd.guest.agent as agent_module
from boxd.engine.agent import AgentClient, ExecExit, ExecOutput, GuestStream, _agent_error
from boxd.errors import (
    GuestFileNotFound,
    HostSetupError,
    InternalError,
    InvalidRequest,
    MachineFailed,
)
from boxd.guest import protocol as P

pytestmark = pytest.mark.timeout(120)

guest, hup_guest, init_guest = agent_guest.guest, agent_guest.hup_guest, agent_guest.init_guest

# ------------------------------------------------------------------------ handshake


def test_hello_and_ping(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        assert c.connected
        assert c.agent_version == P.PROTOCOL_VERSION
        assert c.agent_pid == guest.proc.pid
        assert 0 < c.agent_started <= time.time()
        rtt = await c.ping()
        assert 0 < rtt < 5

    with_client(guest, body)


def test_connect_times_out_without_agent(tmp_path: Path) -> None:
    qemu = FakeQemu(tmp_path)  # a socket but no agent behind it
    try:
        with pytest.raises(MachineFailed):
            run(AgentClient.connect(qemu.host_path, timeout=1.5))
        with pytest.raises(MachineFailed):
            run(AgentClient.connect(tmp_path / "missing.sock", timeout=0.3))
    finally:
        qemu.stop()


def test_major_version_mismatch_is_clear(guest: Guest) -> None:
    async def body() -> None:
        reader, writer = await asyncio.open_unix_connection(str(guest.socket_path))
        writer.write(b'{"id":1,"op":"hello","version":"99.0","nonce":"x"}\n')
        await writer.drain()
        msg = json.loads(await asyncio.wait_for(reader.readline(), 15))
        assert msg["ev"] == "error" and msg["code"] == P.ERR_VERSION
        writer.close()
        err = _agent_error(msg)
        assert isinstance(err, HostSetupError)

    run(body())


def test_agent_ignores_garbage(guest: Guest) -> None:
    async def body() -> None:
        reader, writer = await asyncio.open_unix_connection(str(guest.socket_path))
        writer.write(b'not json\n{"id": "x"}\n[1]\n{"id":5,"op":"nope"}\n{"id":6,"op":"ping"}\n')
        await writer.drain()
        # Replies match requests by id, not by order (boxd-init answers ping itself).
        got = {}
        for _ in range(3):
            msg = json.loads(await asyncio.wait_for(reader.readline(), 15))
            got[msg["id"]] = msg
        assert got["x"]["ev"] == "error"  # answered, not fatal
        assert got[5] == {**got[5], "ev": "error", "code": P.ERR_UNKNOWN_OP}
        assert got[6]["ev"] == "result"
        writer.close()

    run(body())


# ------------------------------------------------------------------------ exec


def test_exec_streams_stdout_and_stderr_separately(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        items = [
            item async for item in c.exec("echo out; echo err >&2; echo out2", cwd=str(guest.tmp))
        ]
        assert isinstance(items[-1], ExecExit) and items[-1].exit_code == 0
        out = b"".join(i.data for i in items if isinstance(i, ExecOutput) and i.stream == "stdout")
        err = b"".join(i.data for i in items if isinstance(i, ExecOutput) and i.stream == "stderr")
        assert (out, err) == (b"out\nout2\n", b"err\n")
        stream, data = next(i for i in items if isinstance(i, ExecOutput))  # unpacks
        assert stream in ("stdout", "stderr") and data

    with_client(guest, body)


def test_exec_streams_while_running(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        start = time.monotonic()
        first_at = None
        async for _item in c.exec("echo first; sleep 1; echo second"):
            if first_at is None:
                first_at = time.monotonic() - start
        assert first_at is not None and first_at < 0.8

    with_client(guest, body)


def test_exit_codes_and_signals(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        ok = await c.run("true")
        assert (ok.exit_code, ok.signal, ok.timed_out) == (0, None, False)
        three = await c.run(["sh", "-c", "exit 3"])
        assert three.exit_code == 3 and three.signal is None
        killed = await c.run("kill -TERM $$")
        assert (killed.exit_code, killed.signal, killed.timed_out) == (128 + 15, 15, False)
        missing = await c.run(["/no/such/binary"])
        assert missing.exit_code == 127 and b"No such file" in missing.stderr

    with_client(guest, body)


def test_timeout_kills_the_whole_group(guest: Guest) -> None:
    marker = guest.tmp / "grandchild.pid"

    async def body(c: AgentClient) -> None:
        start = time.monotonic()
        res = await c.run(f"sleep 60 & echo $! > {marker}; sleep 60", timeout=0.5)
        assert time.monotonic() - start < 5
        # SIGTERM first: the shell dies of it (SIGKILL only comes after the grace).
        assert res.timed_out and res.signal == signal.SIGTERM and res.exit_code == 143
        assert 0.4 < res.duration < 0.5 + P.EXEC_KILL_GRACE
        grandchild = int(marker.read_text())
        for _ in range(100):
            if not _alive(grandchild):
                break
            await asyncio.sleep(0.05)
        assert not _alive(grandchild)

    with_client(guest, body)


def test_timeout_kills_a_command_that_traps_term(guest: Guest) -> None:
    """At its timeout the group gets SIGTERM; a command that ignores it (and a child that
    traps it) gets SIGKILL after the grace."""
    marker = guest.tmp / "trapper.pid"

    async def body(c: AgentClient) -> None:
        start = time.monotonic()
        res = await c.run(
            f"sh -c 'trap \"\" TERM; echo $$ > {marker}; while :; do sleep 0.1; done' & "
            "trap 'echo got TERM' TERM; while :; do sleep 0.1; done", timeout=2.0)
        took = time.monotonic() - start
        assert res.timed_out and res.signal == signal.SIGKILL and res.exit_code == 137, res
        assert b"got TERM" in res.stdout  # it was asked first
        # (2 s: the trapping child has written its pid by then on a loaded host too)
        assert 2.0 + P.EXEC_KILL_GRACE - 0.1 < took < 2.0 + P.EXEC_KILL_GRACE + 4, took
        child = int(marker.read_text())
        for _ in range(100):
            if not _alive(child):
                break
            await asyncio.sleep(0.05)
        assert not _alive(child)

    with_client(guest, body)


def test_init_c_kills_after_the_same_grace() -> None:
    source = (Path(agent_module.__file__).parent / "init.c").read_text()
    assert f"#define EXEC_KILL_GRACE_MS {int(P.EXEC_KILL_GRACE * 1000)}\n" in source


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, reading
        return False


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False


def test_big_stdout_intact(guest: Guest) -> None:
    size = 10 * 1024 * 1024
    script = (
        f"import os,sys,random; r=random.Random(7); sys.stdout.buffer.write(r.randbytes({size}))"
    )
    expected = hashlib.sha256(__import__("random").Random(7).randbytes(size)).hexdigest()

    async def body(c: AgentClient) -> None:
        start = time.monotonic()
        res = await c.run([sys.executable, "-c", script])
        elapsed = time.monotonic() - start
        assert res.exit_code == 0, res.stderr
        assert len(res.stdout) == size
        assert hashlib.sha256(res.stdout).hexdigest() == expected
        assert elapsed < 10

    with_client(guest, body)


def test_stdin_env_cwd(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        res = await c.run("cat", stdin=b"hello\x00world")
        assert res.stdout == b"hello\x00world"
        res = await c.run("cat")  # no stdin: /dev/null, so cat ends at once
        assert res.stdout == b"" and res.exit_code == 0
        res = await c.run("echo $FOO:$HOME:$LANG; pwd", env={"FOO": "bar"}, cwd=str(guest.tmp))
        assert res.stdout.decode() == f"bar:/root:C.UTF-8\n{guest.tmp}\n"
        res = await c.run("pwd")  # default cwd is created
        assert res.stdout.decode().strip() == str(guest.home)
        with pytest.raises(GuestFileNotFound) as info:
            await c.run("pwd", cwd=str(guest.tmp / "nope"))
        assert info.value.path == str(guest.tmp / "nope")  # type: ignore[attr-defined]

    with_client(guest, body)


@pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root")
def test_exec_as_another_user_resolves_it_in_the_guests_passwd(guest: Guest) -> None:
    # A container image's USER: both front ends (boxd-init relays it to agent.py).
    import pwd

    nobody = pwd.getpwnam("nobody")

    async def body(c: AgentClient) -> None:
        res = await c.run("id -u; id -g; echo $HOME:$USER", user="nobody")
        assert res.stdout.decode() == \
            f"{nobody.pw_uid}\n{nobody.pw_gid}\n{nobody.pw_dir}:nobody\n"
        res = await c.run("id -u; id -g; echo $HOME", user="4242:4343", env={"HOME": "/h"})
        assert res.stdout.decode() == "4242\n4343\n/h\n"  # no entry needed; env wins
        res = await c.run("id -u")  # no user: root, as before
        assert res.stdout.decode() == "0\n"
        proc = await c.start(["sh", "-c", "id -u"], user="nobody")
        out = b"".join([item.data async for item in proc if isinstance(item, ExecOutput)])
        assert out == f"{nobody.pw_uid}\n".encode()
        with pytest.raises(InvalidRequest, match="no user 'no-such-user'"):
            await c.run("true", user="no-such-user")
        with pytest.raises(InvalidRequest, match="no group 'no-such-group'"):
            await c.run("true", user="nobody:no-such-group")
        # an agent older than 1.6 would ignore user and run as root: refused on the host
        c.agent_version = "1.5"
        with pytest.raises(InvalidRequest, match="cannot run a command as another user"):
            await c.run("touch /tmp/never", user="nobody")
        with pytest.raises(InvalidRequest, match="cannot run a command as another user"):
            await c.start(["true"], user="nobody")
        assert (await c.run("id -u")).stdout == b"0\n"  # without user it still runs

    with_client(guest, body)


async def _read_until(proc: object, want: bytes, seen: bytearray) -> None:
    """Output of ``proc`` into ``seen`` until ``want`` is in it."""
    items = aiter(proc)  # type: ignore[call-overload]
    while want not in seen:
        item = await asyncio.wait_for(anext(items), 20)
        assert isinstance(item, ExecOutput), (item, bytes(seen))
        assert item.stream == "stdout"  # a pty has one output
        seen += item.data


def test_a_command_on_a_pty_sees_a_terminal_of_its_size(guest: Guest) -> None:
    # 1.7: both front ends (boxd-init relays a pty exec and its resize to agent.py).
    script = ("stty size; tty -s && echo is-a-tty; echo err >&2; read x; echo got-$x; "
              "read y; stty size; exit 3")

    async def body(c: AgentClient) -> None:
        proc = await c.start(["sh", "-c", script], pty=(24, 81))
        seen = bytearray()
        await _read_until(proc, b"err", seen)
        assert b"24 81" in seen and b"is-a-tty" in seen  # stderr on the terminal too
        await proc.write(b"hello\n")
        await _read_until(proc, b"got-hello", seen)
        await proc.resize(40, 100)
        await proc.write(b"\n")
        await _read_until(proc, b"40 100", seen)
        rest = [item async for item in proc]
        assert isinstance(rest[-1], ExecExit) and rest[-1].exit_code == 3
        # a resize of a command without a pty, or of one that ended, is refused
        plain = await c.start(["cat"])
        with pytest.raises(InvalidRequest, match="does not run on a pty"):
            await plain.resize(10, 10)
        await plain.kill()
        with pytest.raises(InvalidRequest):
            await proc.resize(10, 10)
        with pytest.raises(InvalidRequest, match="rows and cols"):
            await c.start(["true"], pty=(0, 80))
        c.agent_version = "1.6"  # an older agent: refused on the host
        with pytest.raises(InvalidRequest, match="on a pty"):
            await c.start(["true"], pty=(24, 80))

    with_client(guest, body)


_BAD_EXECS: list[tuple[str, dict[str, object]]] = [
    ("NUL in a shell command", {"command": "echo a\x00b"}),
    ("NUL in argv", {"command": ["echo", "a\x00b"]}),
    ("NUL in argv[0]", {"command": ["ec\x00ho", "a"]}),
    ("'=' in an env name", {"command": "true", "env": {"A=B": "1"}}),
    ("empty env name", {"command": "true", "env": {"": "1"}}),
    ("NUL in an env name", {"command": "true", "env": {"A\x00": "1"}}),
    ("NUL in an env value", {"command": "true", "env": {"A": "x\x00y"}}),
    ("NUL in cwd", {"command": "pwd", "cwd": "/tmp\x00/nope"}),
]


def test_bad_exec_input_is_answered_and_blocks_nothing(guest: Guest) -> None:
    """Defect 5: every request gets a reply, an error one for bad input."""

    async def body(c: AgentClient) -> None:
        for what, kw in _BAD_EXECS:
            args = dict(kw)
            command = args.pop("command")
            with pytest.raises(InvalidRequest) as info:
                await asyncio.wait_for(c.run(command, **args), 10)  # type: ignore[arg-type]
            assert info.value.details.get("errno") == P.ERR_INVALID, what
        # all at once, mixed with good requests: each answered, none left pending
        bad = [c.run(kw["command"], env=kw.get("env"), cwd=kw.get("cwd"))  # type: ignore[arg-type]
               for _, kw in _BAD_EXECS]
        results = await asyncio.wait_for(asyncio.gather(
            *bad, c.run("echo ok"), c.ping(), return_exceptions=True), 20)
        assert all(isinstance(r, InvalidRequest) for r in results[:len(bad)]), results
        assert results[len(bad)].stdout == b"ok\n"  # type: ignore[union-attr]

    with_client(guest, body)


def test_concurrent_execs(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        start = time.monotonic()
        results = await asyncio.gather(
            *(c.run(f"sleep 0.5; echo {i}; echo e{i} >&2") for i in range(20)),
            *(c.ping() for _ in range(20)),
        )
        assert time.monotonic() - start < 5
        for i, res in enumerate(results[:20]):
            assert res.stdout == f"{i}\n".encode() and res.stderr == f"e{i}\n".encode()  # type: ignore[union-attr]

    with_client(guest, body)


def test_cancelling_exec_kills_the_command(guest: Guest) -> None:
    marker = guest.tmp / "pid"

    async def body(c: AgentClient) -> None:
        async def consume() -> None:
            async for _ in c.exec(f"echo $$ > {marker}; echo started; sleep 60"):
                pass

        task = asyncio.create_task(consume())
        for _ in range(100):
            if marker.exists() and marker.read_text().strip():
                break
            await asyncio.sleep(0.05)
        pid = int(marker.read_text())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not _alive(pid):
                break
            await asyncio.sleep(0.05)
        assert not _alive(pid)
        assert (await c.run("echo still")).stdout == b"still\n"

    with_client(guest, body)


def test_orphaned_grandchild_is_reaped(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        res = await c.run("sleep 0.1 & echo $!")
        grandchild = int(res.stdout)
        await asyncio.sleep(0.6)
        assert not _zombie(grandchild), "orphan left as a zombie"
        # The agent has no zombie children at all.
        await asyncio.sleep(0.2)
        children = Path(f"/proc/{guest.proc.pid}/task/{guest.proc.pid}/children").read_text()
        assert all(not _zombie(int(p)) for p in children.split())

    with_client(guest, body)


# ------------------------------------------------------------------------ files


@pytest.mark.parametrize("size", [0, 1, 50 * 1024 * 1024])
def test_file_round_trip(guest: Guest, size: int) -> None:
    data = os.urandom(size)
    target = guest.tmp / "deep" / "dir" / f"f{size}.bin"

    async def body(c: AgentClient) -> None:
        st = await c.write_file(str(target), data, mode=0o600)
        assert (st.size, st.mode, st.sha256) == (size, 0o600, hashlib.sha256(data).hexdigest())
        assert target.read_bytes() == data and (target.stat().st_mode & 0o777) == 0o600
        back = await c.read_file(str(target))
        assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
        assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]  # no temp

    with_client(guest, body)


def test_file_errors(guest: Guest) -> None:
    missing = guest.tmp / "nope" / "x"

    async def body(c: AgentClient) -> None:
        with pytest.raises(GuestFileNotFound) as info:
            await c.read_file(str(missing))
        assert info.value.path == str(missing)  # type: ignore[attr-defined]
        with pytest.raises(GuestFileNotFound):
            await c.stat(str(missing))
        with pytest.raises(InvalidRequest, match="directory"):
            await c.read_file(str(guest.tmp))
        with pytest.raises(InvalidRequest, match="directory"):
            await c.write_file(str(guest.tmp), b"x")
        with pytest.raises(InvalidRequest):
            await c.write_file("relative/path", b"x")
        (guest.tmp / "file").write_bytes(b"")
        with pytest.raises(InvalidRequest):  # a parent that is a file
            await c.write_file(str(guest.tmp / "file" / "child"), b"x" * (3 << 20))
        st = await c.stat(str(guest.tmp))
        assert st["type"] == "dir"
        assert await c.ping() > 0  # still serving

    with_client(guest, body)


def test_an_upload_does_not_replace_a_device_or_fifo(guest: Guest) -> None:
    """Round 3, defect 8: uploading to /dev/null swapped the device for a plain file."""
    # The agent runs on the host here: its own copy of /dev/null (root can make one),
    # never the host's.
    fifo, null = guest.tmp / "fifo", guest.tmp / "null"
    os.mkfifo(fifo)
    targets = [fifo]
    if os.geteuid() == 0:
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        targets.append(null)

    async def body(c: AgentClient) -> None:
        for path in targets:
            with pytest.raises(InvalidRequest, match="not a regular file") as info:
                await c.write_file(str(path), b"x")
            assert info.value.details["field"] == "path"
        assert fifo.is_fifo() and (os.geteuid() != 0 or null.is_char_device())
        assert not [p for p in guest.tmp.iterdir() if ".boxd-" in p.name]  # no temp file
        await c.write_file(str(guest.tmp / "plain"), b"y")  # a regular file still works
        await c.write_file(str(guest.tmp / "plain"), b"z")
        assert (guest.tmp / "plain").read_bytes() == b"z"

    with_client(guest, body)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file an owner needs root")
def test_an_upload_as_a_user_is_theirs_with_the_parents_it_makes(guest: Guest) -> None:
    # 1.9, both front ends (boxd-init relays a write, its user untouched, to agent.py).
    import pwd

    nobody = pwd.getpwnam("nobody")
    (guest.tmp / "there").mkdir()
    target = guest.tmp / "there" / "new" / "deep" / "f.txt"
    pulled: list[bytes] = []

    async def chunks() -> AsyncIterator[bytes]:
        for chunk in (b"abc", b"def"):
            pulled.append(chunk)
            yield chunk

    def owner(path: Path) -> tuple[int, int]:
        st = path.lstat()
        return st.st_uid, st.st_gid

    async def body(c: AgentClient) -> None:
        st = await c.write_file(str(target), chunks(), mode=0o640, user="nobody")
        assert (st.size, st.mode) == (6, 0o640) and target.read_bytes() == b"abcdef"
        ids = (nobody.pw_uid, nobody.pw_gid)
        assert owner(target) == owner(target.parent) == owner(target.parent.parent) == ids
        assert owner(guest.tmp / "there") == (0, 0)  # it was there: left as it was
        assert (target.parent.stat().st_mode & 0o777) == 0o755
        # over a file of root's: the new file is the user's (E2B's envd chowns it too)
        (guest.tmp / "there" / "roots").write_bytes(b"x")
        await c.write_file(str(guest.tmp / "there" / "roots"), b"y", user="nobody")
        assert owner(guest.tmp / "there" / "roots") == ids
        await c.write_file(str(guest.tmp / "there" / "mine"), b"z")  # no user: root's
        assert owner(guest.tmp / "there" / "mine") == (0, 0)
        # an unknown user is refused before anything is made
        with pytest.raises(InvalidRequest, match="no user 'no-such-user'") as info:
            await c.write_file(str(guest.tmp / "never" / "f"), b"x", user="no-such-user")
        assert info.value.details["field"] == "user"
        assert not (guest.tmp / "never").exists()
        # an agent before 1.9 (1.8 has metrics, not this) would ignore the owner:
        # refused on the host, no byte read
        c.agent_version = "1.8"
        pulled.clear()
        with pytest.raises(InvalidRequest, match="cannot give a file an owner") as info:
            await c.write_file(str(guest.tmp / "old"), chunks(), user="nobody")
        assert info.value.details["field"] == "user" and pulled == []
        assert not (guest.tmp / "old").exists()
        await c.write_file(str(guest.tmp / "old"), b"x")  # without user it still writes

    with_client(guest, body)


def test_identity(guest: Guest) -> None:
    # The layout the guest's init makes: /etc/{hostname,machine-id} link into /run/boxd.
    etc, run = guest.sysroot / "etc", guest.sysroot / "run/boxd"
    etc.mkdir(parents=True)
    run.mkdir(parents=True)
    for name in ("hostname", "machine-id"):
        (etc / name).symlink_to(f"../run/boxd/{name}")

    async def body(c: AgentClient) -> None:
        await c.identity(
            hostname="fork-1", machine_id="ab" * 16, seed=os.urandom(64), now=time.time()
        )
        assert (etc / "hostname").read_text() == "fork-1\n"
        assert (etc / "machine-id").read_text() == "ab" * 16 + "\n"
        assert (etc / "machine-id").is_symlink()  # the link itself is left alone
        assert (run / "machine-id").stat().st_mode & 0o777 == 0o444
        with pytest.raises(InvalidRequest):
            await c.identity(hostname="x", machine_id="xyz", seed=b"", now=time.time())

    with_client(guest, body)


def test_identity_on_an_image_without_links(guest: Guest) -> None:
    # Images older than protocol 1.1 have regular /etc files: they are replaced in place.
    etc = guest.sysroot / "etc"
    etc.mkdir(parents=True)
    (etc / "hostname").write_text("old\n")

    async def body(c: AgentClient) -> None:
        await c.identity(hostname="fork-2", machine_id="cd" * 16, seed=b"", now=time.time())
        assert (etc / "hostname").read_text() == "fork-2\n"
        assert not (etc / "hostname").is_symlink()
        assert (etc / "machine-id").read_text() == "cd" * 16 + "\n"

    with_client(guest, body)


def test_sync(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        await c.sync()
        assert await c.ping() > 0

    with_client(guest, body)


def test_metrics_reads_the_guest_s_counters(guest: Guest) -> None:
    # 1.8: both front ends (boxd-init relays the new op to agent.py). The guest here is
    # a host process: its /proc and root are the host's.
    async def body(c: AgentClient) -> None:
        first = await c.metrics()
        burn = time.monotonic() + 0.3
        while time.monotonic() < burn:
            pass
        second = await c.metrics()
        stat_lines = Path("/proc/stat").read_text().splitlines()
        assert first.cpu_count == len([n for n in stat_lines
                                       if n[:3] == "cpu" and n[3].isdigit()])
        assert 0 < first.cpu_busy <= second.cpu_busy
        assert first.cpu_total < second.cpu_total
        assert 0 < first.mem_used < first.mem_total
        st = os.statvfs("/")
        assert first.disk_total == st.f_blocks * st.f_frsize
        assert 0 < first.disk_used <= first.disk_total
        assert abs(first.time - time.time()) < 5
        c.agent_version = "1.7"  # an older agent: refused on the host, typed
        with pytest.raises(InvalidRequest, match="does not report metrics"):
            await c.metrics()

    with_client(guest, body)


def test_process_ticks_count_reaped_children() -> None:
    """gVisor's /proc/stat is all zeros: there CPU use is every process's time, a
    reaped child's included (in its parent's cutime)."""
    before = agent_module.process_ticks()
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)  # waited for: reaped
    assert agent_module.process_ticks() - before >= 0.2 * os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------ reconnects


def test_reconnect_drops_stale_replies(guest: Guest) -> None:
    """A reply to the previous connection reaches the next one, which must ignore it."""

    async def body() -> None:
        first = await guest.client()
        task = asyncio.create_task(first.run("sleep 0.5; echo late"))
        await asyncio.sleep(0.2)
        await first.close()
        with pytest.raises(MachineFailed):
            await task
        assert not first.connected
        with pytest.raises(MachineFailed):
            await first.ping()
        await asyncio.sleep(0.8)  # the stale reply is now waiting in the channel
        assert b'"ev":"result"' in guest.qemu.to_host  # ... and will reach the next host
        second = await guest.client()
        try:
            res = await second.run("echo fresh")
            assert res.stdout == b"fresh\n"
            assert await second.ping() > 0
        finally:
            await second.close()

    run(body())


def test_reconnect_after_hangup(hup_guest: Guest) -> None:
    async def body() -> None:
        for i in range(3):
            c = await hup_guest.client()
            task = asyncio.create_task(c.run("sleep 5"))
            res = await c.run(f"echo {i}")
            assert res.stdout == f"{i}\n".encode()
            await c.close()
            with pytest.raises(MachineFailed):
                await task
        assert hup_guest.qemu.guest_connects >= 3
        assert hup_guest.proc.poll() is None

    run(body())


def test_agent_survives_writes_without_host(guest: Guest) -> None:
    """Output produced while no host is connected neither blocks nor kills the agent."""

    async def body() -> None:
        c = await guest.client()
        await c._channel.send({"id": 1, "op": "exec", "cmd": "head -c 3000000 /dev/zero"})
        await c.close()
        await asyncio.sleep(1.0)
        c = await guest.client()
        try:
            assert (await c.run("echo ok")).stdout == b"ok\n"
        finally:
            await c.close()

    run(body())


# ------------------------------------------------------------------------ boxd-init


def test_init_answers_itself_and_relays_the_rest(init_guest: Guest) -> None:
    init_pid = init_guest.proc.pid

    async def body(c: AgentClient) -> None:
        assert c.agent_pid == init_pid  # hello came from boxd-init
        assert c.agent_version == P.PROTOCOL_VERSION
        # exec without stdin: boxd-init runs it; with stdin: relayed to agent.py
        assert int((await c.run("echo $PPID")).stdout) == init_pid
        relayed = int((await c.run("echo $PPID", stdin=b"")).stdout)
        assert relayed != init_pid and relayed in _children(init_pid)
        assert (await c.stat("/"))["type"] == "dir"  # files go to agent.py
        if os.geteuid() == 0:  # another user: a name in /etc/passwd is boxd-init's too
            import pwd

            nobody = pwd.getpwnam("nobody")
            own = await c.run("echo $PPID; id -u; id -g; id -G; echo $HOME:$USER",
                              user="nobody")
            ppid, uid, gid, groups, env = own.stdout.decode().splitlines()
            assert int(ppid) == init_pid
            assert (int(uid), int(gid)) == (nobody.pw_uid, nobody.pw_gid)
            assert sorted(map(int, groups.split())) == sorted(
                os.getgrouplist("nobody", nobody.pw_gid))
            assert env == f"{nobody.pw_dir}:nobody"
            given = await c.run("echo $HOME:$USER", user="nobody", env={"HOME": "/h"})
            assert given.stdout == b"/h:nobody\n"  # the request's env wins
            # a GROUP part, an unknown name: agent.py's (the same answers as before)
            relayed = int((await c.run("echo $PPID", user="nobody:nogroup")).stdout)
            assert relayed != init_pid
            with pytest.raises(InvalidRequest, match="no user 'no-such-user'"):
                await c.run("true", user="no-such-user")

    with_client(init_guest, body)


def test_init_restarts_a_killed_agent(init_guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        assert (await c.stat("/"))["type"] == "dir"
        (agent_pid,) = _children(init_guest.proc.pid)
        os.kill(agent_pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while True:  # requests in the gap fail clearly, then work again
            try:
                st = await c.stat("/")
                break
            except InternalError as exc:
                assert "restart" in exc.message
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        assert st["type"] == "dir"
        assert _children(init_guest.proc.pid) != [agent_pid]
        assert (await c.run("echo back", stdin=b"")).stdout == b"back\n"
        assert await c.ping() > 0  # the host connection never dropped

    with_client(init_guest, body)


def test_init_fails_requests_a_dead_agent_held(init_guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        task = asyncio.ensure_future(c.run("sleep 30", stdin=b""))  # held by agent.py
        await asyncio.sleep(0.5)
        (agent_pid,) = [p for p in _children(init_guest.proc.pid)
                        if Path(f"/proc/{p}/cmdline").read_bytes().find(b"agent.py") >= 0]
        os.kill(agent_pid, signal.SIGKILL)
        with pytest.raises(InternalError, match="lost"):
            await asyncio.wait_for(task, 10)  # an error at once, not a 30 s wait

    with_client(init_guest, body)


def test_protocol_constants() -> None:
    # The host relies on these names.
    assert P.PORT_NAME == "boxd.agent"
    assert P.EV_RESULT in P.TERMINAL_EVENTS


def test_streamed_stdin_worker(guest: Guest) -> None:
    """A long-lived process fed through stdin messages: the warm-worker pattern."""
    worker = "import sys\nfor line in sys.stdin:\n    print(int(line) * 2, flush=True)\n"

    async def body(c: AgentClient) -> None:
        proc = await c.start([sys.executable, "-u", "-c", worker])
        events = aiter(proc)
        for n in (1, 21, 100):
            await proc.write(f"{n}\n".encode())
            got = b""
            while not got.endswith(b"\n"):  # a line may arrive in pieces
                item = await asyncio.wait_for(anext(events), 10)
                assert isinstance(item, ExecOutput) and item.stream == "stdout"
                got += item.data
            assert got == f"{n * 2}\n".encode()
        await proc.close_stdin()
        rest = [item async for item in events]
        assert isinstance(rest[-1], ExecExit) and rest[-1].exit_code == 0
        with pytest.raises(InvalidRequest):
            await proc.write(b"late\n")
        assert await proc.kill() is False

        sleeper = await c.start("sleep 60")
        assert await sleeper.kill(signal.SIGTERM)
        last = [item async for item in sleeper][-1]
        assert isinstance(last, ExecExit), last
        assert last.signal == signal.SIGTERM, last

    with_client(guest, body)


# ------------------------------------------------------------- the in-guest API (1.3)


async def _echo(stream: GuestStream) -> None:
    """The daemon's side of a relayed stream, for tests: answers each chunk upper-cased."""
    while data := await stream.read():
        await stream.write(data.upper())


def _guest_connect(g: Guest) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(g.sysroot / "run/boxd/boxd.sock"))
    return s


async def _roundtrip(s: socket.socket, data: bytes) -> bytes:
    def go() -> bytes:
        s.sendall(data)
        return s.recv(1 << 16)

    return await asyncio.to_thread(go)


def test_relay_serves_the_api_socket_with_a_fresh_key(guest: Guest) -> None:
    async def body() -> None:
        first = await guest.client()
        started = asyncio.Event()
        relay = asyncio.create_task(first.serve_relay("boxdm_one", _echo,
                                                      on_started=started.set))
        await asyncio.wait_for(started.wait(), 10)
        key = guest.sysroot / "run/boxd/key"
        sock = guest.sysroot / "run/boxd/boxd.sock"
        assert key.read_text() == "boxdm_one\n"
        assert key.stat().st_mode & 0o777 == 0o600 and sock.stat().st_mode & 0o777 == 0o600
        a = _guest_connect(guest)
        assert await _roundtrip(a, b"hello") == b"HELLO"
        b = _guest_connect(guest)  # streams are independent
        assert await _roundtrip(b, b"two") == b"TWO"
        assert await _roundtrip(a, b"again") == b"AGAIN"
        # A new connection (a fork child's or a restored guest's host) with a new key: the
        # streams of the old one end in the guest (the copy of a call in flight is cut).
        await first.close()
        await relay
        second = await guest.client()
        started = asyncio.Event()
        relay = asyncio.create_task(second.serve_relay("boxdm_two", _echo,
                                                       on_started=started.set))
        await asyncio.wait_for(started.wait(), 10)
        assert key.read_text() == "boxdm_two\n"
        assert await asyncio.to_thread(a.recv, 100) == b""
        c = _guest_connect(guest)
        assert await _roundtrip(c, b"fresh") == b"FRESH"
        for s in (a, b, c):
            s.close()
        await second.close()
        await relay

    run(body())


def test_relayed_streams_move_to_the_next_connection(guest: Guest) -> None:
    """A RAM swap: the same guest under a new connection keeps its calls in flight."""

    async def body() -> None:
        streams: dict[int, GuestStream] = {}
        first = await guest.client()
        started = asyncio.Event()
        relay = asyncio.create_task(first.serve_relay("boxdm_a", _echo, streams=streams,
                                                      on_started=started.set))
        await asyncio.wait_for(started.wait(), 10)
        a = _guest_connect(guest)
        assert await _roundtrip(a, b"before") == b"BEFORE"
        await first.close()
        await relay
        assert len(streams) == 1  # orphaned, not ended: the caller decides
        second = await guest.client()
        started = asyncio.Event()
        relay = asyncio.create_task(second.serve_relay("boxdm_b", _echo, streams=streams,
                                                       on_started=started.set))
        await asyncio.wait_for(started.wait(), 10)
        assert await _roundtrip(a, b"after") == b"AFTER"  # the same guest connection
        a.close()
        await second.close()
        await relay

    run(body())


def test_relay_needs_a_sane_key(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        with pytest.raises(InvalidRequest):
            await c.serve_relay("bad\nkey", _echo)
        assert not (guest.sysroot / "run/boxd/key").exists()

    with_client(guest, body)


def test_a_guest_connection_made_before_the_relay_is_served_by_it(guest: Guest) -> None:
    """A fork child's processes may connect before its new host serves the socket: their
    connections are served by the new relay, not cut (only calls already in flight are)."""

    async def body() -> None:
        first = await guest.client()
        started = asyncio.Event()
        relay = asyncio.create_task(first.serve_relay("boxdm_a", _echo,
                                                      on_started=started.set))
        await asyncio.wait_for(started.wait(), 10)
        inflight = _guest_connect(guest)
        assert await _roundtrip(inflight, b"x") == b"X"
        await first.close()
        await relay
        second = await guest.client()
        assert await second.ping() > 0
        early = _guest_connect(guest)
        early.sendall(b"early")
        await asyncio.sleep(0.3)
        started = asyncio.Event()
        relay = asyncio.create_task(second.serve_relay("boxdm_b", _echo,
                                                       on_started=started.set))
        await asyncio.wait_for(started.wait(), 10)
        assert await asyncio.to_thread(early.recv, 100) == b"EARLY"
        assert await asyncio.to_thread(inflight.recv, 100) == b""  # cut
        for s in (early, inflight):
            s.close()
        await second.close()
        await relay

    run(body())


def test_identity_writes_the_api_key(guest: Guest) -> None:
    async def body(c: AgentClient) -> None:
        await c.identity(hostname="k", machine_id="ef" * 16, seed=b"", now=time.time(),
                         api_key="boxdm_" + "k" * 32)
        key = guest.sysroot / "run/boxd/key"
        assert key.read_text() == "boxdm_" + "k" * 32 + "\n"
        assert key.stat().st_mode & 0o777 == 0o600
        await c.set_api_key("boxdm_" + "j" * 32)  # the same op with only the key
        assert key.read_text() == "boxdm_" + "j" * 32 + "\n"
        with pytest.raises(InvalidRequest):
            await c.set_api_key("two words")
        assert key.read_text() == "boxdm_" + "j" * 32 + "\n"

    for d in ("run/boxd", "etc"):
        (guest.sysroot / d).mkdir(parents=True)
    with_client(guest, body)


def test_output_written_just_before_exit_after_a_silence_is_kept(guest: Guest) -> None:
    """Output a command writes right before it exits, after more than the drain's idle
    time of silence, is delivered: the quiet that ends a drain counts from the exit.

    (The CI failure this pins: one of 20 concurrent ``sleep 0.5; echo i`` lost its stdout,
    because a wake-up for another command reaped this one before its pipe was read, and
    the half-second of silence before the exit already counted as the drain's quiet.)
    Staggered exits make such wake-ups happen while neighbours write.
    """

    async def body(c: AgentClient) -> None:
        for _ in range(3):
            results = await asyncio.gather(*(
                c.run(f"sleep {0.3 + i * 0.003:.3f}; echo {i}; echo e{i} >&2") for i in range(60)
            ))
            lost = [i for i, res in enumerate(results)
                    if res.stdout != f"{i}\n".encode() or res.stderr != f"e{i}\n".encode()]
            assert not lost, f"output lost for commands {lost}"

    with_client(guest, body)


def test_the_drain_quiet_counts_from_the_exit() -> None:
    """agent.py's drain rule: half a second of silence before the exit is no reason to stop
    reading at the exit; a quarter second of quiet after it is; two seconds after the exit
    end it whatever a background child still writes."""
    drain_over = agent_module.drain_over
    assert not drain_over(now=10.0, last_data=9.5, exited_at=10.0)
    assert not drain_over(now=10.2, last_data=9.5, exited_at=10.0)
    assert drain_over(now=10.3, last_data=9.5, exited_at=10.0)
    assert not drain_over(now=10.3, last_data=10.2, exited_at=10.0)
    assert drain_over(now=12.1, last_data=12.05, exited_at=10.0)
