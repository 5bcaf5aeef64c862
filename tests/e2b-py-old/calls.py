"""An old `e2b` Python SDK (2.7.0 or 2.25.1) against boxd's E2B listener.

tests/integration/test_e2b_old_sdk.py runs this file with the interpreter of a venv of
its own (the SDK and its dependencies pinned by e2b-<version>.txt), with E2B_API_URL,
E2B_SANDBOX_URL and E2B_API_KEY from `boxd e2b env` and E2B_OTHER_API_KEY, a key of
another account, and E2B_FULL_API_KEY, a key of an account whose machine quota is full.
Each check prints its name; the first failing assert ends the run
with a traceback (exit 1).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import sys
from collections.abc import Callable

import e2b
import e2b.exceptions
from e2b import AsyncSandbox, Sandbox, SandboxQuery

OTHER = os.environ["E2B_OTHER_API_KEY"]
FULL = os.environ["E2B_FULL_API_KEY"]
CHECKS: list[Callable[[Sandbox], None]] = []


def check(fn: Callable[[Sandbox], None]) -> Callable[[Sandbox], None]:
    CHECKS.append(fn)
    return fn


def raises(exc: type[BaseException], call: Callable[[], object]) -> BaseException:
    try:
        call()
    except exc as e:
        return e
    raise AssertionError(f"{call} did not raise {exc.__name__}")


@check
def commands_run(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo $GREETING; echo oops >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "oops\n", 0), r
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    err = raises(e2b.CommandExitException, lambda: sbx.commands.run("echo partial; exit 3"))
    assert err.exit_code == 3 and err.stdout == "partial\n", err  # type: ignore[attr-defined]
    chunks: list[str] = []
    r = sbx.commands.run("echo a; sleep 0.2; echo b", on_stdout=chunks.append)
    assert "".join(chunks) == "a\nb\n" and r.stdout == "a\nb\n", chunks


@check
def background_commands(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 60", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is True
    raises(e2b.CommandExitException, h.wait)
    assert sbx.commands.kill(h.pid) is False
    bg = sbx.commands.run("sleep 0.5; echo done", background=True)
    assert sbx.commands.connect(bg.pid).wait().stdout == "done\n"


@check
def files(sbx: Sandbox) -> None:
    info = sbx.files.write("old/a.txt", "hello old sdk")
    assert info.path == "/home/user/old/a.txt", info
    assert sbx.files.read("/home/user/old/a.txt") == "hello old sdk"
    assert sbx.files.make_dir("/home/user/old/sub") is True
    names = sorted(e.name for e in sbx.files.list("/home/user/old"))
    assert names == ["a.txt", "sub"], names
    assert sbx.files.exists("/home/user/old/a.txt") is True
    sbx.files.rename("/home/user/old/a.txt", "/home/user/old/b.txt")
    sbx.files.remove("/home/user/old")
    assert sbx.files.exists("/home/user/old") is False
    raises(e2b.NotFoundException, lambda: sbx.files.read("/home/user/old/b.txt"))


@check
def list_info_timeout(sbx: Sandbox) -> None:
    found = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b-old"})).next_items()
    assert [s.sandbox_id for s in found] == [sbx.sandbox_id], found
    assert found[0].metadata == {"suite": "e2b-old"}
    before = sbx.get_info().end_at
    sbx.set_timeout(1200)
    assert (sbx.get_info().end_at - before).total_seconds() > 500
    assert sbx.is_running() is True


@check
def connect_and_other_accounts(sbx: Sandbox) -> None:
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.commands.run("echo $GREETING").stdout == "hi\n"
    raises(e2b.NotFoundException, lambda: Sandbox.connect(sbx.sandbox_id, api_key=OTHER))
    raises(e2b.NotFoundException, lambda: Sandbox.get_info(sbx.sandbox_id, api_key=OTHER))
    assert Sandbox.kill(sbx.sandbox_id, api_key=OTHER) is False
    raises(e2b.NotFoundException, lambda: Sandbox.connect("0" * 20))


@check
def unknown_template(sbx: Sandbox) -> None:
    # This SDK turns a create's 404 into a SandboxException "404: ..." (as against E2B).
    err = raises(e2b.SandboxException,
                 lambda: Sandbox.create("no-such-template", timeout=60))
    assert "404" in str(err) and "no-such-template" in str(err), err


@check
def over_quota(sbx: Sandbox) -> None:
    # e2b.exceptions: 2.7.0 does not export it from the package root
    err = raises(e2b.exceptions.RateLimitException,
                 lambda: Sandbox.create(timeout=60, api_key=FULL))
    assert "limit" in str(err), err


@check
def pause_and_connect(sbx: Sandbox) -> None:
    s = Sandbox.create(timeout=120)
    try:
        s.files.write("/home/user/kept", "across a pause")
        pause = getattr(s, "pause", None) or s.beta_pause  # 2.7.0: beta_pause
        pause()
        assert Sandbox.get_info(s.sandbox_id).state == "paused"
        woken = Sandbox.connect(s.sandbox_id, timeout=120)
        assert woken.files.read("/home/user/kept") == "across a pause"
    finally:
        Sandbox.kill(s.sandbox_id)


@check
def async_sdk(sbx: Sandbox) -> None:
    async def main() -> None:
        s = await AsyncSandbox.create(timeout=120)
        try:
            assert (await s.commands.run("echo async")).stdout == "async\n"
            await s.files.write("/home/user/x", "y")
            assert await s.files.read("/home/user/x") == "y"
        finally:
            assert await s.kill() is True

    asyncio.run(main())


@check
def kill(sbx: Sandbox) -> None:
    s = Sandbox.create(timeout=60)
    assert s.kill() is True
    raises(e2b.SandboxException, lambda: s.commands.run("true"))
    assert Sandbox.kill(s.sandbox_id) is False


def main() -> None:
    print(f"e2b {importlib.metadata.version('e2b')} on Python {sys.version.split()[0]}")
    sbx = Sandbox.create(timeout=600, metadata={"suite": "e2b-old"}, envs={"GREETING": "hi"})
    try:
        for fn in CHECKS:
            print(f"- {fn.__name__}", flush=True)
            fn(sbx)
    finally:
        sbx.kill()
    print("ok")


if __name__ == "__main__":
    main()
