"""An old ``e2b`` Python SDK, beside the newest the dev extra installs (test_e2b.py).

``e2b`` 2.25.1 is the oldest release that works whole against one URL: 2.7.0 is the
first to read ``E2B_SANDBOX_URL`` (1.x and 2.0-2.6 build ``https://<port>-<id>.<domain>``
for every sandbox call, which needs wildcard DNS and TLS), but before 2.25.1 a sandbox
got from ``Sandbox.connect(id)`` sends its envd calls without ``E2b-Sandbox-Id``, so no
single-URL server can route them. It differs from 2.63 in what boxd serves:
``POST /sandboxes`` (not ``/v2``), the sandbox headers on the control API's connect, the
SDK's own Connect client over httpx (not ``connectrpc``), Google's ``protobuf``, and
API keys checked against ``^e2b_[0-9a-f]+$``. It goes into a venv of its own (its
dependencies pinned by ``tests/e2b-py-old/requirements.txt``, kept under
``.cache/e2b-py-old/<hash of that file>``) and runs ``tests/e2b-py-old/calls.py``
against a gVisor daemon of its own.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd.e2b.env import to_e2b_key
from tests._support.daemon import Daemon
from tests._support.e2b import e2b_daemon

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "tests" / "e2b-py-old"
LOCK = SUITE / "requirements.txt"


def _venv() -> Path:
    """The old SDK's venv (made once per requirements.txt); its python."""
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()[:16]
    where = REPO / ".cache" / "e2b-py-old" / digest
    python = where / "bin" / "python"
    if (where / ".done").exists():
        return python
    shutil.rmtree(where, ignore_errors=True)
    where.parent.mkdir(parents=True, exist_ok=True)
    for argv in ([sys.executable, "-m", "venv", str(where)],
                 [str(python), "-m", "pip", "install", "-q", "--no-deps", "-r", str(LOCK)]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(argv)} exited {proc.returncode}:\n"
                        f"{(proc.stdout + proc.stderr)[-8000:]}", pytrace=False)
    (where / ".done").write_text("")
    return python


@pytest.fixture(scope="module")
def e2b_env(daemon: Daemon) -> Iterator[dict[str, str]]:
    with e2b_daemon(daemon, "e2b-old") as (_, exports):
        yield exports


def test_old_e2b_python_sdk(e2b_env: dict[str, str]) -> None:
    """create (v1), commands (foreground, background, streamed, connect), files, list with
    a metadata filter, get_info, set_timeout, connect, pause, kill, the async client;
    unknown template and another account's sandbox are NotFoundException, a full quota
    RateLimitException."""
    from boxd import Boxd

    python = _venv()
    with Boxd() as b:
        other = b.keys.create("e2b-old-other", account="e2b-old-other").secret
        full = b.keys.create("e2b-old-full", account="e2b-old-full").secret
        b.accounts.update("e2b-old-full", max_machines=0)
    env = {**os.environ, **e2b_env,
           "E2B_OTHER_API_KEY": to_e2b_key(other), "E2B_FULL_API_KEY": to_e2b_key(full)}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), str(SUITE / "calls.py")], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-12000:]
    assert proc.stdout.startswith("e2b 2.25.1 on Python"), out
    assert proc.stdout.rstrip().endswith("\nok"), out
