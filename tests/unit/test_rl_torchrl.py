"""TorchRL's ``GymWrapper`` over ``boxd.rl.VectorEnv`` (issue 15: a drop-in for TorchRL).

TorchRL accepts a Gymnasium vector env only in SAME_STEP or DISABLED autoreset mode (it
reads ``autoreset_mode``). The sub-envs run in real env servers (local subprocesses,
`boxd.rl.local()`), and the rollout is compared with one over Gymnasium's own
``SyncVectorEnv``: same seed, same policy, same tensors.
"""

from __future__ import annotations

from typing import Any

import pytest

gym = pytest.importorskip("gymnasium", reason="boxd.rl needs gymnasium: pip install 'boxd[rl]'")
torch = pytest.importorskip("torch", reason="TorchRL needs torch: pip install torch==2.13.0")
torchrl_envs = pytest.importorskip(
    "torchrl.envs", reason="torchrl is not installed (it comes with the dev extras: "
    "pip install -e '.[server,dev]'); TorchRL's check needs it")

import boxd.rl as rl  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _rollout(venv: Any, steps: int = 60) -> Any:
    env = torchrl_envs.GymWrapper(venv)
    env.set_seed(7)
    torch.manual_seed(0)  # the random policy draws from torch's generator
    return env.rollout(steps, break_when_any_done=False)


@pytest.mark.parametrize("mode", ["SameStep", "Disabled"])
def test_gym_wrapper_rolls_out_boxd_vector_env_like_sync_vector_env(mode: str) -> None:
    ours = rl.VectorEnv("CartPole-v1", 2, source=rl.local(), autoreset_mode=mode)
    ref = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2,
                                   autoreset_mode=gym.vector.AutoresetMode(mode))
    try:
        got, want = _rollout(ours), _rollout(ref)
        assert got.batch_size == want.batch_size == torch.Size([2, 60])
        for key in ["observation", "action", ("next", "observation"), ("next", "reward"),
                    ("next", "terminated"), ("next", "truncated"), ("next", "done")]:
            assert torch.equal(got[key], want[key]), key
    finally:
        ours.close()
        ref.close()


def test_gym_wrapper_refuses_next_step_mode() -> None:
    ours = rl.VectorEnv("CartPole-v1", 1, source=rl.local())  # NEXT_STEP, the default
    try:
        with pytest.raises(RuntimeError, match="SAME_STEP or DISABLED"):
            torchrl_envs.GymWrapper(ours)
    finally:
        ours.close()
