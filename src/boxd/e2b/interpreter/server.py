"""boxd's code interpreter service: runs IN the guest of an E2B ``code-interpreter-v1``
sandbox, on port 49999, in front of Jupyter kernels (ipykernel, driven through
jupyter_client over unix sockets).

It speaks what the ``e2b-code-interpreter`` SDK sends (docs/e2b.md):

- ``POST /execute {code, context_id?, language?, env_vars?}`` -> NDJSON lines as the
  cell runs: ``stdout``/``stderr`` ``{text, timestamp}``, ``result`` (one per
  ``execute_result``, ``is_main_result`` true, or ``display_data``: text, html,
  markdown, svg, png, jpeg, pdf, latex, json, javascript; other MIME types in
  ``extra``), ``error {name, value, traceback}``, ``number_of_executions
  {execution_count}``, then ``end_of_execution``. A client that goes away interrupts
  the cell (the SDK's ``timeout`` closes its connection).
- ``GET/POST /contexts``, ``DELETE /contexts/{id}``, ``POST /contexts/{id}/restart``:
  a context is a kernel of its own with its own working directory; one default Python
  context is started with the service.
- ``GET /health``.

Stdlib only at import (the host imports it to read and test it); jupyter_client is
imported when the first kernel starts. Errors are ``{"error": message}`` with 400 (bad
input), 404 (no such context or path) or 500; every request gets an answer.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PORT = 49999
DEFAULT_CWD = "/home/user"
#: The longest request body accepted (code and env_vars), bytes.
MAX_BODY = 16 * 1024 * 1024
#: Seconds a kernel has to answer after it starts or restarts.
READY_TIMEOUT = 60.0
#: Seconds an interrupted cell has to end before its kernel is restarted.
INTERRUPT_GRACE = 5.0
#: Contexts one sandbox may hold (each is a kernel process).
MAX_CONTEXTS = 64
LANGUAGES = ("python",)
#: Where the kernels' unix sockets are (ZeroMQ ``ipc``: no TCP port of the guest's).
SOCKETS = "/tmp/boxd-interpreter"

#: Jupyter MIME types -> the SDK's ``Result`` fields.
MIME_FIELDS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
    "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
    "application/javascript": "javascript",
}

Line = dict[str, Any]


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def result_line(data: dict[str, Any], is_main: bool) -> Line:
    """A ``result`` line from a Jupyter MIME bundle."""
    line: Line = {"type": "result", "is_main_result": is_main}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        name = MIME_FIELDS.get(mime)
        if name is None:
            extra[mime] = value
        else:
            line[name] = value
    if extra:
        line["extra"] = extra
    return line


def translate(msg: dict[str, Any]) -> Line | None:
    """The NDJSON line for one iopub message of the running cell (None: none)."""
    kind = msg.get("msg_type") or msg.get("header", {}).get("msg_type")
    content = msg.get("content", {})
    now = time.time_ns()
    if kind == "stream":
        name = "stderr" if content.get("name") == "stderr" else "stdout"
        return {"type": name, "text": content.get("text", ""), "timestamp": now}
    if kind == "execute_result":
        return result_line(content.get("data", {}), True)
    if kind == "display_data":
        return result_line(content.get("data", {}), False)
    if kind == "error":
        return {"type": "error", "name": content.get("ename", ""),
                "value": content.get("evalue", ""),
                "traceback": "\n".join(content.get("traceback", []))}
    if kind == "execute_input":
        return {"type": "number_of_executions",
                "execution_count": content.get("execution_count")}
    return None


def env_code(env: dict[str, str]) -> tuple[str, str]:
    """Code that sets ``env`` in the kernel's os.environ, and code that undoes it."""
    names = json.dumps(sorted(env))
    return (f"import os as _b_os\n_b_saved = {{k: _b_os.environ.get(k) for k in {names}}}\n"
            f"_b_os.environ.update({json.dumps(env)})\n",
            "for _b_k, _b_v in _b_saved.items():\n"
            "    if _b_v is None: _b_os.environ.pop(_b_k, None)\n"
            "    else: _b_os.environ[_b_k] = _b_v\n"
            "del _b_saved, _b_k, _b_v, _b_os\n")


