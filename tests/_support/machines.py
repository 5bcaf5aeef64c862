"""Helpers for tests on a real daemon's machines: an engine's status, a machine's VM id
(from the daemon's database), a GET through a machine URL that waits for an answer."""

from __future__ import annotations

import sqlite3
import time
import urllib.error
import urllib.request

from boxd.config import Paths


def _gvisor_status(client) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    info = client.info()
    e = next((e for e in info.engines if e.name == "gvisor"), None)
    if e is None:
        return "unavailable", "the daemon does not list a gvisor engine"
    return e.status, e.reason


def _vm_id(daemon, machine_id: str) -> str:  # type: ignore[no-untyped-def]
    with sqlite3.connect(f"file:{Paths(daemon.home.resolve()).db}?mode=ro", uri=True) as db:
        (vm_id,) = db.execute("SELECT vm_id FROM machines WHERE id=?", (machine_id,)).fetchone()
    return str(vm_id)


def _get(url: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                return str(resp.read().decode())
        except urllib.error.HTTPError as exc:  # the daemon's proxy says why (502, 503)
            last = f"{exc}: {exc.read().decode(errors='replace').strip()}"
            time.sleep(0.5)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
            time.sleep(0.5)
    raise AssertionError(f"no answer on {url}: {last}")
