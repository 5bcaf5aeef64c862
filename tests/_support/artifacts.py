"""Where a test run keeps what a person looks at afterwards (screenshots of the browser
tests): ``$BOXD_TEST_ARTIFACTS`` if set, else ``<repo>/test-artifacts``; one folder per
test. CI keeps the folder as the run's artifacts; it is not in git."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .daemon import REPO

ROOT = Path(os.environ.get("BOXD_TEST_ARTIFACTS") or REPO / "test-artifacts")


def artifact_dir(nodeid: str) -> Path:
    """The folder of the test ``nodeid`` (created), e.g.
    ``test-artifacts/test_console/test_the_table_updates_live``."""
    module, _, name = nodeid.partition("::")
    folder = ROOT / Path(module).stem / re.sub(r"[^A-Za-z0-9_.-]+", "_", name or "module")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
