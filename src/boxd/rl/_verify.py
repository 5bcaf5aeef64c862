"""`boxd.rl.verify`: does one seed give one trajectory across fresh forks?

Each run builds the env in a fresh fork of ``source``, resets it with ``seed``, and
steps it ``steps`` times with a seeded policy (by default seeded samples of the action
space), resetting unseeded at episode ends. The runs are compared step by step:
action, observation, reward, terminated, truncated, then every info key, exactly
(same type, dtype and bytes).

``likely_cause`` is a heuristic, stated honestly in docs/rl.md: when the runs
diverge, the first run's machine is rewound to the moment its env was built and the
run replayed there. A replay that also diverges means the env reads something outside
the machine's saved state (the wall clock, timers, the network, thread timing); a
replay that matches means the env reads something that differs *between forks* (the
kernel RNG, reseeded at every fork: ``/dev/urandom``, ``os.urandom``, unseeded
``random``/numpy; the hostname, ``/etc/machine-id``, the network address). A
divergence in the actions is the policy's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gymnasium.utils.env_checker import data_equivalence

from boxd.rl._channel import Home
from boxd.rl._env import Env

if TYPE_CHECKING:
    from boxd.sdk._sync import Boxd

Policy = Callable[[Any], Any]
FIELDS = ("action", "obs", "reward", "terminated", "truncated")

CAUSE_POLICY = ("the policy chose different actions for the same observations: seed it "
                "(the default policy samples the action space seeded with `seed`)")
CAUSE_OUTSIDE = ("the env reads something outside the machine's saved state: the same "
                 "machine rewound and replayed diverges too (the wall clock or timers, the "
                 "network, or thread timing)")
CAUSE_PER_FORK = ("the env reads something that differs between forks: a rewound replay "
                  "of one fork is identical, fresh forks are not (the kernel RNG, reseeded "
                  "at every fork: /dev/urandom, os.urandom, unseeded random or numpy; the "
                  "hostname, /etc/machine-id, the network address)")
CAUSE_UNKNOWN = ("the runs diverge; the replay test needs machines (rewind), so the cause "
                 "was not narrowed down")


@dataclass(frozen=True)
class Divergence:
    """Where two runs first differ: ``step`` 0 is the first reset; ``field`` is one of
    action, obs, reward, terminated, truncated or ``info['KEY']``."""

    step: int
    field: str
    values: tuple[Any, Any]
    runs: tuple[int, int]


@dataclass(frozen=True)
class VerifyReport:
    """The verdict of `verify`."""

    identical: bool
    env: str
    seed: int
    steps: int
    runs: int
    episodes: int
    first_divergence: Divergence | None
    likely_cause: str | None
    machines: tuple[str | None, ...] = field(default=())

    def rows(self) -> list[tuple[str, str]]:
        """The report as (label, value) rows for a table."""
        out = [("env", self.env), ("seed", str(self.seed)), ("steps", str(self.steps)),
               ("runs", str(self.runs)), ("episodes per run", str(self.episodes)),
               ("identical", "yes" if self.identical else "NO")]
        d = self.first_divergence
        if d is not None:
            out += [("first divergence", f"step {d.step}, {d.field}"),
                    (f"run {d.runs[0]}", _short(d.values[0])),
                    (f"run {d.runs[1]}", _short(d.values[1]))]
        if self.likely_cause:
            out.append(("likely cause", self.likely_cause))
        return out


def _short(v: Any, limit: int = 120) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


Record = dict[str, Any]


def _rollout(env: Env, seed: int, steps: int, policy: Policy | None) -> list[Record]:
    obs, info = env.reset(seed=seed)
    env.action_space.seed(seed)
    out: list[Record] = [{"action": None, "obs": obs, "reward": None, "terminated": None,
                          "truncated": None, "info": info}]
    for _ in range(steps):
        action = policy(obs) if policy is not None else env.action_space.sample()
        obs, reward, terminated, truncated, info = env.step(action)
        rec: Record = {"action": action, "obs": obs, "reward": reward,
                       "terminated": terminated, "truncated": truncated, "info": info}
        if terminated or truncated:
            obs, rinfo = env.reset()
            rec["reset_obs"], rec["reset_info"] = obs, rinfo
        out.append(rec)
    return out


def _compare(a: list[Record], b: list[Record], runs: tuple[int, int]) -> Divergence | None:
    for step, (ra, rb) in enumerate(zip(a, b, strict=True)):
        for name in FIELDS:
            if not data_equivalence(ra[name], rb[name], exact=True):
                return Divergence(step, name, (ra[name], rb[name]), runs)
        ia, ib = ra["info"], rb["info"]
        for key in sorted(set(ia) | set(ib), key=str):
            va, vb = ia.get(key, "<missing>"), ib.get(key, "<missing>")
            if not data_equivalence(va, vb, exact=True):
                return Divergence(step, f"info[{key!r}]", (va, vb), runs)
        for name, label in (("reset_obs", "obs after reset"), ("reset_info", "info after reset")):
            if name in ra or name in rb:
                va, vb = ra.get(name), rb.get(name)
                if not data_equivalence(va, vb, exact=True):
                    return Divergence(step, label, (va, vb), runs)
    return None


def verify(
    source: str | Home,
    env: str | Callable[..., Any],
    *,
    seed: int,
    steps: int,
    policy: Policy | None = None,
    runs: int = 2,
    boxd: Boxd | None = None,
    pickle_by_value: Sequence[Any] = (),
    **make_kwargs: Any,
) -> VerifyReport:
    """Run ``env`` in ``runs`` fresh forks of ``source`` with one seed; compare them.

    Args:
        source: the machine to fork (name or id), or a `Home`.
        env: a Gymnasium id, ``"module:function"`` importable in the machine, or a
            callable (see `boxd.rl.Env`).
        seed: the reset seed and the default policy's seed.
        steps: steps per run.
        policy: ``policy(obs) -> action``; it must be deterministic itself.
        runs: how many forks to compare (at least 2).
        boxd: the client (``Boxd()`` if None).
        pickle_by_value: modules whose code travels with the factory.
        **make_kwargs: keyword arguments for the env's constructor.

    Raises:
        InvalidRequest: ``runs`` < 2 or ``steps`` < 1.
        EnvError, EnvModuleNotFound: the env failed in a machine.
    """
    from boxd import errors

    if runs < 2:
        raise errors.InvalidRequest("verify needs at least 2 runs to compare", field="runs")
    if steps < 1:
        raise errors.InvalidRequest("steps must be at least 1", field="steps")
    name = env if isinstance(env, str) else getattr(env, "__qualname__", repr(env))

    def one(rewindable: bool) -> tuple[Env, list[Record]]:
        e = Env(env, source=source, boxd=boxd, pickle_by_value=pickle_by_value,
                reset_mode="rewind" if rewindable else "env", **make_kwargs)
        # Rollouts reset in "env" mode; the rewind checkpoint is only for the replay.
        e.reset_mode = "env"
        try:
            return e, _rollout(e, seed, steps, policy)
        except BaseException:
            e.close()
            raise

    rewindable = isinstance(source, str)
    with ThreadPoolExecutor(max_workers=min(runs, 8)) as ex:
        futures = [ex.submit(one, rewindable and i == 0) for i in range(runs)]
    results: list[tuple[Env, list[Record]]] = []
    failure: BaseException | None = None
    for fut in futures:
        exc = fut.exception()
        if exc is None:
            results.append(fut.result())
        elif failure is None:
            failure = exc
    try:
        if failure is not None:
            raise failure
        trajectories = [t for _, t in results]
        divergence = None
        for j in range(1, runs):
            divergence = _compare(trajectories[0], trajectories[j], (0, j))
            if divergence is not None:
                break
        cause = None
        if divergence is not None:
            cause = _cause(divergence, results[0], seed, steps, policy, rewindable)
        episodes = 1 + sum(1 for r in trajectories[0][1:] if r["terminated"] or r["truncated"])
        return VerifyReport(
            identical=divergence is None, env=name, seed=seed, steps=steps, runs=runs,
            episodes=episodes, first_divergence=divergence, likely_cause=cause,
            machines=tuple(e.machine for e, _ in results))
    finally:
        for e, _ in results:
            e.close()


def _cause(
    d: Divergence, first: tuple[Env, list[Record]], seed: int, steps: int,
    policy: Policy | None, rewindable: bool,
) -> str:
    if d.field == "action":
        return CAUSE_POLICY
    if not rewindable:
        return CAUSE_UNKNOWN
    env, trajectory = first
    env._slot.rewind()
    env._pristine = True
    replay = _rollout(env, seed, steps, policy)
    return CAUSE_OUTSIDE if _compare(trajectory, replay, (0, 0)) is not None else CAUSE_PER_FORK


__all__ = ["Divergence", "VerifyReport", "verify"]
