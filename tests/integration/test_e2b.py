"""The unmodified ``e2b`` SDK (PyPI ``e2b``) against a real daemon's E2B listener, on
gVisor machines: ``eval "$(boxd e2b env)"`` and E2B code runs (docs/e2b.md)."""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from boxd.errors import InvalidRequest as BoxdInvalidRequest
from tests._support.daemon import Daemon
from tests._support.e2b import e2b_daemon

e2b = pytest.importorskip("e2b", reason="the dev extra installs the e2b SDK")

pytestmark = pytest.mark.vm


_DAEMON: list[Daemon] = []


@pytest.fixture(scope="module")
def e2b_env(daemon: Daemon) -> Iterator[dict[str, str]]:
    """A gVisor daemon of its own, and E2B's variables from `boxd e2b env` in os.environ.
    Its E2B port is fixed, so the URL outlives a restart."""
    with e2b_daemon(daemon, "e2b") as (d, exports):
        _DAEMON[:] = [d]
        yield exports


@pytest.fixture(scope="module")
def sbx(e2b_env: dict[str, str]) -> Iterator[object]:
    """One sandbox for the module's read-mostly tests."""
    s = e2b.Sandbox.create(timeout=600, metadata={"suite": "e2b"}, envs={"GREETING": "hi"})
    yield s
    with contextlib.suppress(Exception):
        s.kill()


