"""Branching and saved states of boxd.rl envs on real machines (issue 26's acceptance).

The env (``branchenv``, a module in the machine) keeps state outside its simulator: a
module-level step counter and a file it appends to on every step; its observations
and rewards depend on both, and on its seeded RNG. One warm gVisor baseline for the
module (gVisor forks are the fast ones here); every env forks it.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence

import boxd.rl as rl
from boxd import errors
from tests._support.rl_guest import EXAMPLES, GUEST_WHEELS, _host_wheels, _ok

pytestmark = pytest.mark.vm

BRANCH_ENV = '''
import os
import gymnasium as gym
import numpy as np

LOG = "/tmp/branchenv.log"
COUNTER = 0  # module-level: outside the env object, outside the simulator


class BranchEnv(gym.Env):
    observation_space = gym.spaces.Box(-1e9, 1e9, (4,), np.float64)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = 0
        if os.path.exists(LOG):
            os.remove(LOG)
        return self._obs(), {}

    def step(self, action):
        global COUNTER
        COUNTER += 1
        with open(LOG, "a") as f:
            f.write(f"{int(action)}\\n")
        self.pos += int(action) - 1
        with open(LOG) as f:
            text = f.read()
        reward = float(sum(int(c) for c in text.split()) % 7) - self.np_random.random()
        return self._obs(), reward, False, False, {"counter": COUNTER, "log": text}

    def _obs(self):
        lines = open(LOG).read().count("\\n") if os.path.exists(LOG) else 0
        return np.array([self.pos, COUNTER, lines, self.np_random.random()])

    def outside(self):
        """The state that lives outside the simulator: the counter and the file."""
        return COUNTER, (open(LOG).read() if os.path.exists(LOG) else "")


def make():
    return BranchEnv()
'''


@pytest.fixture(scope="module")
def branch_base(client: Any, gvisor_base: Any) -> Iterator[Any]:
    """A fork of the gVisor base with gymnasium and numpy installed, and ``branchenv``."""
    m = client.machines.fork(gvisor_base.id, "rl-branch-base")
    try:
        client.machines.wait_until_ready(m.id)
        for whl in _host_wheels():
            client.machines.files.upload(m.id, f"{GUEST_WHEELS}/{whl.name}", whl.read_bytes())
        _ok(client, m.id, f"pip install -q --no-cache-dir --no-index --find-links "
            f"{GUEST_WHEELS} gymnasium numpy cloudpickle && rm -rf {GUEST_WHEELS}", timeout=900)
        client.machines.files.upload(m.id, "/home/boxd/branchenv.py", BRANCH_ENV)
        _ok(client, m.id, "cd /home/boxd && python3 -c 'import branchenv'")
        yield client.machines.get(m.id)
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)


def _roll(env: Any, actions: list[int]) -> list[Any]:
    return [env.step(a) for a in actions]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(data_equivalence(x, y) for x, y in zip(a, b, strict=True))


def _machines(client: Any) -> set[str]:
    return {m.id for m in client.machines.list()}


ACTIONS = [int(a) for a in np.random.default_rng(0).integers(0, 3, 60)]


def test_branch_mid_episode_copies_outside_state_and_continues_identically(
        client: Any, branch_base: Any) -> None:
    before = _machines(client)
    env = rl.Env("branchenv:make", source=branch_base.id, boxd=client)
    branches: list[Any] = []
    try:
        env.reset(seed=3)
        _roll(env, ACTIONS[:20])
        at20 = env.call("outside")
        assert at20[0] == 20 and at20[1].count("\n") == 20
        branches = env.branch(4)
        assert len({b.machine for b in branches} | {env.machine}) == 5
        for b in branches:  # the counter and the file, as at step 20
            assert b.call("outside") == at20
        # The same actions in a branch and in the original: identical steps.
        original = _roll(env, ACTIONS[20:40])
        same = _roll(branches[0], ACTIONS[20:40])
        assert _same(original, same)
        # Different actions diverge; the original is not affected by them.
        other = _roll(branches[1], [(a + 1) % 3 for a in ACTIONS[20:40]])
        assert not _same(original, other)
        assert env.call("outside")[0] == 40 and branches[2].call("outside") == at20
        # A branch can be branched again: from its own moment.
        (again,) = branches[0].branch(1)
        branches.append(again)
        assert again.call("outside") == branches[0].call("outside")
        assert _same(_roll(again, ACTIONS[40:50]), _roll(branches[0], ACTIONS[40:50]))
        assert _same(_roll(env, ACTIONS[40:50]), _roll(branches[3],
                                                      ACTIONS[20:40] + ACTIONS[40:50])[-10:])
    finally:
        for b in branches:
            b.close()
        env.close()
    assert _machines(client) <= before, "every branch's machine is deleted"


def test_save_then_load_twice_returns_to_the_same_state(client: Any, branch_base: Any) -> None:
    env = rl.Env("branchenv:make", source=branch_base.id, boxd=client)
    try:
        env.reset(seed=5)
        _roll(env, ACTIONS[:10])
        state = env.save()
        first = _roll(env, ACTIONS[10:40])
        env.load(state)
        assert env.call("outside")[0] == 10
        second = _roll(env, ACTIONS[10:40])
        env.load(state)
        third = _roll(env, ACTIONS[10:40])
        assert _same(first, second) and _same(second, third)
        assert first[-1][4]["counter"] == 40
        state.delete()
        with pytest.raises(errors.CheckpointNotFound):
            env.load(state)
        state.delete()  # idempotent
        (branch,) = env.branch(1)
        try:
            with pytest.raises(errors.InvalidRequest, match="saved in machine"):
                branch.load(env.save())
        finally:
            branch.close()
    finally:
        env.close()


def test_vector_env_branch_of_one_sub_env(client: Any, branch_base: Any) -> None:
    envs = rl.VectorEnv("branchenv:make", 3, source=branch_base.id, boxd=client)
    group = None
    try:
        envs.reset(seed=11)
        for t in range(5):
            envs.step(np.array([ACTIONS[t], ACTIONS[t + 1], ACTIONS[t + 2]]))
        at = envs.call("outside")[2]
        group = envs.branch(2, 4)
        assert group.num_envs == 4 and group.observation_space.shape == (4, 4)
        assert all(o == at for o in group.call("outside"))
        # Every sub-env continues sub-env 2's episode: the same actions give the same
        # steps as sub-env 2's own, in all four.
        for t in range(5, 10):
            obs, rew, term, trunc, info = group.step(np.full(4, ACTIONS[t]))
            o2, r2, *_ = envs.step(np.array([0, 0, ACTIONS[t]]))
            assert obs in group.observation_space
            assert (obs == o2[2]).all() and (rew == r2[2]).all()
            assert not term.any() and not trunc.any()
            assert list(info["counter"]) == [t + 1] * 4
        # save/load per index
        state = group.save(1)
        after = [group.step(np.full(4, a)) for a in ACTIONS[:3]]
        group.load(1, state)
        again = group.step(np.full(4, ACTIONS[0]))
        assert (again[0][1] == after[0][0][1]).all()
    finally:
        if group is not None:
            group.close()
        envs.close()


def test_lookahead_example_branches_faster_than_it_replays(client: Any,
                                                           branch_base: Any) -> None:
    """examples/rl/lookahead.py: the same decisions both ways, in less time by branching
    (the example prints both times; this is a check, not the benchmark)."""
    ns = runpy.run_path(str(EXAMPLES / "lookahead.py"))
    before = _machines(client)
    out = ns["main"](["--source", branch_base.id, "--prefix", "60", "--decisions", "3",
                      "--horizon", "4"])
    assert out["branch_actions"] == out["replay_actions"]
    assert out["branch_seconds"] < out["replay_seconds"]
    assert _machines(client) <= before


def test_branches_outlive_the_original_and_refork_from_its_template(
        client: Any, branch_base: Any) -> None:
    before = _machines(client)
    env = rl.Env("branchenv:make", source=branch_base.id, boxd=client, reset_mode="refork")
    branches: list[Any] = []
    try:
        first = env.reset(seed=9)
        _roll(env, ACTIONS[:5])
        branches = env.branch(2)
        env.close()  # the branches keep working: the home closes with the last of them
        assert branches[0].call("outside")[0] == 5
        old = branches[0].machine
        again = branches[0].reset(seed=9)  # a fresh fork of the env's built template
        assert branches[0].machine != old and data_equivalence(again, first)
        assert branches[0].call("outside") == (0, "")
        assert branches[1].step(ACTIONS[5])[4]["counter"] == 6  # unaffected by [0]
    finally:
        for b in branches:
            b.close()
        env.close()
    assert _machines(client) <= before


# ------------------------------------------------------- cleanup after a crash (issue 39.6)


def _children(client: Any, parent: str) -> list[Any]:
    return [m for m in client.machines.list() if m.parent_id == parent]


def _wait_for(what: str, cond: Any, timeout: float = 300.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return got


def test_rl_verify_stopped_by_sigterm_deletes_its_forks(client: Any, branch_base: Any) -> None:
    """`boxd rl verify` stopped by SIGTERM while its two forks run deletes them (by their
    labels) before it exits; none counts against the quota after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "boxd", "rl", "verify", branch_base.id, "branchenv:make",
         "--seed", "1", "--steps", "10000000"],
        env={**os.environ, "NO_COLOR": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        def running() -> list[Any]:
            assert proc.poll() is None, proc.communicate()
            forks = [m for m in _children(client, branch_base.id) if m.state == "running"]
            return forks if len(forks) == 2 else []

        forks = _wait_for("verify's two forks to run", running, every=0.2)
        assert {m.labels.get("boxd.rl/owner") for m in forks} == {"verify"}
        run = {m.labels["boxd.rl/run"] for m in forks}
        assert len(run) == 1, "one verify call is one run"
        time.sleep(3)  # the rollouts step in both
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
        assert client.machines.list(labels={"boxd.rl/run": run.pop()}) == [], err
        assert _children(client, branch_base.id) == []
        assert proc.returncode == 128 + signal.SIGTERM, (out, err)
        assert b"stopped by SIGTERM" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for m in _children(client, branch_base.id):  # what a failure leaves
            with contextlib.suppress(errors.NotFound):
                client.machines.delete(m.id)


def test_a_branch_cut_by_a_daemon_kill_leaves_nothing_after_restart_and_close(
        client: Any, branch_base: Any, daemon: Any) -> None:
    """SIGKILL the daemon while `Env.branch(4)` forks; restart it; `env.close()` leaves no
    branch machine (running or failed), as a branch is all or nothing. Last in the
    module: it restarts the session's daemon."""
    before = _machines(client)
    env = rl.Env("branchenv:make", source=branch_base.id, boxd=client)
    outcome: dict[str, Any] = {}
    try:
        env.reset(seed=3)
        _roll(env, ACTIONS[:5])
        parent = env.machine
        assert parent is not None

        def branch() -> None:
            try:
                outcome["branches"] = env.branch(4)
            except BaseException as exc:
                outcome["error"] = exc

        t = threading.Thread(target=branch)
        t.start()
        _wait_for("a branch machine's record", lambda: _children(client, parent), every=0.01)
        daemon.stop(signal.SIGKILL)
        t.join(600)
        assert not t.is_alive()
        daemon.restart()
    finally:
        for b in outcome.get("branches", []):  # the branch may have been completed
            b.close()
        env.close()
    assert _machines(client) <= before, "every branch machine is deleted"
