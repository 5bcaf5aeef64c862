"""A small OpenEnv environment, its server and its client (docs/openenv.md).

The server is openenv-core's own ``create_app``; run it in a machine on port 8080:

    python3 -m uvicorn counter_env:app --host 0.0.0.0 --port 8080

The episode state lives at module level (one ``World`` per server process, not one per
WebSocket session), with a file it appends to on every step and a ``nonce`` drawn when
the process started. That is what makes the server forkable: every fork of a machine
whose server is running shares the nonce (the same first observation in every session),
and a client that connects to a branch (``BoxdProvider.branch``) re-attaches to the
episode as it was at the branch, because the session's state is not tied to the
WebSocket connection that the fork cut.

The client is an ordinary ``EnvClient`` subclass: nothing in it knows about boxd.
"""

from __future__ import annotations

import os
import random
import threading
from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LOG = "/tmp/counter_env.log"


class CounterAction(Action):
    """Add ``delta`` to the counter."""

    delta: int = 1


class CounterObservation(Observation):
    """The counter, the lines of the step log, and the server process's nonce."""

    count: int = 0
    log_lines: int = 0
    nonce: float = 0.0
    pid: int = 0


class World:
    """The server process's episode: the counter and the log file beside it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rng = random.Random(os.urandom(16))
        self.nonce = self.rng.random()  # drawn once per server process
        self.count = 0
        self.steps = 0


WORLD = World()


class CounterEnv(Environment[CounterAction, CounterObservation, State]):
    """Every session drives the process's one ``WORLD`` (see the module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> CounterObservation:
        with WORLD.lock:
            WORLD.count = seed or 0
            WORLD.steps = 0
            if os.path.exists(LOG):
                os.remove(LOG)
            return self._observe(reward=0.0)

    def step(self, action: CounterAction, timeout_s: float | None = None,
             **kwargs: Any) -> CounterObservation:
        with WORLD.lock:
            WORLD.count += action.delta
            WORLD.steps += 1
            with open(LOG, "a") as f:
                f.write(f"{action.delta}\n")
            return self._observe(reward=float(action.delta) + WORLD.rng.random())

    @property
    def state(self) -> State:
        return State(step_count=WORLD.steps, count=WORLD.count, nonce=WORLD.nonce)

    def close(self) -> None:
        pass  # the world outlives a session: a later one re-attaches to it

    def _observe(self, reward: float) -> CounterObservation:
        lines = 0
        if os.path.exists(LOG):
            with open(LOG) as f:
                lines = f.read().count("\n")
        return CounterObservation(count=WORLD.count, log_lines=lines, nonce=WORLD.nonce,
                                  pid=os.getpid(), reward=reward, done=False)


app = create_app(CounterEnv, CounterAction, CounterObservation, env_name="counter_env",
                 max_concurrent_envs=8)


class CounterClient(EnvClient[CounterAction, CounterObservation, State]):
    """The env's OpenEnv client: an unmodified ``EnvClient`` subclass."""

    def _step_payload(self, action: CounterAction) -> dict[str, Any]:
        return {"delta": action.delta}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[CounterObservation]:
        obs = CounterObservation(**payload["observation"], reward=payload.get("reward"),
                                 done=payload.get("done", False))
        return StepResult(observation=obs, reward=payload.get("reward"),
                          done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)