def test_env_prints_the_three_exports(e2b_env: dict[str, str]) -> None:
    """`boxd e2b env`: both URLs the same loopback URL, the key in E2B's key format."""
    assert set(e2b_env) == {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"}
    assert e2b_env["E2B_API_URL"] == e2b_env["E2B_SANDBOX_URL"]
    assert e2b_env["E2B_API_URL"].startswith("http://127.0.0.1:")
    key = e2b_env["E2B_API_KEY"]
    assert key.startswith("e2b_") and all(c in "0123456789abcdef" for c in key[4:])
    assert shlex.split(f"x={key}") == [f"x={key}"]  # eval-safe


def test_commands_run(sbx) -> None:  # type: ignore[no-untyped-def]
    """stdout, stderr, the exit code, the sandbox's envVars; a failing command raises
    CommandExitException with its code."""
    r = sbx.commands.run("echo $GREETING; echo oops >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "oops\n", 0)
    with pytest.raises(e2b.CommandExitException) as info:
        sbx.commands.run("echo partial; exit 3")
    assert info.value.exit_code == 3
    assert info.value.stdout == "partial\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"


def test_background_command_listed_and_killed(sbx) -> None:  # type: ignore[no-untyped-def]
    h = sbx.commands.run("sleep 60", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(e2b.CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is False


def test_files(sbx) -> None:  # type: ignore[no-untyped-def]
    """write/read/list/make_dir/exists/rename/remove through /files and Filesystem."""
    info = sbx.files.write("notes/a.txt", "hello file")
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("/home/user/notes/a.txt") == "hello file"
    assert sbx.files.read("notes/a.txt", format="bytes") == bytearray(b"hello file")
    assert sbx.commands.run("cat /home/user/notes/a.txt").stdout == "hello file"
    entries = sbx.files.list("/home/user/notes")
    assert [(e.name, e.type, e.size) for e in entries] == [("a.txt", e2b.FileType.FILE, 10)]
    assert sbx.files.make_dir("/home/user/notes/sub") is True
    assert sbx.files.make_dir("/home/user/notes/sub") is False
    assert sbx.files.get_info("/home/user/notes/sub").type == e2b.FileType.DIR
    moved = sbx.files.rename("/home/user/notes/a.txt", "/home/user/notes/sub/b.txt")
    assert moved.path == "/home/user/notes/sub/b.txt"
    assert not sbx.files.exists("/home/user/notes/a.txt")
    sbx.files.remove("/home/user/notes")
    assert not sbx.files.exists("/home/user/notes")
    with pytest.raises(e2b.NotFoundException):
        sbx.files.read("/home/user/nothing-here")


def test_commands_run_as_e2bs_user_or_the_one_named(sbx) -> None:  # type: ignore[no-untyped-def]
    """As on E2B's base template: commands run as `user` (home /home/user, bash) unless
    the call names another user; a user the sandbox lacks is the SDK's
    AuthenticationException. (Its sudo works under QEMU, not gVisor, which ignores
    setuid bits: test_e2b_qemu.py.)"""
    r = sbx.commands.run("whoami; echo $HOME; pwd; echo $SHELL")
    assert r.stdout == "user\n/home/user\n/home/user\n/bin/bash\n"
    assert sbx.commands.run("whoami; echo $HOME", user="root").stdout == "root\n/root\n"
    with pytest.raises(e2b.CommandExitException):
        sbx.commands.run("touch /root/not-users")  # the user's own permissions
    h = sbx.commands.run("sleep 30; whoami", background=True, user="root")
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(e2b.AuthenticationException, match="no-such-user"):
        sbx.commands.run("true", user="no-such-user")


def test_files_belong_to_the_calls_user(sbx) -> None:  # type: ignore[no-untyped-def]
    """As E2B's envd (which runs as root) leaves them: an upload, the parents it makes,
    a made directory and a move's new parents belong to the call's user; root's own
    when the call says root; a user the sandbox lacks is AuthenticationException."""
    sbx.files.write("owned/a/b.txt", "one\n")
    assert sbx.commands.run("cd owned && stat -c %U:%G a a/b.txt").stdout == \
        "user:user\nuser:user\n"
    sbx.commands.run("echo two >> owned/a/b.txt")  # the user may write to it
    assert sbx.files.read("owned/a/b.txt") == "one\ntwo\n"
    # envd writes as root: an upload anywhere works, and is the call's user's
    sbx.files.write("/root/for-user", "x")
    sbx.files.write("/root/for-root", "x", user="root")
    assert sbx.commands.run("stat -c %U /root/for-user /root/for-root", user="root"
                            ).stdout == "user\nroot\n"
    made = sbx.files.make_dir("owned/d/e")
    assert made is True
    info = sbx.files.get_info("owned/d")
    assert (info.owner, info.group) == ("user", "user")
    assert {(e.name, e.owner) for e in sbx.files.list("owned")} == {
        ("a", "user"), ("d", "user")}
    assert sbx.files.make_dir("/home/user/owned/by-root", user="root") is True
    assert sbx.files.get_info("owned/by-root").owner == "root"
    moved = sbx.files.rename("owned/a/b.txt", "owned/new/dir/b.txt")
    assert moved.owner == "user"
    assert sbx.files.get_info("owned/new/dir").owner == "user"
    assert sbx.files.list("/root", user="root")  # root reads /root; so does envd for all
    for call in (lambda: sbx.files.write("owned/x", "x", user="no-such-user"),
                 lambda: sbx.files.make_dir("owned/y", user="no-such-user"),
                 lambda: sbx.files.read("owned/new/dir/b.txt", user="no-such-user"),
                 lambda: sbx.files.get_info("owned", user="no-such-user"),
                 lambda: sbx.files.watch_dir("owned", user="no-such-user")):
        with pytest.raises(e2b.AuthenticationException, match="no-such-user"):
            call()
    assert not sbx.files.exists("owned/x") and not sbx.files.exists("owned/y")
    sbx.files.remove("owned")
    # boxd's own upload takes an owner too
    from boxd import Boxd

    with Boxd() as b:
        b.machines.files.upload(sbx.sandbox_id, "/tmp/boxd-up/f", "x", user="user")
        assert b.machines.exec(sbx.sandbox_id, "stat -c %U /tmp/boxd-up /tmp/boxd-up/f"
                               ).stdout == "user\nuser\n"
        with pytest.raises(BoxdInvalidRequest, match="no user 'no-such-user'"):
            b.machines.files.upload(sbx.sandbox_id, "/tmp/never", "x", user="no-such-user")


def test_a_guest_without_the_user_account_runs_as_root(sbx) -> None:  # type: ignore[no-untyped-def]
    """A snapshot template saved from a guest that has no `user` (as boxd's guest image
    before it had one): its sandboxes' commands and files fall back to root."""
    src = e2b.Sandbox.create(timeout=300)
    try:
        src.commands.run("userdel user", user="root")
        snap = src.create_snapshot(name="no-user-account")
    finally:
        src.kill()
    child = e2b.Sandbox.create(template=snap.snapshot_id, timeout=120)
    try:
        assert child.commands.run("whoami; pwd").stdout == "root\n/home/user\n"
        child.files.write("made/by/default.txt", "x")
        assert child.commands.run("stat -c %U made made/by/default.txt").stdout == \
            "root\nroot\n"
        with pytest.raises(e2b.AuthenticationException, match="user"):
            child.commands.run("true", user="user")
    finally:
        child.kill()
        e2b.Sandbox.delete_snapshot(snap.snapshot_id)


def test_list_info_and_timeout(sbx) -> None:  # type: ignore[no-untyped-def]
    listed = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "e2b"})).next_items()
    assert sbx.sandbox_id in [s.sandbox_id for s in listed]
    assert e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "none"})).next_items() \
        == []
    before = sbx.get_info().end_at
    sbx.set_timeout(900)
    after = sbx.get_info()
    assert after.end_at > before and after.state == e2b.SandboxState.RUNNING
    assert after.metadata == {"suite": "e2b"}


