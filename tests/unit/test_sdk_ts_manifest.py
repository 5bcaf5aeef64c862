"""The TypeScript SDK's lock file agrees with its manifest, so `npm install` (or `npm ci`)
in a fresh checkout leaves the tree clean: npm rewrites the lock file's root entry from
package.json when the two differ (round 4 found `engines.node` ">=20" in the lock file
against ">=18" in package.json, and every install dirtied the checkout). The same for the
E2B JavaScript test's folder (tests/e2b-js), whose lock pins the SDK it tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("folder", ["sdk-ts", "tests/e2b-js"])
def test_the_lock_files_root_entry_is_the_manifests(folder: str) -> None:
    manifest = json.loads((REPO / folder / "package.json").read_text())
    lock = json.loads((REPO / folder / "package-lock.json").read_text())
    root = lock["packages"][""]
    assert lock["name"] == root["name"] == manifest["name"]
    assert lock.get("version") == root.get("version") == manifest.get("version")
    for field in ("engines", "dependencies", "devDependencies", "license"):
        assert root.get(field) == manifest.get(field), field


def test_the_e2b_js_test_pins_the_sdk() -> None:
    """An exact version in package.json, the same one installed by the lock file."""
    folder = REPO / "tests" / "e2b-js"
    wanted = json.loads((folder / "package.json").read_text())["dependencies"]["e2b"]
    lock = json.loads((folder / "package-lock.json").read_text())
    assert wanted[0].isdigit(), f"pin e2b exactly, not {wanted!r}"
    assert lock["packages"]["node_modules/e2b"]["version"] == wanted
