"""The step channel's round trip on both engines, native relay against the Python one.

    python bench/bench_channel.py       # starts its own two daemons (temporary homes)

A tiny frame (100 bytes) through ``machines.spawn`` to a framed echo process in the
machine and back: SDK, WebSocket, daemon, agent channel, the guest's relay, the echo's
pipes. Measured in the same run, in alternating blocks so host load hits all alike:

- gVisor, native relay: boxd-init (C) is the sandbox's PID 1 (the default);
- gVisor, Python relay: a second daemon with ``BOXD_GVISOR_RELAY=python`` (agent.py is
  PID 1 and relays every frame: the path before boxd-init ran in gVisor) — the baseline;
- QEMU, native relay (boxd-init under TCG/KVM);
- the same echo as a local subprocess over pipes (no machine, no daemon): the floor.

``BENCH_CHANNEL_N`` round trips per path (default 3000), blocks of ``BENCH_CHANNEL_BLOCK``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Row, row_from, say, standalone

GROUP = "channel"
N = int(os.environ.get("BENCH_CHANNEL_N", "3000"))
BLOCK = int(os.environ.get("BENCH_CHANNEL_BLOCK", "50"))
WARM = 100
ECHO = (
    "import sys\n"
    "r, w = sys.stdin.buffer, sys.stdout.buffer\n"
    "while True:\n"
    "    h = r.read(4)\n"
    "    if len(h) < 4: break\n"
    "    body = r.read(int.from_bytes(h, 'big'))\n"
    "    w.write(h + body); w.flush()\n"
)
MSG = b"x" * 100


@contextlib.contextmanager
def _daemon(tell: Callable[[str], None], **env: str) -> Iterator[Any]:
    """A daemon of our own on a temporary home (stopped, and its home removed, after)."""
    from boxd import Boxd
    from boxd.sdk._local import is_healthy

    home = Path(tempfile.mkdtemp(prefix="boxd-bench-chan-"))
    out = open(home / "serve.out", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "boxd", "serve"],
                            env={**os.environ, "BOXD_HOME": str(home), **env}, stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    client = None
    try:
        deadline = time.monotonic() + 120
        while not is_healthy(home / "boxd.sock") or not (home / "local.key").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((home / "serve.out").read_text(errors="replace")[-2000:])
            time.sleep(0.1)
        os.environ["BOXD_HOME"] = str(home)
        client = Boxd()
        tell(f"bench_channel: daemon {proc.pid} on {home} {env or ''}")
        yield client
    finally:
        if client is not None:
            for m in client.machines.list():
                with contextlib.suppress(Exception):
                    client.machines.delete(m.id)
            client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
        from boxd.config import Paths

        shutil.rmtree(Paths(home).shm, ignore_errors=True)  # its tmpfs folder
        shutil.rmtree(home, ignore_errors=True)


def _echo_in(client: Any, engine: str, name: str) -> tuple[Any, Callable[[], None]]:
    m = client.machines.new(name, engine=engine)
    client.machines.wait_until_ready(m.id, timeout=600)
    client.machines.files.upload(m.id, "/home/boxd/echo.py", ECHO)
    proc = client.machines.spawn(m.id, ["python3", "-u", "/home/boxd/echo.py"])

    def rt() -> None:
        proc.send(MSG)
        proc.recv(timeout=60)

    return client.machines.get(m.id), rt


def _local_echo() -> tuple[subprocess.Popen[bytes], Callable[[], None]]:
    p = subprocess.Popen([sys.executable, "-u", "-c", ECHO], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None
    w, r = p.stdin, p.stdout
    frame = len(MSG).to_bytes(4, "big") + MSG

    def rt() -> None:
        w.write(frame)
        w.flush()
        r.read(len(frame))

    return p, rt


def run(client: Any = None, log: Callable[[str], None] | None = None) -> list[Row]:
    """Round trips of a 100-byte frame on every path; ``client`` is not used (the
    module needs two daemons of its own)."""
    del client
    tell = log or say
    saved = os.environ.get("BOXD_HOME")
    local, local_rt = _local_echo()
    try:
        with _daemon(tell) as native, _daemon(tell, BOXD_GVISOR_RELAY="python") as python:
            paths: dict[str, tuple[str, Callable[[], None]]] = {}
            tell("bench_channel: booting a gVisor machine per daemon and a QEMU machine")
            m, rt = _echo_in(native, "gvisor", "chan-gvisor-native")
            paths["gvisor native"] = (m.accelerator or "systrap", rt)
            m, rt = _echo_in(python, "gvisor", "chan-gvisor-python")
            paths["gvisor python"] = (m.accelerator or "systrap", rt)
            if any(e.name == "qemu" and e.status == "ok" for e in native.info().engines):
                m, rt = _echo_in(native, "qemu", "chan-qemu-native")
                paths["qemu native"] = (m.accelerator or "?", rt)
            paths["local pipe"] = ("-", local_rt)
            for _, rt in paths.values():
                for _ in range(WARM):
                    rt()
            times: dict[str, list[float]] = {k: [] for k in paths}
            tell(f"bench_channel: {N} round trips per path, blocks of {BLOCK}")
            for _ in range(max(1, N // BLOCK)):
                for key, (_, rt) in paths.items():
                    out = times[key]
                    for _ in range(BLOCK):
                        t = time.perf_counter()
                        rt()
                        out.append(time.perf_counter() - t)
    finally:
        local.kill()
        local.wait()
        if saved is None:
            os.environ.pop("BOXD_HOME", None)
        else:
            os.environ["BOXD_HOME"] = saved
    base = times["gvisor python"]
    rows = [
        row_from(GROUP, "round trip, 100 B, gVisor, boxd-init relay (SDK -> guest -> SDK)",
                 times["gvisor native"], accel=paths["gvisor native"][0],
                 baseline="gVisor, agent.py relay", baseline_values=base,
                 note="target p50 <= 0.5 ms"),
        row_from(GROUP, "round trip, 100 B, gVisor, agent.py relay (BOXD_GVISOR_RELAY=python)",
                 base, accel=paths["gvisor python"][0], note="the path before this change"),
    ]
    if "qemu native" in times:
        rows.append(row_from(
            GROUP, "round trip, 100 B, QEMU, boxd-init relay", times["qemu native"],
            accel=paths["qemu native"][0], baseline="gVisor, agent.py relay",
            baseline_values=base, note="target p50 <= 1 ms (TCG)"))
    rows.append(row_from(GROUP, "round trip, 100 B, local subprocess over pipes",
                         times["local pipe"], accel="-", baseline="gVisor, agent.py relay",
                         baseline_values=base, note="no machine, no daemon: the floor"))
    return rows


if __name__ == "__main__":
    standalone(run)