@dataclass
class Context:
    id: str
    language: str
    cwd: str
    manager: Any = None  # jupyter_client.KernelManager
    client: Any = None  # its BlockingKernelClient
    lock: threading.Lock = field(default_factory=threading.Lock)

    def info(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def start(self) -> None:
        from jupyter_client import KernelManager  # the guest has it; the host need not

        os.makedirs(self.cwd, exist_ok=True)
        os.makedirs(SOCKETS, mode=0o700, exist_ok=True)
        self.manager = KernelManager(kernel_name="python3", transport="ipc",
                                     ip=f"{SOCKETS}/{self.id}")
        self.manager.start_kernel(cwd=self.cwd)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=READY_TIMEOUT)

    def restart(self) -> None:
        self.manager.restart_kernel(now=True)
        self.client.wait_for_ready(timeout=READY_TIMEOUT)

    def shutdown(self) -> None:
        try:
            self.client.stop_channels()
        finally:
            self.manager.shutdown_kernel(now=True)

    def run(self, code: str, gone: Callable[[], bool]) -> Iterator[Line]:
        """The cell's lines as they come; ``gone()`` true: the client left, the cell is
        interrupted. Ends with ``end_of_execution``."""
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False)
        interrupted_at: float | None = None
        while True:
            if interrupted_at is None and gone():
                self.manager.interrupt_kernel()
                interrupted_at = time.monotonic()
            if interrupted_at is not None and time.monotonic() - interrupted_at > INTERRUPT_GRACE:
                self.restart()
                return
            try:
                msg = self.client.get_iopub_msg(timeout=0.2)
            except Exception:  # queue.Empty: nothing yet
                if not self.manager.is_alive():
                    self.restart()
                    raise RuntimeError("the kernel died (it was restarted: its state is "
                                       "gone)") from None
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg.get("msg_type") == "status" and \
                    msg.get("content", {}).get("execution_state") == "idle":
                break
            line = translate(msg)
            if line is not None:
                yield line
        self._drain_reply(msg_id)
        yield {"type": "end_of_execution"}

    def quiet(self, code: str) -> None:
        """Run ``code`` with no output kept (env_vars set and reset)."""
        msg_id = self.client.execute(code, silent=True, store_history=False)
        self._drain_reply(msg_id)

    def _drain_reply(self, msg_id: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            try:
                reply = self.client.get_shell_msg(timeout=1.0)
            except Exception:
                continue
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return


class Contexts:
    """The kernels, by context id; ``default`` per language is made on first use."""

    def __init__(self, kind: type[Context] = Context) -> None:
        self.kind = kind  # what a context is (tests: one without a kernel)
        self._lock = threading.Lock()
        self._all: dict[str, Context] = {}
        self._defaults: dict[str, str] = {}

    def create(self, language: str | None, cwd: str | None) -> Context:
        language = check_language(language)
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise HttpError(400, f"cwd must be an absolute path, not {cwd!r}")
        with self._lock:
            if len(self._all) >= MAX_CONTEXTS:
                raise HttpError(400, f"at most {MAX_CONTEXTS} contexts: remove one first")
        ctx = self.kind(uuid.uuid4().hex, language, cwd or DEFAULT_CWD)
        try:
            ctx.start()
        except Exception as exc:
            raise HttpError(500, f"the {language} kernel did not start: {exc}") from exc
        with self._lock:
            self._all[ctx.id] = ctx
        return ctx

    def default(self, language: str | None) -> Context:
        language = check_language(language)
        with self._lock:
            found = self._all.get(self._defaults.get(language, ""))
        if found is not None:
            return found
        ctx = self.create(language, None)
        with self._lock:
            self._defaults[language] = ctx.id
        return ctx

    def get(self, context_id: str) -> Context:
        with self._lock:
            ctx = self._all.get(context_id)
        if ctx is None:
            raise HttpError(404, f"context {context_id!r} not found")
        return ctx

    def remove(self, context_id: str) -> None:
        ctx = self.get(context_id)
        with self._lock:
            self._all.pop(context_id, None)
            for lang, cid in list(self._defaults.items()):
                if cid == context_id:
                    del self._defaults[lang]
        with ctx.lock:
            ctx.shutdown()

    def list(self) -> list[dict[str, str]]:
        with self._lock:
            return [c.info() for c in self._all.values()]

    def shutdown(self) -> None:
        with self._lock:
            every = list(self._all.values())
            self._all.clear()
        for ctx in every:
            try:
                ctx.shutdown()
            except Exception as exc:
                print(f"interpreter: kernel {ctx.id} did not stop: {exc}", file=sys.stderr)


def check_language(language: object) -> str:
    if language is None or language == "":
        return "python"
    if not isinstance(language, str) or language.lower() not in LANGUAGES:
        raise HttpError(400, f"language {language!r} is not supported: boxd's code "
                        f"interpreter runs {', '.join(LANGUAGES)}")
    return language.lower()


_CONTEXT_PATH = re.compile(r"^/contexts/([^/]+)(/restart)?$")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "boxd-interpreter"
    contexts: Contexts  # set on the class by serve()

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write("interpreter: " + (format % args) + "\n")

    def do_GET(self) -> None:
        self._answer(lambda: self._get())

    def do_POST(self) -> None:
        self._answer(lambda: self._post())

    def do_DELETE(self) -> None:
        self._answer(lambda: self._delete())

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _get(self) -> None:
        path = self._path()
        if path == "/health":
            self._json(200, {"status": "ok"})
        elif path == "/contexts":
            self._json(200, self.contexts.list())
        else:
            raise HttpError(404, f"no such path: GET {path}")

    def _post(self) -> None:
        path = self._path()
        body = self._body()
        if path == "/execute":
            self._execute(body)
            return
        if path == "/contexts":
            ctx = self.contexts.create(body.get("language"), body.get("cwd"))
            self._json(200, ctx.info())
            return
        match = _CONTEXT_PATH.match(path)
        if match and match.group(2):
            ctx = self.contexts.get(match.group(1))
            with ctx.lock:
                ctx.restart()
            self._json(200, {})
            return
        raise HttpError(404, f"no such path: POST {path}")

    def _delete(self) -> None:
        match = _CONTEXT_PATH.match(self._path())
        if not match or match.group(2):
            raise HttpError(404, f"no such path: DELETE {self._path()}")
        self.contexts.remove(match.group(1))
        self._json(200, {})

    def _execute(self, body: dict[str, Any]) -> None:
        code, ctx, env = self._cell(body)
        with ctx.lock:
            set_env, reset_env = env_code(env)
            if env:
                ctx.quiet(set_env)  # before the head: a failure here is a plain 500
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                self._stream(ctx, code)
            finally:
                if env:
                    try:
                        ctx.quiet(reset_env)
                    except Exception as exc:
                        self.log_message("env_vars not reset: %s", exc)

    def _cell(self, body: dict[str, Any]) -> tuple[str, Context, dict[str, str]]:
        """What ``/execute`` asks: the code, its context, its env_vars (HttpError: bad)."""
        code = body.get("code")
        if not isinstance(code, str):
            raise HttpError(400, "code must be a string")
        context_id, language = body.get("context_id"), body.get("language")
        if context_id and language:
            raise HttpError(400, "give context_id or language, not both")
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise HttpError(400, "env_vars must map names to strings")
        if context_id is not None and not isinstance(context_id, str):
            raise HttpError(400, "context_id must be a string")
        ctx = self.contexts.get(context_id) if context_id else self.contexts.default(language)
        return code, ctx, env

    def _stream(self, ctx: Context, code: str) -> None:
        """The cell's lines as chunks, then the last chunk (the head is sent)."""
        try:
            for line in ctx.run(code, self._client_gone):
                self._chunk((json.dumps(line) + "\n").encode())
        except OSError:
            self.close_connection = True  # the client went
            return
        except Exception as exc:  # the head is sent: the failure is the cell's error
            self._chunk((json.dumps({
                "type": "error", "name": "InterpreterError",
                "value": f"{type(exc).__name__}: {exc}", "traceback": ""}) + "\n").encode())
        self._chunk(b"")

    def _client_gone(self) -> bool:
        """The client closed its side (its request was read whole: any byte or EOF now
        means it is gone)."""
        sock: socket.socket = self.connection
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _body(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError as exc:
            raise HttpError(400, "bad Content-Length") from exc
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = self._read_chunked()
        elif length > MAX_BODY:
            raise HttpError(413, f"the body is over {MAX_BODY} bytes")
        else:
            data = self.rfile.read(length) if length else b""
        if not data.strip():
            return {}
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise HttpError(400, f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        return body

    def _read_chunked(self) -> bytes:
        data = b""
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return data
            data += self.rfile.read(size)
            self.rfile.readline()
            if len(data) > MAX_BODY:
                raise HttpError(413, f"the body is over {MAX_BODY} bytes")

    def _json(self, status: int, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _answer(self, handle: Callable[[], None]) -> None:
        try:
            handle()
        except HttpError as exc:
            if exc.status == 413:
                self.close_connection = True
            self._json(exc.status, {"error": exc.message})
        except OSError:
            self.close_connection = True
        except Exception as exc:  # every request gets an answer
            self.close_connection = True
            self._json(500, {"error": f"{type(exc).__name__}: {exc}"})


def serve(port: int = PORT, contexts: Contexts | None = None,
          host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """The service's server on ``host:port`` (not yet serving: call ``serve_forever``).
    Every address of the guest: the host reaches it through the guest's network."""
    handler = type("BoundHandler", (Handler,), {"contexts": contexts or Contexts()})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main() -> None:
    contexts = Contexts()

    def stop(signum: int, frame: object) -> None:
        contexts.shutdown()  # the kernels end with the service
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    server = serve(PORT, contexts)
    contexts.default("python")  # warm: the first cell finds its kernel running
    print(f"interpreter: listening on {PORT}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
