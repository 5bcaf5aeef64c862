"""The unmodified npm ``e2b`` SDK (JavaScript) against a real daemon's E2B listener.

Runs ``npm ci`` in ``tests/e2b-js`` (the SDK pinned by its package-lock.json) and then
``node --test`` there, with ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY`` from
``boxd e2b env`` of a gVisor daemon of its own, plus the key of a second account (its
view of our sandboxes: 404) and of a third whose machine quota is full (429). The SDK
needs Node >= 20.18.1 (its ``engines``; undici 7); npm and node are host prerequisites,
installed by scripts/setup-host.sh: without them this test fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd.e2b.env import to_e2b_key
from tests._support.daemon import Daemon
from tests._support.e2b import e2b_daemon

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "tests" / "e2b-js"
NODE_MIN = (20, 18, 1)


def _run(argv: list[str], env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(argv, cwd=SUITE, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-16000:]
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}:\n{out}", pytrace=False)
    return proc.stdout


@pytest.fixture(scope="module")
def e2b_env(daemon: Daemon) -> Iterator[dict[str, str]]:
    with e2b_daemon(daemon, "e2b-js") as (_, exports):
        yield exports


def test_e2b_js_sdk(e2b_env: dict[str, str]) -> None:
    """create, commands (foreground, background, streaming callbacks, sendStdin and
    closeStdin), pty, files and watchDir, list with a metadata filter, setTimeout,
    fork, connect, kill; unknown template, another account's sandbox, a full quota:
    every call of tests/e2b-js/sdk.test.mjs."""
    from boxd import Boxd

    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("node and npm are required (scripts/setup-host.sh installs them)",
                    pytrace=False)
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    found = tuple(int(x) for x in version.strip().lstrip("v").split("."))
    assert found >= NODE_MIN, f"the e2b npm SDK needs Node >= 20.18.1, found {version}"

    with Boxd() as b:
        other = b.keys.create("e2b-js-other", account="e2b-js-other").secret
        full = b.keys.create("e2b-js-full", account="e2b-js-full").secret
        b.accounts.update("e2b-js-full", max_machines=0)
    env = {**os.environ, **e2b_env,
           "E2B_OTHER_API_KEY": to_e2b_key(other), "E2B_FULL_API_KEY": to_e2b_key(full)}
    _run([npm, "ci", "--no-audit", "--no-fund"], env, timeout=600)
    out = _run([npm, "test"], env, timeout=1200)
    counts = dict(line[2:].split(" ", 1) for line in out.splitlines()
                  if line.startswith(("# pass ", "# fail ", "# skipped ")))
    assert int(counts.get("pass", 0)) >= 21 and counts.get("fail") == "0", out[-4000:]
    assert counts.get("skipped") == "0", out[-4000:]
