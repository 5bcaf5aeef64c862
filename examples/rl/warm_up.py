"""Warm the RL baseline: load the simulator and the policy once, and keep them resident.

    python3 warm_up.py

Run this once on the baseline machine (``rl-base``) before forking it. It imports
gymnasium and numpy, makes the CartPole environment, builds the policy weights, runs one
throw-away episode so every first-call path is exercised, and then leaves a **warm
worker** behind: a daemonised Python process, with all of that already in memory,
listening on a unix socket (``/run/rl-worker.sock``). Because a fork copies the running
machine, every fork of the baseline inherits this process mid-``accept()``: a rollout in
a fork hands its seed to the worker (see ``rollout.py``) and pays only for its episode,
not for starting an interpreter and importing numpy (~1.5 s under software emulation).

Each request is served in a ``fork()`` of the worker, made before the request arrives
(one child always waits in ``accept()``; see ``Worker.serve``), so an episode never
changes the worker's own state and the tenth rollout in a machine starts from the same
Python objects as the first. The worker runs the ``episode()`` function of the script that asked
(``rollout.py``), so the episode logic lives in one place.

Also written: ``~/.cache/rl-warm/policy.json`` (the weights and how long warming took),
the warm cache that a fresh interpreter could read instead of rebuilding.

Running it again when a worker already answers does nothing and exits 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

ENV_ID = "CartPole-v1"
POLICY_SEED = 1234  # must match rollout.py
SOCKET = os.environ.get("RL_WORKER_SOCKET", "/run/rl-worker.sock")
LOG = os.environ.get("RL_WORKER_LOG", "/run/rl-worker.log")
REFORK_IDLE = 1.0  # seconds without a request before the next standby child is forked
CACHE = Path(os.environ.get("RL_WARM_CACHE", str(Path.home() / ".cache" / "rl-warm")))


def ping(path: str = SOCKET) -> dict[str, Any] | None:
    """The running worker's status, or None if none answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(b"ping\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        status, _, rest = data.decode().strip().partition(" ")
        if status != "ok":
            return None
        reply: dict[str, Any] = json.loads(rest)
        return reply
    except (OSError, ValueError):
        return None


