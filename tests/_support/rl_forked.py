"""`forked()`: boxd.rl's local env servers, forked from the test process instead of spawned.

`boxd.rl.local()` starts each env server as a fresh ``python -u _server.py``, which then
imports Gymnasium, NumPy and cloudpickle: about 0.3 s of CPU per server, paid for every
sub-env of every VectorEnv a test makes (test_rl_vector_conformance alone makes over 150,
with 2 or 3 servers each). This home runs the same server code (`boxd.rl._server.main`,
on its stdin and stdout, framed by the same `PipeChannel`, driven by the same `LocalSlot`)
in a child forked from the test process, which has those modules loaded already, the way
Gymnasium's own `AsyncVectorEnv` starts its workers. Only the way the process starts
differs; use `boxd.rl.local()` where that is what a test is about (an env module the
server cannot import, PYTHONHASHSEED), as tests/unit/test_rl_env.py does.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

from boxd.rl import _channel, _server


class _ForkedServer:
    """The part of `subprocess.Popen` that `PipeChannel` uses, for a forked child."""

    def __init__(self) -> None:
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the server on fds 0 and 1, nothing else of the parent's
            code = 1
            # The inherited heap (a pytest worker's: torch and all) is never collected
            # here: a collection would touch, so copy, every page of it.
            gc.freeze()
            try:
                os.dup2(to_child, 0)
                os.dup2(from_child, 1)
                # No other pipe end stays open here (another server's stdin among them:
                # its EOF must reach it when its host closes it).
                os.closerange(3, 1 << 16)
                sys.stderr = sys.__stderr__
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                _server.main()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(to_child)
        os.close(from_child)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = os.fdopen(self._w, "wb")
        self.stdout = os.fdopen(self._r, "rb", buffering=0)

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == 0:
                    return None
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"env server {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


class _ForkedSlot(_channel.LocalSlot):
    def _start(self) -> _channel.PipeChannel:
        ch = _channel.PipeChannel(_ForkedServer())  # type: ignore[arg-type]
        ch.send(self._make.message())
        return ch


class ForkedHome(_channel.LocalHome):
    """`boxd.rl.local()` with its env servers forked from this process."""

    def open(self, make: Any, *, rewindable: bool, index: int | None = None,
             shared: bool = False) -> Any:
        if rewindable:  # refused, as local() refuses it
            return super().open(make, rewindable=True, index=index, shared=shared)
        return _ForkedSlot(make, index)


def forked() -> ForkedHome:
    return ForkedHome()
