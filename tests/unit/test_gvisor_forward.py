"""The gVisor URL forward without runsc: `_forward.open_port` listens on a unix socket,
starts the forwarding command and hands back the connection that command makes.

A small Python program plays runsc (connects to the socket and serves one exchange, or
fails, or never connects); tests/integration/test_gvisor.py drives the real one."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from boxd.engine.gvisor import _forward

# Plays `runsc port-forward --stream SOCKET`: connect to SOCKET, answer one line.
ECHO = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
line = s.makefile("rb").readline()
s.sendall(b"guest:" + line)
s.close()
"""


def _command(script: str):  # type: ignore[no-untyped-def]
    return lambda sock: [sys.executable, "-c", script, str(sock)]


def test_the_forwarding_command_line_names_the_socket_sandbox_and_port(tmp_path: Path) -> None:
    def runsc_argv(*args: str, log: Path | None = None) -> list[str]:
        return ["runsc", f"--log={log}", *args]

    got = _forward.argv(runsc_argv, tmp_path / "s.sock", "m_1", 8080, tmp_path / "l")
    assert got == ["runsc", f"--log={tmp_path / 'l'}", "port-forward",
                   f"--stream={tmp_path / 's.sock'}", "m_1", "8080"]


def test_a_connection_goes_through_the_command_and_its_socket_is_removed(
    tmp_path: Path,
) -> None:
    async def go() -> bytes:
        reader, writer = await _forward.open_port(_command(ECHO), "m_1", tmp_path)
        writer.write(b"GET /\n")
        await writer.drain()
        out = await reader.read()
        writer.close()
        return out

    assert asyncio.run(go()) == b"guest:GET /\n"
    assert list(tmp_path.glob("fwd-*.sock")) == []


def test_a_command_that_exits_is_an_os_error_with_its_last_words(tmp_path: Path) -> None:
    script = "import sys; sys.stderr.write('no such sandbox'); sys.exit(3)"
    with pytest.raises(OSError, match="exited 3: no such sandbox"):
        asyncio.run(_forward.open_port(_command(script), "m_1", tmp_path))
    assert list(tmp_path.glob("fwd-*.sock")) == []


def test_a_command_that_never_connects_times_out(tmp_path: Path) -> None:
    script = "import time; time.sleep(60)"
    with pytest.raises(OSError, match="did not connect within"):
        asyncio.run(_forward.open_port(_command(script), "m_1", tmp_path, timeout=0.5))
    assert list(tmp_path.glob("fwd-*.sock")) == []
