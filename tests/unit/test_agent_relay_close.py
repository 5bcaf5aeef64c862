"""The in-guest API socket's relay writes a whole answer before the daemon's close ends
the guest's connection (issue 39 item 4; docs/lifecycle.md#in-machine-auth).

A client that sends ``Connection: close`` (urllib, http.client) gets its answer followed
by the daemon's ``close`` of the stream; the agent ended the guest's socket at that
``close`` while the answer's bytes were still queued for it, so the client read nothing
or part. Real agent (both front ends), real sockets, the daemon's real relay client
(tests/_support/agent_guest.py); the guest's client reads only once the daemon's side has
closed, with an answer larger than a socket buffer, so the bytes surely wait in the agent.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from tests._support.agent_guest import Guest, guest, run  # noqa: F401 - the fixture

from boxd.engine.agent import GuestStream

pytestmark = pytest.mark.timeout(120)

ANSWER = os.urandom(1 << 20)  # far more than a Unix socket buffers (~200 KiB)


def test_an_answer_is_written_whole_before_the_close(guest: Guest) -> None:  # noqa: F811
    async def body() -> None:
        answered = asyncio.Event()

        async def answer(stream: GuestStream) -> None:
            assert await stream.read() == b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n"
            await stream.write(ANSWER)
            answered.set()
            # Returning ends the stream: the relay sends its close right after the bytes.

        client = await guest.client()
        started = asyncio.Event()
        relay = asyncio.create_task(client.serve_relay("boxdm_close", answer,
                                                       on_started=started.set))
        await asyncio.wait_for(started.wait(), 10)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(str(guest.sysroot / "run/boxd/boxd.sock"))
        sock.sendall(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
        await asyncio.wait_for(answered.wait(), 30)
        await asyncio.sleep(1.0)  # the close reaches the agent while the client waits

        def read_all() -> bytes:
            got = bytearray()
            while data := sock.recv(1 << 16):
                got += data
            return bytes(got)

        got = await asyncio.to_thread(read_all)
        sock.close()
        assert len(got) == len(ANSWER) and got == ANSWER, len(got)
        await client.close()
        await relay

    run(body())