def test_list_pages_with_x_next_token(sbx, e2b_env: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    extra = e2b.Sandbox.create(timeout=120, metadata={"suite": "e2b"})
    try:
        pager = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "e2b"}), limit=1)
        ids = []
        while pager.has_next:
            ids += [s.sandbox_id for s in pager.next_items()]
        assert sorted(ids) == sorted([sbx.sandbox_id, extra.sandbox_id])
    finally:
        extra.kill()


def test_fork_is_a_live_copy(sbx) -> None:  # type: ignore[no-untyped-def]
    """Sandbox.fork: children start from the source's bytes; the source keeps running."""
    sbx.files.write("/home/user/state", "42")
    children = sbx.fork(count=2)
    try:
        assert len(children) == 2 and all(isinstance(c, e2b.Sandbox) for c in children)
        for c in children:
            assert c.sandbox_id != sbx.sandbox_id and len(c.sandbox_id) == 20
            assert c.files.read("/home/user/state") == "42"
            c.files.write("/home/user/state", c.sandbox_id)
        assert sbx.files.read("/home/user/state") == "42"
    finally:
        for c in children:
            c.kill()


def test_pause_and_connect(e2b_env: dict[str, str]) -> None:
    s = e2b.Sandbox.create(timeout=120)
    try:
        s.commands.run("echo kept > /home/user/kept")
        assert s.pause() is True
        assert s.pause() is False  # 409: already paused
        assert s.get_info().state == e2b.SandboxState.PAUSED
        again = e2b.Sandbox.connect(s.sandbox_id, timeout=120)
        assert again.commands.run("cat /home/user/kept").stdout == "kept\n"
        assert again.get_info().state == e2b.SandboxState.RUNNING
    finally:
        s.kill()


def test_timeout_kills_the_sandbox(e2b_env: dict[str, str]) -> None:
    s = e2b.Sandbox.create(timeout=3)
    deadline = time.monotonic() + 60
    while s.sandbox_id in [x.sandbox_id for x in e2b.Sandbox.list().next_items()]:
        assert time.monotonic() < deadline, "the sandbox outlived its timeout"
        time.sleep(0.5)
    with pytest.raises(e2b.SandboxException):
        s.commands.run("true")


def test_kill_and_unknown_sandboxes(e2b_env: dict[str, str]) -> None:
    """A killed sandbox's commands raise SandboxNotRunningException (502 "was not found"),
    an unknown one is the SDK's NotFound, a kill of it False."""
    s = e2b.Sandbox.create(timeout=60)
    assert s.kill() is True
    with pytest.raises(e2b.SandboxNotRunningException):
        s.commands.run("true")
    assert e2b.Sandbox.kill(s.sandbox_id) is False
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.connect("0" * 20)
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.get_info("0" * 20)


