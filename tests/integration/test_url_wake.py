"""The request that wakes a machine through its URL is the one served (docs/lifecycle.md#urls).

One machine for the module: Python's http.server on the guest's 8080, then a single
GET (no retry) through ``Machine.url`` right after a hibernate and right after a
checkpoint restore; each must answer 200 with the page.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.vm


def _get_once(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=120) as resp:
        return resp.status, resp.read().decode()


def _get_eventually(url: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            return _get_once(url)[1]
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
            time.sleep(0.5)
    raise AssertionError(f"no answer on {url}: {last}")


@pytest.fixture(scope="module")
def served(client: Any) -> Iterator[Any]:
    m = client.machines.new(f"url-wake-{int(time.time())}")
    try:
        client.machines.wait_until_ready(m.id, timeout=600)
        client.machines.files.upload(m.id, "/srv/www/index.html", "v1")
        r = client.machines.exec(
            m.id, "cd /srv/www && nohup python3 -m http.server 8080 >/tmp/http.log 2>&1 &")
        assert r.exit_code == 0, r.stderr
        m = client.machines.get(m.id)
        assert m.url and _get_eventually(m.url + "/") == "v1"
        yield m
    finally:
        client.machines.delete(m.id)


def test_the_first_request_after_a_hibernate_is_served(client: Any, served: Any) -> None:
    client.machines.hibernate(served.id)
    assert client.machines.get(served.id).state.value == "hibernated"
    t = time.monotonic()
    assert _get_once(served.url + "/") == (200, "v1")
    took = time.monotonic() - t
    assert client.machines.get(served.id).state.value == "running", took


def test_the_first_request_after_a_checkpoint_restore_is_served(
    client: Any, served: Any
) -> None:
    client.machines.checkpoints.save(served.id, "serving")
    client.machines.files.upload(served.id, "/srv/www/index.html", "v2")
    assert _get_once(served.url + "/") == (200, "v2")
    restored = client.machines.checkpoints.restore(served.id, "serving")
    assert restored.url == served.url
    assert _get_once(served.url + "/") == (200, "v1")
