"""`boxd.rl.verify(seeds=...)`: many seeds, one pair each, on local env servers (the
same code drives machines in tests/integration/test_rl_verify.py)."""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner
from tests._support import leaky_envs, rl_envs

import boxd.rl as rl
from boxd import errors
from boxd.cli import main as cli
from boxd.rl import _verify


def test_a_clean_env_over_many_seeds_is_identical_and_distinct() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def progress(report: rl.VerifyReport) -> None:
        with lock:
            seen.append(report.seed)

    report = rl.verify(rl.local(), "CartPole-v1", seeds=range(6), steps=40, jobs=3,
                       progress=progress)
    assert isinstance(report, rl.SweepReport)
    assert report.identical and report.diverged == []
    assert [p.seed for p in report.pairs] == list(range(6))  # in seed order
    assert sorted(seen) == list(range(6))
    assert report.distinct == 6  # each seed its own trajectory
    assert all(p.identical and len(p.digest) == 64 for p in report.pairs)
    jsonschema.validate(report.to_json(), _verify.REPORT_SCHEMA)
    rows = dict(report.rows())
    assert rows["identical"] == "yes" and rows["distinct trajectories"] == "6"


def test_template_runs_fork_one_built_env_and_still_catch_a_leak() -> None:
    clean = rl.verify(rl.local(), "CartPole-v1", seeds=range(4), steps=30, template=True)
    assert clean.identical and clean.distinct == 4
    leaky = rl.verify(rl.local(), functools.partial(leaky_envs.UrandomEnv, reads_at=7),
                      seeds=range(2), steps=10, template=True, pickle_by_value=[leaky_envs])
    assert [p.first_divergence.step for p in leaky.pairs if p.first_divergence] == [7, 7]
    assert all(p.likely_cause and p.likely_cause.startswith(_verify.CAUSE_RNG)
               for p in leaky.pairs)


def test_a_constant_env_is_reported_as_one_trajectory() -> None:
    report = rl.verify(rl.local(), leaky_envs.ConstantEnv, seeds=[3, 1, 2], steps=15,
                       pickle_by_value=[leaky_envs])
    assert report.identical and report.distinct == 1
    assert [p.seed for p in report.pairs] == [3, 1, 2]


@pytest.mark.parametrize(("env", "cause", "read"), [
    (functools.partial(rl_envs.ClockEnv, reads_at=37), _verify.CAUSE_CLOCK, "time.time_ns"),
    (functools.partial(leaky_envs.UrandomEnv, reads_at=37), _verify.CAUSE_RNG, "os.urandom"),
], ids=["clock", "urandom"])
def test_every_pair_of_a_leaky_env_diverges_at_its_step(env: Any, cause: str,
                                                        read: str) -> None:
    report = rl.verify(rl.local(), env, seeds=range(3), steps=45,
                       pickle_by_value=[rl_envs, leaky_envs])
    assert not report.identical and len(report.diverged) == 3
    for p in report.pairs:
        d = p.first_divergence
        assert d is not None and (d.step, d.field) == (37, "obs")
        # the traced replay names what step 37 read (no rewind needed)
        assert p.likely_cause == f"{cause} (step 37 read {read})"
    out = report.to_json()
    jsonschema.validate(out, _verify.REPORT_SCHEMA)
    assert out["diverged"] == 3 and out["pairs"][0]["first_divergence"]["step"] == 37
    assert dict(report.rows())["cause (3 seeds)"] == cause


def test_a_failing_env_stops_the_sweep_and_raises() -> None:
    with pytest.raises(rl.EnvError, match="crash at 2"):
        rl.verify(rl.local(), rl_envs.CrashEnv, seeds=range(50), steps=5, jobs=2,
                  pickle_by_value=[rl_envs])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"seed": 1, "seeds": [1]}, "not both"),
    ({}, "not both"),
    ({"seeds": []}, "empty"),
    ({"seeds": [1, 1]}, "repeat"),
    ({"seeds": [1], "jobs": 0}, "jobs"),
    ({"seeds": [1], "runs": 1}, "2 runs"),
])
def test_bad_arguments_are_typed_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=match):
        rl.verify(rl.local(), "CartPole-v1", steps=5, **kwargs)


def test_source_lists_hold_machine_names_only() -> None:
    with pytest.raises(errors.InvalidRequest, match="list of machine names"):
        rl.verify([rl.local()], "CartPole-v1", seed=1, steps=5)  # type: ignore[list-item]
    with pytest.raises(errors.InvalidRequest, match="list of machine names"):
        rl.verify([], "CartPole-v1", seed=1, steps=5)


def test_digest_is_exact_about_types_and_bytes() -> None:
    import numpy as np

    base = [{"obs": np.zeros(2, dtype=np.float32), "reward": 1.0, "info": {"a": 1}}]
    same = [{"obs": np.zeros(2, dtype=np.float32), "reward": 1.0, "info": {"a": 1}}]
    assert _verify._digest(base) == _verify._digest(same)
    for other in (
        [{"obs": np.zeros(2, dtype=np.float64), "reward": 1.0, "info": {"a": 1}}],
        [{"obs": np.zeros((2, 1), dtype=np.float32), "reward": 1.0, "info": {"a": 1}}],
        [{"obs": np.zeros(2, dtype=np.float32), "reward": 1, "info": {"a": 1}}],
        [{"obs": np.zeros(2, dtype=np.float32), "reward": 1.0000000000000002, "info": {"a": 1}}],
        [{"obs": np.zeros(2, dtype=np.float32), "reward": 1.0, "info": {"a": True}}],
    ):
        assert _verify._digest(base) != _verify._digest(other)


def test_cli_seeds_option_and_schema() -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["rl", "verify", "--schema", "x", "y"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == json.loads(json.dumps(_verify.REPORT_SCHEMA))
    for bad, why in (("5:5", "holds no seed"), ("a:b", "START:STOP")):
        out = runner.invoke(cli, ["rl", "verify", "m", "CartPole-v1", "--seeds", bad])
        assert out.exit_code == 2 and why in out.output, out.output
    out = runner.invoke(cli, ["rl", "verify", "m", "CartPole-v1", "--seeds", "0:3",
                              "--seed", "1"])
    assert out.exit_code == 2 and "not both" in out.output


def test_the_trace_sees_only_the_envs_own_thread_and_restores_what_it_patched() -> None:
    import os
    import threading
    import time

    from boxd.rl import _trace

    class Reader(rl_envs.CountEnv):
        def step(self, action: Any) -> Any:
            out = super().step(action)
            if self.count == 2:
                os.urandom(1)
                with open("/etc/hostname", "rb"):
                    pass
            return out

    before = (time.time, os.urandom, open)
    env = _trace.traced(Reader, {"ends": 100})
    stop = threading.Event()
    other = threading.Thread(target=lambda: [time.time() for _ in iter(stop.is_set, True)])
    other.start()
    try:
        env.reset(seed=0)
        for _ in range(3):
            env.step(0)
    finally:
        stop.set()
        other.join()
    assert env.boxd_reads == {2: ["identity:open(/etc/hostname)", "rng:os.urandom"]}
    assert (time.time, os.urandom, open) == before


def test_a_read_the_trace_cannot_see_is_said_so() -> None:
    report = rl.verify(rl.local(), functools.partial(leaky_envs.BoundClockEnv, reads_at=4),
                       seed=0, steps=8, pickle_by_value=[leaky_envs])
    assert report.first_divergence is not None and report.first_divergence.step == 4
    assert report.likely_cause == _verify.CAUSE_UNTRACED  # no machine to rewind locally
