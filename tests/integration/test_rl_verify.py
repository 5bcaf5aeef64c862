"""`boxd.rl.verify` over many seeds on real machines (gVisor: the engine `auto` picks
here, and the fast one): clean envs are identical pair by pair and distinct across
seeds; leaky ones diverge at their step in every pair, with the right cause; the CLI's
exit code and its --json report (checked against the documented schema)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import boxd.rl as rl
from boxd import errors
from boxd.rl import _verify
from tests._support import leaky_envs, rl_envs
from tests._support.rl_guest import GUEST_WHEELS, _host_wheels, _ok

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def verify_base(client: Any, gvisor_base: Any) -> Iterator[Any]:
    """A fork of the gVisor base with gymnasium, numpy and cloudpickle installed."""
    m = client.machines.fork(gvisor_base.id, "rl-verify-base")
    try:
        client.machines.wait_until_ready(m.id)
        for whl in _host_wheels():
            client.machines.files.upload(m.id, f"{GUEST_WHEELS}/{whl.name}", whl.read_bytes())
        _ok(client, m.id, f"pip install -q --no-cache-dir --no-index --find-links "
            f"{GUEST_WHEELS} gymnasium numpy cloudpickle && rm -rf {GUEST_WHEELS}", timeout=900)
        _ok(client, m.id, "python3 -c 'import gymnasium; gymnasium.make(\"CartPole-v1\")'")
        yield client.machines.get(m.id)
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)


def _ours(client: Any, base: Any) -> list[str]:
    return [m.name for m in client.machines.list() if m.parent_id == base.id]


def test_twenty_seeds_of_cartpole_are_twenty_identical_distinct_pairs(
        client: Any, verify_base: Any) -> None:
    report = rl.verify(verify_base.id, "CartPole-v1", seeds=range(20), steps=100,
                       boxd=client)
    assert report.identical, [(p.seed, p.first_divergence) for p in report.diverged]
    assert len(report.pairs) == 20 and report.distinct == 20
    assert all(len(set(p.machines)) == 2 for p in report.pairs)  # two forks per seed
    jsonschema.validate(report.to_json(), _verify.REPORT_SCHEMA)
    assert _ours(client, verify_base) == []


@pytest.mark.parametrize(("env", "cause"), [
    (functools.partial(rl_envs.ClockEnv, reads_at=37), _verify.CAUSE_CLOCK),
    (functools.partial(leaky_envs.UrandomEnv, reads_at=37), _verify.CAUSE_RNG),
], ids=["clock", "urandom"])
def test_a_leaky_env_diverges_at_its_step_in_every_pair_with_its_cause(
        client: Any, verify_base: Any, env: Any, cause: str) -> None:
    report = rl.verify(verify_base.id, env, seeds=range(4), steps=45, boxd=client,
                       pickle_by_value=[rl_envs, leaky_envs])
    assert len(report.diverged) == 4
    for p in report.pairs:
        d = p.first_divergence
        assert d is not None and (d.step, d.field) == (37, "obs"), d
        assert p.likely_cause is not None and p.likely_cause.startswith(cause), p.likely_cause
    assert _ours(client, verify_base) == []


def test_an_untraceable_read_falls_back_on_the_rewound_replay(
        client: Any, verify_base: Any) -> None:
    env = functools.partial(leaky_envs.BoundClockEnv, reads_at=6)
    one = rl.verify(verify_base.id, env, seed=0, steps=10, boxd=client,
                    pickle_by_value=[leaky_envs])
    assert one.first_divergence is not None and one.first_divergence.step == 6
    assert one.likely_cause == _verify.CAUSE_OUTSIDE  # the rewound replay diverged too
    many = rl.verify(verify_base.id, env, seeds=range(2), steps=10, boxd=client,
                     pickle_by_value=[leaky_envs])
    assert [p.likely_cause for p in many.pairs] == [_verify.CAUSE_UNTRACED] * 2
    assert _ours(client, verify_base) == []


def test_cli_exit_codes_and_json_report(client: Any, verify_base: Any, daemon: Any) -> None:
    env = {**os.environ, "BOXD_HOME": str(daemon.home)}
    boxd_cli = str(Path(sys.executable).parent / "boxd")
    schema = json.loads(subprocess.run([boxd_cli, "rl", "verify", "--schema", "-", "-"],
                                       capture_output=True, text=True, check=True).stdout)
    ok = subprocess.run([boxd_cli, "rl", "verify", verify_base.id, "CartPole-v1",
                         "--seeds", "0:4", "--steps", "50", "--json"],
                        capture_output=True, text=True, env=env, timeout=900)
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    jsonschema.validate(out, schema)
    assert out["identical"] and out["seeds"] == 4 and out["distinct"] == 4
    # an env whose first step reads the kernel RNG (installed in the machine by path)
    client.machines.files.upload(verify_base.id, "/home/boxd/leaky_envs.py",
                                 Path(leaky_envs.__file__).read_bytes())
    bad = subprocess.run([boxd_cli, "rl", "verify", verify_base.id, "leaky_envs:UrandomEnv",
                          "--seeds", "0:2", "--steps", "10", "--json"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert bad.returncode == 1, bad.stderr
    out = json.loads(bad.stdout)
    jsonschema.validate(out, schema)
    assert out["diverged"] == 2 and not out["identical"]
    for p in out["pairs"]:
        assert p["first_divergence"]["step"] == 5
        assert "differs between forks" in p["likely_cause"]
