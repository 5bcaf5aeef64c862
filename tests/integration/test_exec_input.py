"""Bad exec input on a real machine: a prompt 400 naming the field, nothing left pending."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from boxd import errors

pytestmark = pytest.mark.vm

BAD = [
    ({"command": "true", "env": {"A=B": "1"}}, "env"),
    ({"command": ["echo", "a\x00b"]}, "command"),
    ({"command": "echo a\x00b"}, "command"),
    ({"command": "true", "env": {"A": "x\x00y"}}, "env"),
    ({"command": "pwd", "cwd": "/tmp\x00/x"}, "cwd"),
    ({"command": "true", "timeout": 1e308}, "timeout"),
]


def test_bad_exec_input_is_answered_at_once(client, machine) -> None:  # type: ignore[no-untyped-def]
    for kw, field in BAD:
        args = dict(kw)
        command = args.pop("command")
        start = time.monotonic()
        with pytest.raises(errors.InvalidRequest) as info:
            client.machines.exec(machine.id, command, **args)
        assert time.monotonic() - start < 10, kw
        assert info.value.details.get("field") == field, kw
    # mixed with good ones, concurrently: every call returns, the good ones succeed
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        bad = [pool.submit(client.machines.exec, machine.id, kw["command"],
                           env=kw.get("env"), cwd=kw.get("cwd")) for kw, _ in BAD[:5]]
        good = [pool.submit(client.machines.exec, machine.id, f"echo {i}") for i in range(4)]
        for f in bad:
            assert isinstance(f.exception(timeout=60), errors.InvalidRequest)
        assert [f.result(timeout=60).stdout for f in good] == [f"{i}\n" for i in range(4)]
    # a timeout at the documented bound is accepted and does not fire at once
    assert client.machines.exec(machine.id, "echo ok", timeout=604800).stdout == "ok\n"
