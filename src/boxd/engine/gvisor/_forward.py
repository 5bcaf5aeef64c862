"""A connection to a port inside a gVisor sandbox, for the machine's URL.

pasta's port forwards cannot reach a sandbox: a connection from the host's loopback
is spliced to the *namespace's* loopback, and runsc's user-space network stack has a
loopback of its own. runsc itself can: ``runsc port-forward --stream SOCKET ID PORT``
connects to the unix socket ``SOCKET`` and hands it, over the sandbox's control
channel, to the sandbox's network stack, which connects it to ``127.0.0.1:PORT``
inside the sandbox. One such runsc process serves one connection and exits when it
closes. Nothing listens on a TCP port (runsc's own listening mode binds every host
interface, which a machine's URL must not), and nothing needs restarting when the
sandbox is replaced (restore, wake): each connection names the sandbox it goes to.

The cost is one short-lived runsc process per connection (~20-30 ms here,
docs/benchmarks.md); a keep-alive HTTP client pays it once per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("boxd.engine")

CONNECT_TIMEOUT = 10.0
_procs: set[asyncio.Task[None]] = set()


def argv(runsc_argv: Callable[..., list[str]], sock: Path, vm_id: str, port: int,
         log_path: Path) -> list[str]:
    """The runsc command line that forwards one connection on ``sock`` to ``port``."""
    return runsc_argv("port-forward", f"--stream={sock}", vm_id, str(port), log=log_path)


async def open_port(
    command: Callable[[Path], list[str]], vm_id: str, run_dir: Path,
    timeout: float = CONNECT_TIMEOUT,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to a port inside the sandbox ``vm_id``: ``command(socket)`` is the runsc
    command line that forwards it (`argv`).

    A port nothing listens on in the sandbox gives a stream that ends at once (runsc
    logs "connection was refused"), as a QEMU machine's passt forward does.

    Raises:
        OSError: runsc exited, or did not connect within ``timeout``; the message has
            runsc's last words.
    """
    loop = asyncio.get_running_loop()
    path = run_dir / f"fwd-{secrets.token_hex(4)}.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    srv.setblocking(False)
    try:
        srv.bind(str(path))
        path.chmod(0o600)
        srv.listen(1)
        proc = await asyncio.create_subprocess_exec(
            *command(path),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )
        accept = asyncio.ensure_future(loop.sock_accept(srv))
        exited = asyncio.ensure_future(proc.wait())
        done, _ = await asyncio.wait({accept, exited}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if accept not in done:
            accept.cancel()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            err = b""
            if proc.stderr is not None:
                with contextlib.suppress(Exception):
                    err = await asyncio.wait_for(proc.stderr.read(), 2.0)
            await proc.wait()
            exited.cancel()
            what = (f"exited {proc.returncode}" if exited in done
                    else f"did not connect within {timeout:.0f}s")
            text = err.decode(errors="replace").strip()[-300:]
            raise OSError(f"runsc port-forward {what}{': ' + text if text else ''}")
        conn, _ = accept.result()
    finally:
        srv.close()
        path.unlink(missing_ok=True)
    _reap(proc, exited, vm_id)
    conn.setblocking(False)
    return await asyncio.open_connection(sock=conn)


def _reap(proc: asyncio.subprocess.Process, exited: asyncio.Future[int], vm_id: str) -> None:
    """Wait for the connection's runsc in the background (it exits once either side
    closes), and log a failure (a refused port)."""

    async def wait() -> None:
        err = b""
        if proc.stderr is not None:
            with contextlib.suppress(Exception):
                err = await proc.stderr.read()  # until runsc exits
        code = await exited
        if code:
            log.info("machine=%s event=port_forward_failed exit=%s error=%r", vm_id, code,
                     err.decode(errors="replace").strip()[-200:])

    task = asyncio.get_running_loop().create_task(wait(), name=f"port-forward {vm_id}")
    _procs.add(task)
    task.add_done_callback(_procs.discard)


__all__ = ["argv", "open_port"]