def test_bad_requests_get_e2b_errors(e2b_env: dict[str, str], sbx) -> None:  # type: ignore[no-untyped-def]
    """A wrong key is a 401, bad input a 400 in E2B's {code, message}; a malformed
    Connect frame a Connect error, never a 500."""
    url = e2b_env["E2B_API_URL"]
    key = {"X-API-KEY": e2b_env["E2B_API_KEY"]}
    r = httpx.post(f"{url}/sandboxes", json={}, headers={"X-API-KEY": "e2b_00"})
    assert r.status_code == 401 and r.json()["code"] == 401
    r = httpx.post(f"{url}/v2/sandboxes", json={"timeout": "soon"}, headers=key)
    assert r.status_code == 400 and "timeout" in r.json()["message"]
    r = httpx.post(f"{url}/sandboxes/{sbx.sandbox_id}/fork", json={"count": 101}, headers=key)
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "no-such-template"},
                   headers=key)
    assert r.status_code == 404 and "no-such-template" in r.json()["message"]
    envd = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
            "X-Access-Token": sbx._envd_access_token,
            "Content-Type": "application/connect+json"}
    r = httpx.post(f"{url}/process.Process/Start", content=b"\x00\x00\x00\x00\x09{}",
                   headers=envd)
    assert r.status_code == 200 and r.content[0] == 0x02
    assert b"invalid_argument" in r.content
    r = httpx.post(f"{url}/process.Process/List", content=b"{}",
                   headers={**envd, "X-Access-Token": "wrong",
                            "Content-Type": "application/json"})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"


def test_is_running_and_reconnecting_to_a_command(sbx) -> None:  # type: ignore[no-untyped-def]
    assert sbx.is_running() is True
    h = sbx.commands.run("sleep 1; echo done", background=True)
    again = sbx.commands.connect(h.pid)
    assert again.wait().stdout == "done\n"


def test_async_sdk(e2b_env: dict[str, str]) -> None:
    """AsyncSandbox: the same calls through the SDK's async client."""
    import asyncio

    async def main() -> None:
        s = await e2b.AsyncSandbox.create(timeout=120)
        try:
            r = await s.commands.run("echo async")
            assert r.stdout == "async\n"
            await s.files.write("/home/user/x", "y")
            assert await s.files.read("/home/user/x") == "y"
        finally:
            await s.kill()

    asyncio.run(main())


def test_get_metrics_sync_and_async(e2b_env: dict[str, str]) -> None:
    """get_metrics (instance and class variant, sync and async): samples read inside the
    gVisor guest; a busy command shows in the CPU use; a paused sandbox is not woken and
    answers what was kept."""
    import asyncio

    s = e2b.Sandbox.create(timeout=180)
    try:
        [first] = s.get_metrics()
        assert isinstance(first.timestamp, datetime.datetime)
        assert first.cpu_count >= 1 and 0 <= first.cpu_used_pct <= 100
        assert 0 < first.mem_used < first.mem_total and first.mem_cache >= 0
        assert 0 < first.disk_used <= first.disk_total
        s.commands.run("timeout 2 sh -c 'while :; do :; done'; true")
        time.sleep(1.1)  # a second apart: a new sample, not the fresh one again
        later = e2b.Sandbox.get_metrics(s.sandbox_id)
        assert len(later) >= 2 and later[0].timestamp == first.timestamp
        assert max(m.cpu_used_pct for m in later[1:]) > 10, later  # idle: about 0
        since = e2b.Sandbox.get_metrics(s.sandbox_id, start=later[-1].timestamp)
        assert [m.timestamp for m in since] == [later[-1].timestamp]

        async def in_async() -> list[object]:
            a = await e2b.AsyncSandbox.connect(s.sandbox_id)
            got: list[object] = await a.get_metrics()
            return got

        assert len(asyncio.run(in_async())) >= len(later)
        s.pause()
        kept = e2b.Sandbox.get_metrics(s.sandbox_id)
        assert kept[:len(later)] == later
        assert s.get_info().state == e2b.SandboxState.PAUSED  # not woken
    finally:
        s.kill()
    with pytest.raises(e2b.SandboxException):  # SandboxNotFoundException
        e2b.Sandbox.get_metrics(s.sandbox_id)


