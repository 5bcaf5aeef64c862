"""boxd.rl on real machines through the real daemon: the issue's acceptance items.

One warm baseline per session (``rl_warm``: a fork of the session's base machine with
gymnasium, numpy and cloudpickle installed from wheels the host downloads, imported
once so the page cache is warm); every env forks it. The vector semantics are checked
exhaustively against SyncVectorEnv with local servers in tests/unit/test_rl_vector.py;
here the same comparison runs with the sub-envs in machines.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env, data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import boxd.rl as rl
from boxd import errors
from boxd.rl import _verify
from tests._support import rl_envs as _rl_envs
from tests._support.procs import qemu_cmdlines, vm_id_of

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".cache" / "wheels-rl"
GUEST_WHEELS = "/root/wheels-rl"
PACKAGES = ["gymnasium", "numpy", "cloudpickle"]

# A framed echo server in the guest (the process side of machines.spawn).
ECHO = (
    "import sys\n"
    "r, w = sys.stdin.buffer, sys.stdout.buffer\n"
    "while True:\n"
    "    h = r.read(4)\n"
    "    if len(h) < 4: break\n"
    "    body = r.read(int.from_bytes(h, 'big'))\n"
    "    w.write(h + body); w.flush()\n"
)


def _wheels() -> list[Path]:
    have = sorted(WHEELS.glob("*.whl"))
    names = {p.name.split("-")[0].lower() for p in have}
    if all(p in names for p in PACKAGES):
        return have
    WHEELS.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                        "-d", str(WHEELS), *PACKAGES], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        pytest.skip(f"host cannot download the guest's wheels: {r.stderr[-400:]}")
    return sorted(WHEELS.glob("*.whl"))


def _ok(client: Any, ref: str, cmd: str, timeout: float = 600) -> str:
    r = client.machines.exec(ref, cmd, timeout=timeout)
    assert r.exit_code == 0, f"{cmd!r}: {r.stdout[-400:]} {r.stderr[-1200:]}"
    return str(r.stdout)


@pytest.fixture(scope="session")
def rl_warm(client: Any, base: Any) -> Any:
    """The warm baseline: gymnasium, numpy and cloudpickle installed and imported once."""
    m = client.machines.fork(base.id, "rl-warm")
    try:
        client.machines.wait_until_ready(m.id, timeout=300)
        for whl in _wheels():
            client.machines.files.upload(m.id, f"{GUEST_WHEELS}/{whl.name}", whl.read_bytes())
        _ok(client, m.id, f"pip install -q --no-index --find-links {GUEST_WHEELS} "
            + " ".join(PACKAGES), timeout=900)
        _ok(client, m.id, "python3 -c 'import gymnasium, numpy, cloudpickle; "
            "gymnasium.make(\"CartPole-v1\")'")
        yield client.machines.get(m.id)
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)


def _leftovers(client: Any) -> list[str]:
    return [m.name for m in client.machines.list() if m.name.startswith("rl-")
            and m.name != "rl-warm"]


# ---------------------------------------------------------------------------- spawn


def test_spawn_frames_round_trip_fork_and_kill(client: Any, rl_warm: Any) -> None:
    m = client.machines.fork(rl_warm.id, "rl-spawn")
    try:
        client.machines.files.upload(m.id, "/home/boxd/echo.py", ECHO)
        proc = client.machines.spawn(m.id, ["python3", "-u", "/home/boxd/echo.py"])
        for payload in (b"", b"x" * 100, os.urandom(300_000)):
            proc.send(payload)
            assert proc.recv(timeout=60) == payload
        times = []
        for _ in range(200):
            t = time.perf_counter()
            proc.send(b"y" * 100)
            proc.recv(timeout=60)
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"100-byte round trip p50 {times[100] * 1e3:.2f} ms p90 {times[180] * 1e3:.2f} ms")
        assert [p.id for p in client.machines.processes(m.id)] == [proc.id]
        proc.kill()
        with pytest.raises(errors.Conflict, match="exited"):
            proc.recv(timeout=60)
    finally:
        client.machines.delete(m.id)


def test_a_fork_child_runs_its_own_copy_of_a_running_process(client: Any, rl_warm: Any) -> None:
    m = client.machines.fork(rl_warm.id, "rl-parent")
    child = None
    try:
        client.machines.files.upload(m.id, "/home/boxd/echo.py", ECHO)
        proc = client.machines.spawn(m.id, ["python3", "-u", "/home/boxd/echo.py"])
        proc.send(b"before")
        assert proc.recv(timeout=60) == b"before"
        child = client.machines.fork(m.id, "rl-child")
        listed = client.machines.processes(child.id)
        assert [p.id for p in listed] == [proc.id] and listed[0].state == "detached"
        copy = client.machines.attach(child.id, proc.id)
        copy.send(b"in the child")
        proc.send(b"in the parent")
        assert copy.recv(timeout=60) == b"in the child"
        assert proc.recv(timeout=60) == b"in the parent"
        assert client.machines.processes(child.id)[0].state == "running"
        with pytest.raises(errors.Conflict, match="already has a client"):
            client.machines.attach(child.id, proc.id)
        copy.kill()
        proc.send(b"parent lives on")
        assert proc.recv(timeout=60) == b"parent lives on"
    finally:
        for mid in (child.id if child else None, m.id):
            if mid:
                with contextlib.suppress(errors.NotFound):
                    client.machines.delete(mid)


# ---------------------------------------------------------------------------- Env


def _warnings_of(fn: Any, *args: Any, **kwargs: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args, **kwargs)
    return sorted({str(w.message) for w in caught})


def test_env_passes_gymnasium_and_sb3_checkers(client: Any, rl_warm: Any) -> None:
    import gymnasium as gym
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    # An env the checkers find nothing to warn about: through boxd, warnings are errors.
    # (SB3 supports no Tuple observations: its check runs on the Dict variant.)
    for tuple_obs in (True, False):
        env = rl.Env(_rl_envs.BoxEnv, source=rl_warm.id, boxd=client,
                     pickle_by_value=[_rl_envs], tuple_obs=tuple_obs)
        try:
            assert env.machine is not None and env.machine != rl_warm.id
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                check_env(env, skip_render_check=True)
                if not tuple_obs:
                    sb3_check_env(env, warn=True)
        finally:
            env.close()
        assert env.machine not in {m.id for m in client.machines.list()}
    # CartPole's own -inf bounds make the checkers warn even locally: through boxd the
    # warnings are exactly the local ones (the proxy adds none).
    env = rl.Env("CartPole-v1", source=rl_warm.id, boxd=client)
    try:
        local = gym.make("CartPole-v1").unwrapped
        assert _warnings_of(check_env, env, skip_render_check=True) == _warnings_of(
            check_env, local, skip_render_check=True)
        assert _warnings_of(sb3_check_env, env) == _warnings_of(sb3_check_env, local)
    finally:
        env.close()


def test_env_matches_a_local_cartpole_over_200_steps(client: Any, rl_warm: Any) -> None:
    import gymnasium as gym
    from gymnasium.utils.env_match import check_environments_match

    env = rl.Env("CartPole-v1", source=rl_warm.id, boxd=client)
    try:
        check_environments_match(gym.make("CartPole-v1"), env, num_steps=200, seed=7,
                                 skip_render=True)
    finally:
        env.close()


def test_codec_keeps_dtypes_and_containers(client: Any, rl_warm: Any) -> None:
    env = rl.Env(_rl_envs.BoxEnv, source=rl_warm.id, boxd=client, pickle_by_value=[_rl_envs])
    ref = _rl_envs.BoxEnv()
    try:
        obs, _ = env.reset(seed=3)
        want, _ = ref.reset(seed=3)
        assert isinstance(obs, tuple) and isinstance(obs[1], dict)
        assert obs[0].dtype == np.float32 and obs[1]["m"].dtype == np.int8
        assert data_equivalence(obs, want, exact=True)
        _, reward, terminated, truncated, _ = env.step(np.zeros(2, dtype=np.float32))
        assert type(reward) is float and type(terminated) is bool and type(truncated) is bool
    finally:
        env.close()


def test_unimportable_module_is_named_with_both_fixes(client: Any, rl_warm: Any) -> None:
    with pytest.raises(rl.EnvModuleNotFound) as info:
        rl.Env(_rl_envs.CountEnv, source=rl_warm.id, boxd=client)
    assert info.value.module == "tests"
    assert "pickle_by_value" in str(info.value) and "install" in str(info.value)
    assert _leftovers(client) == []


@pytest.mark.parametrize("mode", ["rewind", "refork"])
def test_reset_modes_give_identical_starts(client: Any, rl_warm: Any, mode: str) -> None:
    env = rl.Env("CartPole-v1", source=rl_warm.id, boxd=client, reset_mode=mode)
    try:
        first_machine = env.machine
        obs1, _ = env.reset(seed=5)
        for _ in range(10):
            env.step(1)
        obs2, _ = env.reset(seed=5)
        assert data_equivalence(obs1, obs2, exact=True)
        # The env server was re-attached, not started again: one process in the machine.
        assert len(client.machines.processes(str(env.machine))) == 1
        if mode == "rewind":
            assert env.machine == first_machine
        else:
            assert env.machine != first_machine
            assert first_machine not in {m.id for m in client.machines.list()}
    finally:
        env.close()


# ---------------------------------------------------------------------------- VectorEnv


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP,
                                  AutoresetMode.DISABLED], ids=lambda m: m.value)
def test_vector_env_in_machines_matches_sync_vector_env(
    client: Any, rl_warm: Any, mode: AutoresetMode
) -> None:
    fns = [functools.partial(_rl_envs.CountEnv, ends=3 + i) for i in range(2)]
    ours = rl.VectorEnv(fns, source=rl_warm.id, boxd=client, autoreset_mode=mode,
                        pickle_by_value=[_rl_envs])
    ref = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        assert len(set(ours.machines)) == 2
        assert data_equivalence(ours.reset(seed=1), ref.reset(seed=1), exact=True)
        rng = np.random.default_rng(1)
        for t in range(9):
            actions = rng.integers(0, 3, size=2)
            got, want = ours.step(actions), ref.step(actions)
            assert data_equivalence(got, want, exact=True), f"step {t}: {got} != {want}"
            done = np.logical_or(want[2], want[3])
            if mode == AutoresetMode.DISABLED and done.any():
                opts = {"reset_mask": done}
                assert data_equivalence(ours.reset(options=dict(opts)),
                                        ref.reset(options=dict(opts)), exact=True)
    finally:
        machines = list(ours.machines)
        ours.close()
        ours.close()
    assert not set(machines) & {m.id for m in client.machines.list()}


@pytest.mark.parametrize("kind", ["VectorEnv", "sb3.VecEnv"])
def test_step_async_sends_to_the_machines(client: Any, rl_warm: Any, kind: str) -> None:
    """Sub-envs whose step takes 2 s: after step_async and 6 s of the learner's work,
    step_wait collects within 1 s (were the frames sent only by step_wait, the step
    would take 2 s, and the 1 s timeout would fire)."""
    from boxd.rl.sb3 import VecEnv

    fns = [functools.partial(_rl_envs.CountEnv, delay=2.0) for _ in range(2)]
    env: Any = (rl.VectorEnv if kind == "VectorEnv" else VecEnv)(
        fns, source=rl_warm.id, boxd=client, pickle_by_value=[_rl_envs], step_timeout=1.0)
    try:
        env.reset()
        env.step_async(np.zeros(2, dtype=np.int64))
        time.sleep(6.0)  # the learner's work
        obs = env.step_wait()[0]
        assert obs.tolist() == [1, 1]
    finally:
        env.close()


def _qemu_pid(home: Path, machine_id: str) -> int | None:
    """The machine's QEMU process, found by the ``-name boxd-<vm id>`` on its command
    line (the VM id from the daemon's database: a claimed standby child keeps its own)."""
    vm_id = vm_id_of(home, machine_id)
    for argv in qemu_cmdlines(home):
        if any(a.startswith(f"boxd-{vm_id},") for a in argv):
            out = subprocess.run(["pgrep", "-f", f"boxd-{vm_id},"], capture_output=True,
                                 text=True).stdout.split()
            return int(out[0]) if out else None
    return None


def _kill_one(home: Path, machines: list[str | None]) -> int:
    """SIGKILL the QEMU of one sub-env (the last whose process can be found); its index."""
    for i in reversed(range(len(machines))):
        pid = _qemu_pid(home, str(machines[i]))
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            return i
    raise AssertionError(f"no QEMU process found for any of {machines}")


def test_killed_sub_env_is_named_or_recovered(client: Any, rl_warm: Any, daemon: Any) -> None:
    fns = [functools.partial(_rl_envs.CountEnv, ends=1000 + i) for i in range(2)]
    env = rl.VectorEnv(fns, source=rl_warm.id, boxd=client, pickle_by_value=[_rl_envs],
                       step_timeout=120)
    try:
        env.reset(seed=0)
        env.step(np.zeros(2, dtype=np.int64))
        victim = _kill_one(daemon.home, env.machines)
        with pytest.raises(rl.EnvServerLost) as info:
            env.step(np.zeros(2, dtype=np.int64))
        assert info.value.index == victim and f"sub-env {victim}" in str(info.value)
        assert isinstance(info.value, errors.InfrastructureError)  # never a reward
    finally:
        env.close()

    env = rl.VectorEnv(fns, source=rl_warm.id, boxd=client, pickle_by_value=[_rl_envs],
                       recover=True, step_timeout=120)
    try:
        obs, _ = env.reset(seed=[10, 20])
        obs, *_ = env.step(np.zeros(2, dtype=np.int64))
        assert obs.tolist() == [11, 21]
        before = list(env.machines)
        victim = _kill_one(daemon.home, before)
        other = 1 - victim
        obs, _, _, trunc, infos = env.step(np.zeros(2, dtype=np.int64))
        assert obs[other] == [12, 22][other]  # the other sub-env kept its episode
        assert trunc[victim] and not trunc[other]
        assert infos["_recovered"].tolist() == [i == victim for i in range(2)]
        assert env.machines[victim] != before[victim] and env.machines[other] == before[other]
        obs, *_ = env.step(np.zeros(2, dtype=np.int64))  # NEXT_STEP: the fresh slot resets
        assert obs[other] == [13, 23][other] and obs[victim] == 0
        obs, *_ = env.step(np.zeros(2, dtype=np.int64))
        assert obs[other] == [14, 24][other] and obs[victim] == 1
    finally:
        env.close()


# ---------------------------------------------------------------------------- SB3


def _ppo_weights(client: Any, source: str, n: int = 2, k: int = 1) -> dict[str, Any]:
    import torch
    from stable_baselines3 import PPO

    from boxd.rl.sb3 import VecEnv

    torch.set_num_threads(1)
    venv = VecEnv("CartPole-v1", n, source=source, boxd=client, envs_per_machine=k)
    try:
        assert len(set(venv.machines)) == -(-n // k)
        model = PPO("MlpPolicy", venv, n_steps=32, batch_size=32, n_epochs=2, seed=11,
                    device="cpu", policy_kwargs={"net_arch": [16]})
        model.learn(total_timesteps=64 * n)
        return {k: v.clone() for k, v in model.policy.state_dict().items()}
    finally:
        venv.close()


def test_ppo_over_boxd_is_reproducible(client: Any, rl_warm: Any) -> None:
    import torch

    a = _ppo_weights(client, rl_warm.id)
    b = _ppo_weights(client, rl_warm.id)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed, different weights"


def test_ppo_over_shared_machines_is_reproducible(client: Any, rl_warm: Any) -> None:
    """envs_per_machine=2: 4 sub-envs in 2 machines, 256 timesteps, one seed."""
    import torch

    a = _ppo_weights(client, rl_warm.id, n=4, k=2)
    b = _ppo_weights(client, rl_warm.id, n=4, k=2)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed, different weights"


def test_sb3_vec_env_infos_and_seeding(client: Any, rl_warm: Any) -> None:
    from boxd.rl.sb3 import VecEnv

    fns = [functools.partial(_rl_envs.CountEnv, ends=2) for _ in range(2)]
    venv = VecEnv(fns, source=rl_warm.id, boxd=client, pickle_by_value=[_rl_envs])
    try:
        assert venv.render_mode is None
        venv.seed(100)
        assert venv.reset().tolist() == [100, 101]
        venv.seed(500)  # applies to the next reset of each sub-env: here the autoreset
        venv.set_options({"level": 3})  # applies to every reset from now on
        venv.step_async(np.zeros(2, dtype=np.int64))
        obs, rewards, dones, infos = venv.step_wait()  # 101 and 102: sub-env 1 ends
        assert dones.tolist() == [False, True] and rewards.dtype == np.float32
        assert infos[1]["terminal_observation"] == 102 and obs[1] == 501
        assert infos[1]["TimeLimit.truncated"] is False
        assert venv.reset_infos[1]["options"] == {"level": 3}
        assert venv.env_method("double", 4, indices=[1]) == [8]
        venv.set_attr("tag", "x", indices=0)
        assert venv.get_attr("tag") == ["x", "initial"]
        assert venv.env_is_wrapped(_rl_envs.CountEnv) == [False, False]
    finally:
        venv.close()


# ---------------------------------------------------------------------------- verify


def test_verify_clean_env_is_identical(client: Any, rl_warm: Any) -> None:
    report = rl.verify(rl_warm.id, "CartPole-v1", seed=42, steps=120, boxd=client)
    assert report.identical and report.first_divergence is None and report.episodes >= 2


def test_verify_names_the_step_that_reads_the_clock(client: Any, rl_warm: Any) -> None:
    report = rl.verify(rl_warm.id, functools.partial(_rl_envs.ClockEnv, reads_at=7),
                       seed=1, steps=20, boxd=client, pickle_by_value=[_rl_envs])
    assert not report.identical
    d = report.first_divergence
    assert d is not None and d.step == 7 and d.field == "obs"
    assert report.likely_cause == f"{_verify.CAUSE_CLOCK} (step 7 read time.time_ns)"
    assert _leftovers(client) == []


def test_cli_verify(client: Any, rl_warm: Any, daemon: Any) -> None:
    env = {**os.environ, "BOXD_HOME": str(daemon.home)}
    boxd_cli = str(Path(sys.executable).parent / "boxd")
    ok = subprocess.run([boxd_cli, "rl", "verify", rl_warm.id,
                         "CartPole-v1", "--seed", "42", "--steps", "60"],
                        capture_output=True, text=True, env=env, timeout=900)
    assert ok.returncode == 0, ok.stderr
    assert "identical" in ok.stdout and "yes" in ok.stdout
