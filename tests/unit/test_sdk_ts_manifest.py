"""The TypeScript SDK's lock file agrees with its manifest, so `npm install` (or `npm ci`)
in a fresh checkout leaves the tree clean: npm rewrites the lock file's root entry from
package.json when the two differ (round 4 found `engines.node` ">=20" in the lock file
against ">=18" in package.json, and every install dirtied the checkout)."""

from __future__ import annotations

import json
from pathlib import Path

SDK = Path(__file__).resolve().parents[2] / "sdk-ts"


def test_the_lock_files_root_entry_is_the_manifests() -> None:
    manifest = json.loads((SDK / "package.json").read_text())
    lock = json.loads((SDK / "package-lock.json").read_text())
    root = lock["packages"][""]
    assert lock["name"] == root["name"] == manifest["name"]
    assert lock["version"] == root["version"] == manifest["version"]
    for field in ("engines", "dependencies", "devDependencies", "license"):
        assert root.get(field) == manifest.get(field), field
