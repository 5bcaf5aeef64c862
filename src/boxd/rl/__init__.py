"""boxd.rl: Gymnasium environments that run in machines.

`Env` is a `gymnasium.Env` whose environment lives in its own fork of a warm
baseline machine; `VectorEnv` is a Gymnasium 1.x vector env of such forks, stepped
concurrently; `boxd.rl.sb3.VecEnv` is the same for Stable-Baselines3; `verify` runs an
env in fresh forks with one seed and says whether, and where, they diverge;
`Env.branch`/`Env.save` continue an episode from one moment in several machines, or
return to it (`EnvState`). An env
server runs inside each machine (``boxd.rl._server``) and speaks a framed, pickle-free
codec over a process stream (`boxd.Boxd().machines.spawn`). Needs ``boxd[rl]``
(gymnasium, cloudpickle). See docs/rl.md.
"""

from __future__ import annotations

try:
    import gymnasium as _gymnasium  # noqa: F401 - fail early, with the fix
except ImportError as _exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"boxd.rl needs gymnasium, numpy and cloudpickle ({_exc.name} is missing): "
        "pip install 'boxd[rl]'") from _exc

from boxd.rl._branch import EnvState
from boxd.rl._channel import Channel, Home, LocalHome, local
from boxd.rl._env import DEFAULT_RESET_MODE, RESET_MODES, Env, ResetMode
from boxd.rl._errors import EnvError, EnvModuleNotFound, EnvServerLost, EnvTimeout
from boxd.rl._vector import RECOVERED, VectorEnv
from boxd.rl._verify import Divergence, VerifyReport, verify

__all__ = [
    "DEFAULT_RESET_MODE",
    "RECOVERED",
    "RESET_MODES",
    "Channel",
    "Divergence",
    "Env",
    "EnvError",
    "EnvModuleNotFound",
    "EnvServerLost",
    "EnvState",
    "EnvTimeout",
    "Home",
    "LocalHome",
    "ResetMode",
    "VectorEnv",
    "VerifyReport",
    "local",
    "verify",
]
