"""MuJoCo (Gymnasium's HalfCheetah-v5) in machines on both engines: installable in a
baseline, stepping through `boxd.rl.Env` (Gymnasium's check_env passes), identical
across same-seed forks, and trained reproducibly by examples/rl/reproducible_ppo.py.
What the two engines give against each other is measured, not assumed: the report is
printed and docs/rl.md records it."""

from __future__ import annotations

import contextlib
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import boxd.rl as rl
from boxd import errors
from tests._support.rl_guest import EXAMPLES, _ok

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".cache" / "wheels-mujoco"
GUEST_WHEELS = "/root/wheels-mujoco"
ENV = "HalfCheetah-v5"


def _wheels() -> list[Path]:
    """gymnasium[mujoco], numpy and cloudpickle wheels for the guest (CPython 3.11, x86-64
    glibc, like the host), downloaded once into .cache."""
    have = sorted(WHEELS.glob("*.whl"))
    if any(p.name.startswith("mujoco-") for p in have):
        return have
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
           "-d", str(WHEELS), "gymnasium[mujoco]", "numpy", "cloudpickle"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"host cannot download the MuJoCo wheels: {r.stderr[-500:]}")
    return sorted(WHEELS.glob("*.whl"))


def _mujoco_base(client: Any, source: Any, name: str) -> Any:
    m = client.machines.fork(source.id, name)
    try:
        client.machines.wait_until_ready(m.id, timeout=600)
        for whl in _wheels():
            client.machines.files.upload(m.id, f"{GUEST_WHEELS}/{whl.name}", whl.read_bytes())
        _ok(client, m.id, f"pip install -q --no-cache-dir --no-index --find-links "
            f"{GUEST_WHEELS} 'gymnasium[mujoco]' numpy cloudpickle && rm -rf {GUEST_WHEELS}",
            timeout=1200)
        # import once, so the forks find it in the page cache
        _ok(client, m.id, f"python3 -c 'import gymnasium as g; g.make(\"{ENV}\").reset(seed=0)'",
            timeout=600)
        return client.machines.get(m.id)
    except BaseException:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)
        raise


@pytest.fixture(scope="module")
def mujoco_gvisor(client: Any, gvisor_base: Any) -> Iterator[Any]:
    m = _mujoco_base(client, gvisor_base, "mujoco-gvisor")
    yield m
    with contextlib.suppress(errors.NotFound):
        client.machines.delete(m.id)


@pytest.fixture(scope="module")
def mujoco_qemu(client: Any, base: Any) -> Iterator[Any]:
    m = _mujoco_base(client, base, "mujoco-qemu")
    yield m
    with contextlib.suppress(errors.NotFound):
        client.machines.delete(m.id)


@pytest.mark.parametrize("engine", ["gvisor", "qemu"])
def test_mujoco_steps_in_a_machine_and_passes_check_env(
        client: Any, engine: str, request: pytest.FixtureRequest) -> None:
    source = request.getfixturevalue(f"mujoco_{engine}")
    assert source.engine == engine
    env = rl.Env(ENV, source=source.id, boxd=client)
    try:
        check_env(env, skip_render_check=True)
        obs, _ = env.reset(seed=3)
        assert obs.shape == (17,) and obs.dtype == np.float64
        env.action_space.seed(3)
        for _ in range(20):
            obs, reward, *_ = env.step(env.action_space.sample())
            assert np.isfinite(obs).all() and np.isfinite(reward)
    finally:
        env.close()
    # same-seed forks on one engine: byte-identical physics
    report = rl.verify(source.id, ENV, seeds=range(3), steps=200, boxd=client, jobs=3)
    assert report.identical, [(p.seed, p.first_divergence) for p in report.diverged]
    assert report.distinct == 3


def test_mujoco_across_engines_is_reported(client: Any, mujoco_gvisor: Any,
                                           mujoco_qemu: Any) -> None:
    # One run of each pair on each engine. Whether the floating point agrees depends on
    # the CPU features each engine's guest sees (QEMU pins a CPU model; gVisor passes
    # the host's through): the verifier reports which, and where they part.
    report = rl.verify([mujoco_gvisor.id, mujoco_qemu.id], ENV, seeds=range(2), steps=300,
                       boxd=client, jobs=1)
    print("\ncross-engine:", report.rows())
    for p in report.pairs:
        print(p.seed, p.identical, p.first_divergence and
              (p.first_divergence.step, p.first_divergence.field), p.likely_cause)
    assert len(report.pairs) == 2 and report.distinct == 2


def test_reproducible_ppo_example_on_mujoco(client: Any, mujoco_gvisor: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    ns = runpy.run_path(str(EXAMPLES / "reproducible_ppo.py"))
    code = ns["main"](["--source", mujoco_gvisor.id, "--env", ENV, "--envs", "2",
                       "--steps", "256"], boxd=client)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "same seed, same weights: yes; another seed, other weights: yes" in out
