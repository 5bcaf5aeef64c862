"""Guest packages for the RL integration tests: the host downloads gymnasium and numpy
wheels (its own pip configuration) and uploads them, so no guest reaches an index; and
the spec's warm baseline made from them (`warm_rl_base`)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from boxd import errors

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "rl"
WHEELS = REPO / ".cache" / "wheels-rl"
GUEST_WHEELS = "/root/wheels"


def _ok(client, ref: str, cmd: str, timeout: float | None = 300) -> str:  # type: ignore[no-untyped-def]
    r = client.machines.exec(ref, cmd, timeout=timeout)
    assert r.exit_code == 0, f"{cmd!r} exited {r.exit_code}: {r.stdout[-500:]} {r.stderr[-1500:]}"
    return str(r.stdout)


def _host_wheels() -> list[Path]:
    """gymnasium + numpy wheels for the guest (CPython 3.11, x86-64 glibc, like the host)."""
    have = sorted(WHEELS.glob("*.whl"))
    if any(p.name.startswith("gymnasium-") for p in have) and any(
        p.name.startswith("numpy-") for p in have
    ):
        return have
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
           "-d", str(WHEELS), "gymnasium", "numpy"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"host cannot download gymnasium/numpy wheels: {r.stderr[-500:]}")
    return sorted(WHEELS.glob("*.whl"))


def warm_rl_base(client, source_id: str, pip: str):  # type: ignore[no-untyped-def]
    """Fork ``source_id`` into ``rl-base`` and warm it as the spec's "Prepare one warm
    baseline" does: gymnasium and numpy installed by ``pip`` from wheels the host
    downloaded (put in ``GUEST_WHEELS``), then ``warm_up.py``. Deleted if that fails."""
    wheels = _host_wheels()
    m = client.machines.fork(source_id, "rl-base")
    try:
        client.machines.wait_until_ready(m.id)
        for whl in wheels:
            client.machines.files.upload(m.id, f"{GUEST_WHEELS}/{whl.name}", whl.read_bytes())
        _ok(client, m.id, pip, timeout=900)
        client.machines.files.upload(m.id, "/home/boxd/warm_up.py",
                                     (EXAMPLES / "warm_up.py").read_text())
        out = _ok(client, m.id, "python3 warm_up.py", timeout=600)
        assert "warm worker pid" in out
        return client.machines.get(m.id)
    except BaseException:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)
        raise