def test_signed_download_and_upload_urls(sbx) -> None:  # type: ignore[no-untyped-def]
    """download_url / upload_url work from a plain HTTP client (no E2B headers): the
    signature names the sandbox; a tampered or expired URL is envd's 401."""
    url = sbx.upload_url("signed/up.txt", use_signature_expiration=120)
    assert "signature=" in url and "signature_expiration=" in url
    r = httpx.post(url, files={"file": ("up.txt", b"plain http upload")})
    assert r.status_code == 200, r.text
    assert sbx.files.read("signed/up.txt") == "plain http upload"
    r = httpx.get(sbx.download_url("signed/up.txt"))
    assert r.status_code == 200 and r.content == b"plain http upload"
    tampered = sbx.download_url("signed/up.txt").replace("up.txt", "other.txt")
    r = httpx.get(tampered)
    assert r.status_code == 401 and r.json() == {"code": 401, "message": "invalid signature"}
    r = httpx.get(sbx.download_url("signed/up.txt", use_signature_expiration=-5))
    assert r.status_code == 401 and "expired" in r.json()["message"]


def test_network_on_create_and_update_network(e2b_env: dict[str, str]) -> None:
    """network={deny_out: [ALL_TRAFFIC], allow_out: [...]} is the machine's egress
    allow-list (which the engines enforce: tests/integration/test_net_policy.py);
    update_network is refused with why; a deny-list is refused at create."""
    from boxd import Boxd

    s = e2b.Sandbox.create(timeout=120, network={"deny_out": [e2b.ALL_TRAFFIC],
                                                  "allow_out": ["1.1.1.1"]})
    try:
        with Boxd() as b:
            assert b.machines.get(s.sandbox_id).egress == ["1.1.1.1/32"]
        with pytest.raises(e2b.SandboxException, match="cannot be changed"):
            s.update_network({"allow_out": ["8.8.8.8"]})
    finally:
        s.kill()
    with pytest.raises(e2b.SandboxException, match="allow-list"):
        e2b.Sandbox.create(timeout=60, network={"deny_out": ["8.8.8.8"]})


def test_sandboxes_survive_a_daemon_restart(e2b_env: dict[str, str]) -> None:
    """The id -> machine alias and the record (metadata, timeout, token) are kept across
    a daemon restart; the same SDK object goes on working."""
    s = e2b.Sandbox.create(timeout=300, metadata={"restart": "yes"})
    try:
        s.files.write("/home/user/before", "kept")
        end = s.get_info().end_at
        _DAEMON[0].restart()
        info = s.get_info()
        assert (info.metadata, info.end_at) == ({"restart": "yes"}, end)
        assert s.commands.run("cat /home/user/before").stdout == "kept"
    finally:
        s.kill()


def test_a_sandbox_killed_mid_command(e2b_env: dict[str, str]) -> None:
    """The command's stream ends with the SDK's SandboxNotRunningException, not an exit
    code the command never had."""
    s = e2b.Sandbox.create(timeout=120)
    h = s.commands.run("sleep 60", background=True)
    s.kill()
    with pytest.raises(e2b.SandboxNotRunningException):
        h.wait()


def test_over_quota_is_the_sdks_rate_limit(e2b_env: dict[str, str]) -> None:
    """A create over the account's machine quota is a 429 naming the limit: the SDK's
    RateLimitException, and no sandbox or record is left behind."""
    from boxd import Boxd

    with Boxd() as b:
        account = b.accounts.get("local")
        b.accounts.update("local", max_machines=account.machines)
        try:
            before = [s.sandbox_id for s in e2b.Sandbox.list().next_items()]
            with pytest.raises(e2b.RateLimitException) as info:
                e2b.Sandbox.create(timeout=60)
            assert "limit" in str(info.value) or str(account.machines) in str(info.value)
            assert [s.sandbox_id for s in e2b.Sandbox.list().next_items()] == before
        finally:
            b.accounts.update("local", max_machines=account.max_machines)


