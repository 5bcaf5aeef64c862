"""Debian's Chromium driven by Playwright for Python (the browser tests): never
Playwright's own browser download, which `playwright install` would fetch. Screenshots
go to the test's artifacts folder (tests/_support/artifacts.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .artifacts import artifact_dir

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def chromium() -> Iterator[Any]:
    """A headless Chromium (a fixture's body); skips where none is installed."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="the dev extra installs playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium: scripts/setup-host.sh installs it for the tests")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox"])  # root in CI: no user namespace
        yield b
        b.close()


class Shots:
    """Screenshots into a test's artifacts folder, numbered in order."""

    def __init__(self, nodeid: str) -> None:
        self.folder = artifact_dir(nodeid)
        self.n = 0

    def __call__(self, page: Any, name: str) -> None:
        self.n += 1
        page.screenshot(path=str(self.folder / f"{self.n:02d}-{name}.png"), full_page=True)
