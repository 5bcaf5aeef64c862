"""Old ``e2b`` Python SDKs, beside the newest the dev extra installs (test_e2b.py).

Two releases, each in a venv of its own (its dependencies pinned by
``tests/e2b-py-old/e2b-<version>.txt``, kept under ``.cache/e2b-py-old/<hash>``), run
``tests/e2b-py-old/calls.py`` against a gVisor daemon of their own:

- **2.7.0**, the oldest that can be pointed at boxd: the first to read
  ``E2B_SANDBOX_URL`` (1.x and 2.0-2.6 build ``https://<port>-<id>.<domain>`` for every
  sandbox call, which needs wildcard DNS and TLS). A sandbox it gets from
  ``Sandbox.connect(id)`` sends envd calls with its ``X-Access-Token`` but no
  ``E2b-Sandbox-Id``: boxd routes them by the token.
- **2.25.1**, the oldest that sends the sandbox headers on every call, with ``pause``
  and snapshots; it checks API keys against ``^e2b_[0-9a-f]+$``.

Both differ from 2.63 in what boxd serves: ``POST /sandboxes`` (not ``/v2``), the
sandbox headers on the control API's connect, the SDK's own Connect client over httpx
(not ``connectrpc``), Google's ``protobuf``.
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
VERSIONS = ("2.7.0", "2.25.1")


def _venv(version: str) -> Path:
    """The old SDK's venv (made once per lock file); its python."""
    lock = SUITE / f"e2b-{version}.txt"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()[:16]
    where = REPO / ".cache" / "e2b-py-old" / digest
    python = where / "bin" / "python"
    if (where / ".done").exists():
        return python
    shutil.rmtree(where, ignore_errors=True)
    where.parent.mkdir(parents=True, exist_ok=True)
    for argv in ([sys.executable, "-m", "venv", str(where)],
                 [str(python), "-m", "pip", "install", "-q", "--no-deps", "-r", str(lock)]):
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


@pytest.mark.parametrize("version", VERSIONS)
def test_old_e2b_python_sdk(e2b_env: dict[str, str], version: str) -> None:
    """create (v1), commands (foreground, background, streamed, connect), files, list with
    a metadata filter, get_info, set_timeout, connect, pause, kill, the async client;
    unknown template and another account's sandbox are NotFoundException, a full quota
    RateLimitException."""
    from boxd import Boxd

    python = _venv(version)
    with Boxd() as b:
        other = b.keys.create(f"other-{version}", account="e2b-old-other").secret
        full = b.keys.create(f"full-{version}", account="e2b-old-full").secret
        b.accounts.update("e2b-old-full", max_machines=0)
    env = {**os.environ, **e2b_env,
           "E2B_OTHER_API_KEY": to_e2b_key(other), "E2B_FULL_API_KEY": to_e2b_key(full)}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), str(SUITE / "calls.py")], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-12000:]
    assert proc.stdout.startswith(f"e2b {version} on Python"), out
    assert proc.stdout.rstrip().endswith("\nok"), out
