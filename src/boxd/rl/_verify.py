"""`boxd.rl.verify`: does one seed give one trajectory across fresh forks?

Each run builds the env in a fresh fork of ``source``, resets it with ``seed``, and
steps it ``steps`` times with a seeded policy (by default seeded samples of the action
space), resetting unseeded at episode ends. The runs are compared step by step:
action, observation, reward, terminated, truncated, then every info key, exactly
(same type, dtype and bytes).

``likely_cause``, stated honestly in docs/rl.md: when the runs diverge, the seed is
replayed up to the divergent step in a fresh fork with the env wrapped in
`boxd.rl._trace.Tracer`, which records what each step read of the clock, the kernel
RNG and the machine's identity; the cause names what the divergent step read (or,
failing that, earlier steps). When the trace sees nothing (C code, a function bound
before the env was built) and the first run kept a rewind checkpoint (one seed, on a
machine), that machine is rewound to the moment its env was built and the run replayed
there: a replay that also diverges means the env reads something outside the machine's
saved state (the wall clock, timers, the network, thread timing); a replay that
matches means the env reads something that differs *between forks*. A divergence in
the actions is the policy's own.

With ``seeds=`` it verifies many seeds: one pair (``runs`` forks) per seed, up to
``jobs`` pairs at once, and a `SweepReport` that also counts the *distinct*
trajectories across seeds (an env that ignores its seed is not "reproducible", it is
constant). Several sources (``source=["a", "b"]``) alternate between a pair's runs: one
prepared per engine from the same recipe compares the engines (a snapshot cannot move
between engines).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import numpy as np
from gymnasium.utils.env_checker import data_equivalence

from boxd.rl import _trace
from boxd.rl._channel import Home
from boxd.rl._env import Env

if TYPE_CHECKING:
    from boxd.sdk._sync import Boxd

log = logging.getLogger(__name__)

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
CAUSE_RNG = ("the env reads the kernel RNG, which differs between forks (reseeded at every "
             "fork): draw from the env's seeded np_random instead")
CAUSE_IDENTITY = ("the env reads the machine's identity, which differs between forks (the "
                  "hostname, /etc/machine-id, the network address)")
CAUSE_CLOCK = ("the env reads the clock or a timer, which differs between any two runs: "
               "derive time from the step count, or make it an input")
CAUSE_UNTRACED = ("the runs diverge, and a traced replay saw no read of the clock, the "
                  "kernel RNG or the machine's identity by Python code: look for C code "
                  "reading them, thread timing or the network")


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
    #: sha256 of the first run's trajectory (every step's fields, exactly): equal
    #: digests across seeds are the same trajectory.
    digest: str = ""

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


    def to_json(self) -> dict[str, Any]:
        """The report as JSON values (a divergence's two values as their repr)."""
        d = self.first_divergence
        return {
            "seed": self.seed, "identical": self.identical, "episodes": self.episodes,
            "digest": self.digest, "likely_cause": self.likely_cause,
            "machines": list(self.machines),
            "first_divergence": None if d is None else {
                "step": d.step, "field": d.field, "runs": list(d.runs),
                "values": [_short(v, 2000) for v in d.values]},
        }


@dataclass(frozen=True)
class SweepReport:
    """The verdict of `verify` over many seeds: one `VerifyReport` per seed."""

    identical: bool
    env: str
    steps: int
    runs: int
    sources: tuple[str, ...]
    pairs: tuple[VerifyReport, ...]
    #: how many different trajectories the seeds gave (their first runs' digests)
    distinct: int
    wall_s: float

    @property
    def diverged(self) -> list[VerifyReport]:
        """The seeds whose runs differ."""
        return [p for p in self.pairs if not p.identical]

    def rows(self) -> list[tuple[str, str]]:
        """The summary as (label, value) rows for a table."""
        bad = self.diverged
        out = [("env", self.env), ("sources", ", ".join(self.sources)),
               ("seeds", str(len(self.pairs))), ("steps", str(self.steps)),
               ("runs per seed", str(self.runs)),
               ("identical", "yes" if self.identical else f"NO ({len(bad)} of "
                f"{len(self.pairs)} seeds diverge)"),
               ("distinct trajectories", str(self.distinct)),
               ("wall time", f"{self.wall_s:.1f} s"),
               ("pairs per minute", f"{self.pairs_per_minute:.1f}")]
        causes: dict[str, int] = {}
        for p in bad:
            kind = (p.likely_cause or "?").split(" (step")[0]
            causes[kind] = causes.get(kind, 0) + 1
        out += [(f"cause ({n} seeds)", c) for c, n in causes.items()]
        return out

    @property
    def pairs_per_minute(self) -> float:
        return 60 * len(self.pairs) / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The report as JSON values; `REPORT_SCHEMA` describes them."""
        return {
            "format": 1, "identical": self.identical, "env": self.env, "steps": self.steps,
            "runs": self.runs, "sources": list(self.sources), "seeds": len(self.pairs),
            "distinct": self.distinct, "wall_s": round(self.wall_s, 3),
            "diverged": len(self.diverged), "pairs": [p.to_json() for p in self.pairs],
        }


_DIVERGENCE_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "required": ["step", "field", "runs", "values"],
    "properties": {
        "step": {"type": "integer", "minimum": 0,
                 "description": "0 is the first reset, n the n-th step"},
        "field": {"type": "string",
                  "description": "action, obs, reward, terminated, truncated, "
                                 "info['KEY'], obs after reset or info after reset"},
        "runs": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                 "maxItems": 2},
        "values": {"type": "array", "items": {"type": "string"}, "minItems": 2,
                   "maxItems": 2, "description": "the two values' repr"},
    },
}

#: The JSON Schema of ``boxd rl verify --seeds ... --json`` (`SweepReport.to_json`).
REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "boxd rl verify report",
    "type": "object",
    "required": ["format", "identical", "env", "steps", "runs", "sources", "seeds",
                 "distinct", "wall_s", "diverged", "pairs"],
    "properties": {
        "format": {"const": 1},
        "identical": {"type": "boolean", "description": "every seed's runs are identical"},
        "env": {"type": "string"},
        "steps": {"type": "integer", "minimum": 1},
        "runs": {"type": "integer", "minimum": 2},
        "sources": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "seeds": {"type": "integer", "minimum": 1},
        "distinct": {"type": "integer", "minimum": 1},
        "wall_s": {"type": "number", "minimum": 0},
        "diverged": {"type": "integer", "minimum": 0},
        "pairs": {"type": "array", "items": {
            "type": "object",
            "required": ["seed", "identical", "episodes", "digest", "likely_cause",
                         "machines", "first_divergence"],
            "properties": {
                "seed": {"type": "integer"},
                "identical": {"type": "boolean"},
                "episodes": {"type": "integer", "minimum": 1},
                "digest": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                "likely_cause": {"type": ["string", "null"]},
                "machines": {"type": "array", "items": {"type": ["string", "null"]}},
                "first_divergence": _DIVERGENCE_SCHEMA,
            },
        }},
    },
}


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


def _feed(h: Any, v: Any) -> None:
    """Hash ``v`` exactly: its type, dtype, shape and bytes, recursively."""
    if isinstance(v, np.ndarray | np.generic):
        a = np.ascontiguousarray(v)
        h.update(b"A%s%s;" % (a.dtype.str.encode(), repr(a.shape).encode()))
        h.update(a.tobytes())
    elif isinstance(v, dict):
        h.update(b"D%d;" % len(v))
        for k in sorted(v, key=repr):
            _feed(h, k)
            _feed(h, v[k])
    elif isinstance(v, list | tuple):
        h.update(b"%s%d;" % (type(v).__name__.encode(), len(v)))
        for x in v:
            _feed(h, x)
    elif isinstance(v, float):
        h.update(b"f" + struct.pack("<d", v))
    else:
        h.update(f"{type(v).__name__}:{v!r};".encode())


def _digest(trajectory: list[Record]) -> str:
    h = hashlib.sha256()
    for rec in trajectory:
        _feed(h, rec)
    return h.hexdigest()


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


@overload
def verify(
    source: str | Home | Sequence[str], env: str | Callable[..., Any], *, seed: int,
    steps: int, policy: Policy | None = None, runs: int = 2, boxd: Boxd | None = None,
    pickle_by_value: Sequence[Any] = (), **make_kwargs: Any,
) -> VerifyReport: ...


@overload
def verify(
    source: str | Home | Sequence[str], env: str | Callable[..., Any], *,
    seeds: Iterable[int], steps: int, policy: Policy | None = None, runs: int = 2,
    jobs: int = 4, progress: Callable[[VerifyReport], None] | None = None,
    boxd: Boxd | None = None, pickle_by_value: Sequence[Any] = (), **make_kwargs: Any,
) -> SweepReport: ...


def verify(
    source: str | Home | Sequence[str],
    env: str | Callable[..., Any],
    *,
    seed: int | None = None,
    seeds: Iterable[int] | None = None,
    steps: int,
    policy: Policy | None = None,
    runs: int = 2,
    jobs: int = 4,
    progress: Callable[[VerifyReport], None] | None = None,
    boxd: Boxd | None = None,
    pickle_by_value: Sequence[Any] = (),
    **make_kwargs: Any,
) -> VerifyReport | SweepReport:
    """Run ``env`` in ``runs`` fresh forks of ``source`` with one seed; compare them.

    With ``seeds`` instead of ``seed``: do that for every seed, up to ``jobs`` seeds at
    once, and return a `SweepReport` (every seed's report, and how many distinct
    trajectories the seeds gave).

    Args:
        source: the machine to fork (name or id), or a `Home`; or several machine
            names, which a seed's runs alternate between (run ``i`` forks
            ``source[i % len(source)]``), e.g. one baseline per engine.
        env: a Gymnasium id, ``"module:function"`` importable in the machine, or a
            callable (see `boxd.rl.Env`).
        seed: the reset seed and the default policy's seed.
        seeds: many seeds, one pair of runs each.
        steps: steps per run.
        policy: ``policy(obs) -> action``; it must be deterministic itself (and, with
            ``jobs`` > 1, safe to call from several threads).
        runs: how many forks to compare per seed (at least 2).
        jobs: seeds verified at once (``jobs * runs`` forks run together).
        progress: called with each seed's report as it completes (from a worker
            thread).
        boxd: the client (``Boxd()`` if None).
        pickle_by_value: modules whose code travels with the factory.
        **make_kwargs: keyword arguments for the env's constructor.

    Raises:
        InvalidRequest: ``runs`` < 2, ``steps`` < 1, ``jobs`` < 1, no seeds, or both
            or neither of ``seed`` and ``seeds``.
        EnvError, EnvModuleNotFound: the env failed in a machine (a sweep stops at
            the first such failure and raises it once the seeds in flight are done).
    """
    from boxd import errors

    if runs < 2:
        raise errors.InvalidRequest("verify needs at least 2 runs to compare", field="runs")
    if steps < 1:
        raise errors.InvalidRequest("steps must be at least 1", field="steps")
    if (seed is None) == (seeds is None):
        raise errors.InvalidRequest("give seed= (one seed) or seeds= (many), not both",
                                    field="seed")
    sources = _sources(source)
    if seeds is not None:
        if jobs < 1:
            raise errors.InvalidRequest("jobs must be at least 1", field="jobs")
        return _sweep(sources, env, list(seeds), steps=steps, policy=policy, runs=runs,
                      jobs=jobs, progress=progress, boxd=boxd,
                      pickle_by_value=pickle_by_value, make_kwargs=make_kwargs)
    assert seed is not None
    return _one_seed(sources, env, seed, steps=steps, policy=policy, runs=runs, boxd=boxd,
                     pickle_by_value=pickle_by_value, make_kwargs=make_kwargs)


def _sources(source: str | Home | Sequence[str]) -> list[str | Home]:
    from boxd import errors

    if isinstance(source, str) or not isinstance(source, Sequence):
        return [source]
    if not source or not all(isinstance(s, str) for s in source):
        raise errors.InvalidRequest("source: give a machine, a Home, or a list of machine "
                                    "names", field="source")
    return list(source)


def _env_name(env: str | Callable[..., Any]) -> str:
    return env if isinstance(env, str) else getattr(env, "__qualname__", repr(env))


def _sweep(
    sources: list[str | Home], env: str | Callable[..., Any], seeds: list[int], *,
    steps: int, policy: Policy | None, runs: int, jobs: int,
    progress: Callable[[VerifyReport], None] | None, boxd: Boxd | None,
    pickle_by_value: Sequence[Any], make_kwargs: dict[str, Any],
) -> SweepReport:
    from boxd import errors

    if not seeds:
        raise errors.InvalidRequest("seeds is empty", field="seeds")
    if len(set(seeds)) != len(seeds):
        raise errors.InvalidRequest("seeds repeat", hint="give each seed once",
                                    field="seeds")
    started = time.monotonic()
    done: dict[int, VerifyReport] = {}
    failure: BaseException | None = None
    stop = threading.Event()

    def one(s: int) -> VerifyReport:
        if stop.is_set():  # a pair failed: start no more machines
            raise _Skipped
        return _one_seed(sources, env, s, steps=steps, policy=policy, runs=runs, boxd=boxd,
                         pickle_by_value=pickle_by_value, make_kwargs=make_kwargs,
                         rewind=False)

    with ThreadPoolExecutor(max_workers=min(jobs, len(seeds))) as ex:
        pending: set[Future[VerifyReport]] = set()
        todo = iter(seeds)
        seed_of: dict[Future[VerifyReport], int] = {}
        while True:
            while len(pending) < jobs and not stop.is_set():
                s = next(todo, None)
                if s is None:
                    break
                fut = ex.submit(one, s)
                seed_of[fut] = s
                pending.add(fut)
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                exc = fut.exception()
                if exc is None:
                    done[seed_of[fut]] = report = fut.result()
                    if progress is not None:
                        progress(report)
                elif not isinstance(exc, _Skipped) and failure is None:
                    failure = exc
                    stop.set()
    if failure is not None:
        raise failure
    pairs = tuple(done[s] for s in seeds)
    return SweepReport(
        identical=all(p.identical for p in pairs), env=_env_name(env), steps=steps,
        runs=runs, sources=tuple(s if isinstance(s, str) else type(s).__name__
                                 for s in sources),
        pairs=pairs, distinct=len({p.digest for p in pairs}),
        wall_s=time.monotonic() - started)


class _Skipped(Exception):
    """A seed not started because another failed."""


def _one_seed(
    sources: list[str | Home], env: str | Callable[..., Any], seed: int, *, steps: int,
    policy: Policy | None, runs: int, boxd: Boxd | None, pickle_by_value: Sequence[Any],
    make_kwargs: dict[str, Any], rewind: bool = True,
) -> VerifyReport:
    name = _env_name(env)

    def one(i: int, rewindable: bool) -> tuple[Env, list[Record]]:
        e = Env(env, source=sources[i % len(sources)], boxd=boxd,
                pickle_by_value=pickle_by_value,
                reset_mode="rewind" if rewindable else "env", **make_kwargs)
        # Rollouts reset in "env" mode; the rewind checkpoint is only for the replay.
        e.reset_mode = "env"
        try:
            return e, _rollout(e, seed, steps, policy)
        except BaseException:
            e.close()
            raise

    # One seed keeps a rewind checkpoint in its first run, for the fallback replay of
    # `_cause`; a sweep does not (a checkpoint per seed), and relies on the trace.
    rewindable = rewind and isinstance(sources[0], str)
    with ThreadPoolExecutor(max_workers=min(runs, 8)) as ex:
        futures = [ex.submit(one, i, rewindable and i == 0) for i in range(runs)]
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
            cause = _cause(divergence, results[0], seed, steps, policy, rewindable,
                           _Replay(sources[0], env, boxd, pickle_by_value, make_kwargs))
        episodes = 1 + sum(1 for r in trajectories[0][1:] if r["terminated"] or r["truncated"])
        return VerifyReport(
            identical=divergence is None, env=name, seed=seed, steps=steps, runs=runs,
            episodes=episodes, first_divergence=divergence, likely_cause=cause,
            machines=tuple(e.machine for e, _ in results), digest=_digest(trajectories[0]))
    finally:
        for e, _ in results:
            e.close()


@dataclass(frozen=True)
class _Replay:
    """How to build the env again, for the traced replay."""

    source: str | Home
    env: str | Callable[..., Any]
    boxd: Boxd | None
    pickle_by_value: Sequence[Any]
    make_kwargs: dict[str, Any]


def _cause(
    d: Divergence, first: tuple[Env, list[Record]], seed: int, steps: int,
    policy: Policy | None, rewindable: bool, replay: _Replay,
) -> str:
    if d.field == "action":
        return CAUSE_POLICY
    traced = _traced_cause(d, seed, policy, replay)
    if traced is not None:
        return traced
    if not rewindable:
        return CAUSE_UNTRACED
    env, trajectory = first
    env._slot.rewind()
    env._pristine = True
    again = _rollout(env, seed, steps, policy)
    return CAUSE_OUTSIDE if _compare(trajectory, again, (0, 0)) is not None else CAUSE_PER_FORK


_KIND_CAUSES = {_trace.RNG: CAUSE_RNG, _trace.IDENTITY: CAUSE_IDENTITY,
                _trace.CLOCK: CAUSE_CLOCK}


def _traced_cause(d: Divergence, seed: int, policy: Policy | None, replay: _Replay) -> str | None:
    """Replay the seed up to the divergent step in a fresh fork with the env wrapped in
    `_trace.Tracer`; name what that step read (or, if nothing, what earlier steps did).
    None when it read nothing traceable, or the replay could not run."""
    factory = functools.partial(_trace.traced, replay.env, replay.make_kwargs)
    try:
        env = Env(factory, source=replay.source, boxd=replay.boxd,
                  pickle_by_value=[*replay.pickle_by_value, _trace])
    except Exception:
        log.warning("verify: the traced replay could not start", exc_info=True)
        return None
    try:
        _rollout(env, seed, d.step, policy)
        reads: dict[int, list[str]] = env.get_attr("boxd_reads")
    except Exception:
        log.warning("verify: the traced replay failed", exc_info=True)
        return None
    finally:
        env.close()
    at = reads.get(d.step)
    where = f"step {d.step} read"
    if not at:
        at = sorted({r for step, rs in reads.items() if step < d.step for r in rs})
        where = f"steps before {d.step} read"
    if not at:
        return None
    kinds = {r.split(":", 1)[0] for r in at}
    causes = [c for k, c in _KIND_CAUSES.items() if k in kinds]
    names = ", ".join(r.split(":", 1)[1] for r in at)
    return f"{'; '.join(causes)} ({where} {names})"


__all__ = ["REPORT_SCHEMA", "Divergence", "SweepReport", "VerifyReport", "verify"]
