"""The TypeScript SDK (``sdk-ts/``, ``@boxd-sh/sdk``) against a real daemon.

Runs ``npm ci && npm run build && npm test`` in ``sdk-ts``; the Node tests start their own
daemon (temp ``BOXD_HOME``, this interpreter's ``python -m boxd serve``, the shared image
cache), boot one machine and fork it for the rest, and run the spec's TypeScript example
verbatim. Node 18+ (Debian 12 ships 18; only 20 was tried here) and npm are host
prerequisites, installed by scripts/setup-host.sh: without them this test fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support.daemon import IMAGE_CACHE

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "sdk-ts"


def _run(argv: list[str], env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run(
        argv,
        cwd=SDK,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-12000:]
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}:\n{out}", pytrace=False)


def test_typescript_sdk() -> None:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("node and npm are required (Debian: apt-get install nodejs npm)", pytrace=False)
    major = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    assert int(major.strip().lstrip("v").split(".")[0]) >= 18, f"Node 18+ needed, found {major}"

    python = Path(sys.executable)
    env = {
        **os.environ,
        "BOXD_PYTHON": str(python),  # the daemon under test is this checkout's
        "BOXD_CLI": str(python.parent / "boxd"),
        "BOXD_IMAGE_CACHE": os.environ.get("BOXD_IMAGE_CACHE", str(IMAGE_CACHE)),
    }
    for name in ("BOXD_URL", "BOXD_API_KEY", "BOXD_HOME"):
        env.pop(name, None)  # the Node tests make their own daemon and data directory
    _run([npm, "ci", "--no-audit", "--no-fund"], env, timeout=600)
    _run([npm, "run", "build"], env, timeout=300)
    _run([npm, "test"], env, timeout=3600)