def test_snapshot_then_create_from_it(sbx) -> None:  # type: ignore[no-untyped-def]
    """Sandbox.create_snapshot is a boxd snapshot; a sandbox created from its id starts
    with the source's files; delete_snapshot removes it."""
    sbx.files.write("/home/user/baked", "in the snapshot")
    snap = sbx.create_snapshot()
    assert snap.snapshot_id.startswith(f"snapshot-{sbx.sandbox_id}@")
    assert snap.snapshot_id in [s.snapshot_id for s in sbx.list_snapshots().next_items()]
    child = e2b.Sandbox.create(template=snap.snapshot_id, timeout=120)
    try:
        assert child.files.read("/home/user/baked") == "in the snapshot"
    finally:
        child.kill()
    assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is False


def _boxd_cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "boxd", *args], check=True,
                          capture_output=True, text=True, env=dict(os.environ)).stdout


def test_a_warm_template_create_is_a_fork_of_its_source(e2b_env: dict[str, str]) -> None:
    """`boxd e2b warm TEMPLATE`: a create of TEMPLATE forks one running machine (claiming
    a standby fork), so every sandbox starts from its bytes; without a source, a create
    boots as before."""
    import json

    from boxd import Boxd

    first = json.loads(_boxd_cli("e2b", "warm", "base", "--forks", "0", "--json"))
    with Boxd() as b:
        src = b.machines.get(first["machine"])
        assert src.labels == {"boxd.e2b/template": "base", "boxd.e2b/role": "source"}
        # as E2B's user, whose sandboxes then overwrite it
        b.machines.exec(src.id, "echo from-the-source > /home/user/mark", user="user")
        again = json.loads(_boxd_cli("e2b", "warm", "base", "--forks", "2", "--json"))
        assert again["machine"] == src.id and again["forks"] == 2  # the same source
        made = [e2b.Sandbox.create(timeout=120) for _ in range(2)]
        try:
            for s in made:
                assert s.commands.run("cat /home/user/mark").stdout == "from-the-source\n"
                assert s.commands.run("whoami").stdout == "user\n"  # found out once
                m = b.machines.get(s.sandbox_id)
                assert m.parent_id == src.id, m
                assert m.labels["boxd.e2b/role"] == "sandbox"
                s.commands.run("echo mine > /home/user/mark")
            assert b.machines.exec(src.id, "cat /home/user/mark").stdout == "from-the-source\n"
            # the warm source is a machine of boxd's, not a sandbox E2B lists
            listed = {x.sandbox_id for x in e2b.Sandbox.list().next_items()}
            assert src.name not in listed and {s.sandbox_id for s in made} <= listed
        finally:
            for s in made:
                s.kill()
        _boxd_cli("machine", "delete", "--label", "boxd.e2b/template=base")
        cold = e2b.Sandbox.create(timeout=120)
        try:
            assert b.machines.get(cold.sandbox_id).parent_id is None
            assert cold.commands.run("cat /home/user/mark || true").stdout == ""
        finally:
            cold.kill()


@pytest.mark.parametrize("example", ["reward_loop.py", "code_agent.py"])
def test_the_e2b_examples_run_unchanged(e2b_env: dict[str, str], example: str) -> None:
    """examples/e2b/: plain E2B code (an open-r1-style reward, a smolagents-style agent
    loop with a fork), run with nothing but `boxd e2b env`'s exports; each checks its
    own results and exits non-zero when they are wrong."""
    path = Path(__file__).resolve().parents[2] / "examples" / "e2b" / example
    source = path.read_text()
    assert "import boxd" not in source and "from boxd" not in source
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                       env=dict(os.environ), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
