"""Fixtures shared by the integration modules (the session's daemon, client and QEMU
base machine are in tests/conftest.py)."""

from __future__ import annotations

import contextlib

import pytest

from boxd import errors
from tests._support.machines import _gvisor_status


@pytest.fixture(scope="module")
def gvisor_base(client):  # type: ignore[no-untyped-def]
    """A gVisor base machine per module (skips, with the probe's reason, where runsc
    cannot run sandboxes)."""
    status, why = _gvisor_status(client)
    if status != "ok":
        pytest.skip(f"gvisor unavailable here: {why}")
    m = client.machines.new("gbase", engine="gvisor")
    client.machines.wait_until_ready(m.id, timeout=120)
    yield client.machines.get(m.id)
    with contextlib.suppress(errors.NotFound):
        client.machines.delete(m.id)