class Worker:
    """The warm state (modules, env, weights) and the loop that serves episodes."""

    def __init__(self) -> None:
        t0 = time.monotonic()
        import gymnasium as gym
        import numpy as np

        self.gym, self.np = gym, np
        self.import_s = time.monotonic() - t0
        self.env = gym.make(ENV_ID)
        self.weights = np.random.default_rng(POLICY_SEED).normal(0.0, 1.0, size=4)
        # One throw-away episode: first calls (reset, step, numpy dispatch) happen now.
        self.env.reset(seed=0)
        for _ in range(20):
            _, _, done, trunc, _ = self.env.step(0)
            if done or trunc:
                break
        # The record of each episode is hashed (rollout.py's ``episode``): load hashlib
        # and its OpenSSL library once here, not in every request's child.
        hashlib.sha256(b"").hexdigest()
        self.warm_s = time.monotonic() - t0
        self.pid = os.getpid()

    def write_cache(self) -> None:
        CACHE.mkdir(parents=True, exist_ok=True)
        info = {
            "env": ENV_ID,
            "policy_seed": POLICY_SEED,
            "weights": [float(w) for w in self.weights],
            "gymnasium": self.gym.__version__,
            "numpy": self.np.__version__,
            "import_s": round(self.import_s, 3),
            "warm_s": round(self.warm_s, 3),
        }
        tmp = CACHE / "policy.json.tmp"
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        tmp.replace(CACHE / "policy.json")

    @staticmethod
    def load_script(path: str) -> Any:
        """The caller's script as a module (in the child that serves the request)."""
        spec = importlib.util.spec_from_file_location("rollout_script", path)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"cannot load {path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    def serve(self, listener: socket.socket) -> None:
        """Serve requests forever, each in a ``fork()`` of this process, forked *before*
        its request arrives.

        One child always waits in ``accept()``: the first request in a machine (in a
        fork of the baseline, usually the only one) is answered by a child that already
        exists, copied along with the machine, so it costs the episode and not a
        ``fork()`` of a Python process holding numpy and the env (under gVisor or
        software emulation that fork, and the copy-on-write faults after it, cost as
        much as the episode's interpreter start). When a child takes a request it tells
        this process, which forks the next child as soon as another request is waiting
        (concurrent requests each get a child at once), else after ``REFORK_IDLE``.
        The episode runs in the child, so it cannot change the worker's state.
        """
        self.pid = os.getpid()
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
        taken_r, taken_w = os.pipe()
        while True:
            child = os.fork()
            if child == 0:
                os.close(taken_r)
                self.serve_one(listener, taken_w)
            while not self.wait_taken(taken_r, child):
                pass
            # The standby child has a request. Fork the next one when another request
            # is waiting, or after a second without one (so a machine forked later
            # still holds a standby child; a fork deleted right after its episode never
            # pays for one).
            select.select([listener], [], [], REFORK_IDLE)

    @staticmethod
    def wait_taken(taken_r: int, child: int) -> bool:
        """True once the standby child reports a request taken, or has died without one."""
        ready, _, _ = select.select([taken_r], [], [], 5.0)
        if ready:
            os.read(taken_r, 1)
            return True
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True  # killed before it took anything: fork another
        return False

    def serve_one(self, listener: socket.socket, taken_w: int) -> None:
        """In a standby child: take one request, say so, answer it, exit."""
        code = 0
        try:
            while True:
                try:
                    conn, _ = listener.accept()
                    break
                except InterruptedError:
                    continue
            listener.close()
            os.write(taken_w, b"t")
            os.close(taken_w)
            with conn:
                conn.settimeout(30)
                try:
                    op, arg = self.read_request(conn)
                    if op == "ping":
                        info = {"pid": self.pid, "env": ENV_ID, "import_s": self.import_s,
                                "warm_s": self.warm_s}
                        self.reply(conn, "ok " + json.dumps(info))
                    elif op == "episode":
                        seed_text, _, script = arg.partition(" ")
                        mod = self.load_script(script)
                        record = mod.episode(int(seed_text), self.env, self.weights, self.np)
                        self.reply(conn, "ok " + mod.format_record(record))
                    else:
                        self.reply(conn, f"error unknown request {op!r}")
                except Exception as exc:  # reported to the caller, who exits non-zero
                    code = 1
                    with contextlib.suppress(OSError):
                        self.reply(conn, f"error {type(exc).__name__}: {exc}")
        except BaseException:
            code = 1
        finally:
            os._exit(code)

    @staticmethod
    def read_request(conn: socket.socket) -> tuple[str, str]:
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        op, _, arg = data.decode().strip().partition(" ")
        return op, arg

    @staticmethod
    def reply(conn: socket.socket, text: str) -> None:
        conn.sendall(text.replace("\n", " ").encode() + b"\n")


def daemonise(log_path: str) -> bool:
    """Double-fork into a session of its own; True in the daemon, False in the caller."""
    if os.fork() > 0:
        return False
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    os.chdir("/")
    return True


def main() -> int:
    running = ping()
    if running is not None:
        print(f"warm worker already running (pid {running['pid']}, {running['env']})")
        return 0
    sys.dont_write_bytecode = True  # episodes must not write to the machine's disk
    worker = Worker()
    worker.write_cache()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SOCKET)  # stale: nothing answered on it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(SOCKET)
    listener.listen(64)  # bound before we return: a rollout right after us can connect
    sys.stdout.flush()
    if daemonise(LOG):
        try:
            worker.serve(listener)
        finally:
            os._exit(1)
    listener.close()
    status = ping()
    if status is None:
        print("warm worker did not answer", file=sys.stderr)
        return 1
    print(f"warm worker pid {status['pid']}: {ENV_ID}, gymnasium {worker.gym.__version__}, "
          f"numpy {worker.np.__version__}; imports {worker.import_s:.2f}s, "
          f"warm-up {worker.warm_s:.2f}s; socket {SOCKET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
