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


# ---------------------------------------------------------------- long sweeps (issue 39)


def _fake_pairs(monkeypatch: pytest.MonkeyPatch, *, fail_at: int | None = None,
                diverge_every: int = 0, record: bool = True) -> list[int]:
    """Replace each seed's pair of forks with a report made on the spot (no machines,
    no env servers); returns the list of seeds run, in the order they started (with
    ``record``)."""
    import hashlib

    started: list[int] = []
    lock = threading.Lock()

    def one_seed(job: Any, seed: int, *, k: int = 0, rewind: bool = True) -> rl.VerifyReport:
        if record:
            with lock:
                started.append(seed)
        if fail_at is not None and seed >= fail_at:
            raise rl.EnvError(f"the env failed at seed {seed}")
        bad = diverge_every > 0 and seed % diverge_every == 0
        return rl.VerifyReport(
            identical=not bad, env="fake", seed=seed, steps=1, runs=2, episodes=1,
            first_divergence=rl.Divergence(1, "obs", (0, 1), (0, 1)) if bad else None,
            likely_cause=f"{_verify.CAUSE_RNG} (step 1 read os.urandom)" if bad else None,
            machines=(None, None), digest=hashlib.sha256(b"%d" % seed).hexdigest())

    monkeypatch.setattr(_verify, "_one_seed", one_seed)
    return started


def test_a_sweep_draws_its_seeds_only_as_pairs_start(monkeypatch: pytest.MonkeyPatch) -> None:
    started = _fake_pairs(monkeypatch, fail_at=100)
    drawn: list[int] = []

    def seeds() -> Any:
        for s in range(10**12):
            # a sweep that turned the seeds into a list first would draw them all here
            assert s < 1000, f"seed {s} drawn: the sweep reads its seeds ahead of its pairs"
            drawn.append(s)
            yield s

    with pytest.raises(rl.EnvError, match=r"at seed 10\d"):
        rl.verify(rl.local(), "CartPole-v1", seeds=seeds(), steps=1, jobs=4)
    # the failure stops the drawing: at most the seeds in flight beyond it were drawn
    assert 100 <= max(drawn) < 100 + 4 + 1
    assert sorted(started) == drawn[: len(started)]


def _sweep_peak(n: int) -> tuple[rl.SweepReport, int]:
    import tracemalloc

    tracemalloc.start()
    try:
        report = rl.verify(rl.local(), "CartPole-v1", seeds=range(n), steps=1, jobs=4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return report, peak


def test_a_long_sweep_keeps_counts_and_a_bounded_sample(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_verify, "PAIRS_KEPT", 50)
    monkeypatch.setattr(_verify, "DIVERGED_KEPT", 20)
    monkeypatch.setattr(_verify, "DISTINCT_KEPT", 300)
    _fake_pairs(monkeypatch, diverge_every=10, record=False)
    short, short_peak = _sweep_peak(400)
    report, peak = _sweep_peak(4000)
    # the counts cover every seed; the reports kept are the first diverged ones
    assert (report.seeds, report.diverged_seeds, report.identical) == (4000, 400, False)
    assert not report.pairs_complete and len(report.pairs) == 20
    assert [p.seed for p in report.pairs] == sorted(p.seed for p in report.pairs)
    assert all(not p.identical for p in report.pairs)
    assert (report.distinct, report.distinct_exact) == (300, False)
    assert report.causes == ((_verify.CAUSE_RNG, 400),)
    rows = dict(report.rows())
    assert rows["identical"] == "NO (400 of 4000 seeds diverge)"
    assert rows["distinct trajectories"] == "at least 300"
    assert rows["cause (400 seeds)"] == _verify.CAUSE_RNG
    out = report.to_json()
    jsonschema.validate(out, _verify.REPORT_SCHEMA)
    assert (out["seeds"], out["diverged"], len(out["pairs"])) == (4000, 400, 20)
    assert out["pairs_complete"] is False and out["distinct_exact"] is False
    # ten times the seeds, not ten times the memory (a report is about 1 KB)
    assert peak < short_peak + 100_000, (short_peak, peak)
    assert short.seeds == 400 and not short.pairs_complete


def test_seeds_are_checked_before_any_machine_is_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started = _fake_pairs(monkeypatch)
    for kwargs, match in (
        ({"seeds": range(-5, -3)}, "seed -5 is out of range"),
        ({"seeds": range(0, 10**23)}, f"seed {10**23 - 1} is out of range"),
        ({"seeds": [3, 2**32]}, "seed 4294967296 is out of range: seeds are 0 to 4294967295"),
        ({"seeds": [1, True]}, "must be an int, not bool"),
        ({"seeds": [1.0]}, "must be an int, not float"),
        ({"seed": -1}, "seed -1 is out of range"),
        ({"seeds": iter([])}, "seeds is empty"),
    ):
        with pytest.raises(errors.InvalidRequest, match=match):
            rl.verify(rl.local(), "CartPole-v1", steps=1, **kwargs)
    assert started == []
    # an iterator's seeds are checked as they are drawn: a bad one stops the sweep
    with pytest.raises(errors.InvalidRequest, match="seed -1 is out of range"):
        rl.verify(rl.local(), "CartPole-v1", seeds=iter([4, -1, 5]), steps=1, jobs=1)
    assert started == [4]
    import numpy as np

    report = rl.verify(rl.local(), "CartPole-v1", seeds=np.arange(3), steps=1)
    assert [type(p.seed) for p in report.pairs] == [int] * 3


@pytest.mark.parametrize(("seeds", "why"), [
    ("-5:-3", "seeds are 0 to 4294967295"),
    ("0:99999999999999999999999", "seeds are 0 to 4294967295"),
    ("0:4294967297", "STOP <= 4294967296"),
    ("0:", "give START:STOP, both ints"),
    (":", "give START:STOP, both ints"),
    (":5", "give START:STOP, both ints"),
    ("7", "(one seed: --seed 7)"),
    ("9:3", "holds no seed"),
])
def test_cli_seeds_are_refused_before_any_machine_is_made(seeds: str, why: str) -> None:
    out = CliRunner().invoke(cli, ["rl", "verify", "m", "CartPole-v1", "--seeds", seeds])
    assert out.exit_code == 2, out.output
    assert why in " ".join(out.output.split()) and "Traceback" not in out.output
    out = CliRunner().invoke(cli, ["rl", "verify", "m", "CartPole-v1", "--seed", "-5"])
    assert out.exit_code == 2 and "0<=x<=4294967295" in out.output, out.output


def test_the_cli_seed_limit_is_boxd_rls() -> None:
    from boxd.cli import _rl

    assert _rl.SEED_LIMIT == _verify.SEED_LIMIT
