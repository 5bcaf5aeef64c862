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

``placement="spread"`` puts a pair's runs on different cluster nodes: run ``i`` of the
``k``-th seed forks onto ``nodes[(i + k) % len(nodes)]`` (the source's template
streams there, on either engine). ``"same-node"`` (the default) leaves the
forks where the source's forks go (its node while it has room).

``template=True`` builds the env once per source (and node) in a template machine and
forks every run from that built moment: no interpreter start, import or env build per
run (4-22 % fewer seconds per pair on gVisor here, where the forks themselves cost
most: docs/benchmarks.md, "verify"). What the constructor reads outside its seed
then goes unseen (it ran once, before the fork), and a single seed's cause has no
rewound replay (the trace still runs).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, get_args, overload

import numpy as np
from gymnasium.utils.env_checker import data_equivalence

from boxd.rl import _trace
from boxd.rl._channel import Home
from boxd.rl._cleanup import run_labels
from boxd.rl._env import Env, ResetMode

if TYPE_CHECKING:
    from boxd.sdk._sync import Boxd

log = logging.getLogger(__name__)

Policy = Callable[[Any], Any]
Labels = Mapping[str, str] | None
Placement = Literal["same-node", "spread"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
FIELDS = ("action", "obs", "reward", "terminated", "truncated")

#: Seeds are ``0 <= seed < SEED_LIMIT``. Gymnasium's own seeding takes any non-negative
#: int, but numpy's legacy seeding (``np.random.seed``, ``RandomState``), which many envs
#: and SB3's ``set_random_seed`` call with the seed they are given, takes only these.
SEED_LIMIT = 2**32
#: A sweep keeps every seed's report while it has verified at most this many seeds;
#: past that only the diverged seeds' (the first `DIVERGED_KEPT`), so that its memory
#: does not grow with its length. The counts stay exact.
PAIRS_KEPT = 10_000
DIVERGED_KEPT = 1_000
#: ``distinct`` is exact up to this many different trajectories, a lower bound past it.
DISTINCT_KEPT = 100_000

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
    #: ``placement="spread"``: the node each run was forked on (else empty)
    nodes: tuple[str, ...] = field(default=())

    def rows(self) -> list[tuple[str, str]]:
        """The report as (label, value) rows for a table."""
        out = [("env", self.env), ("seed", str(self.seed)), ("steps", str(self.steps)),
               ("runs", str(self.runs)), ("episodes per run", str(self.episodes)),
               ("identical", "yes" if self.identical else "NO")]
        if self.nodes:
            out.append(("nodes", ", ".join(self.nodes)))
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
            "machines": list(self.machines), "nodes": list(self.nodes),
            "first_divergence": None if d is None else {
                "step": d.step, "field": d.field, "runs": list(d.runs),
                "values": [_short(v, 2000) for v in d.values]},
        }


@dataclass(frozen=True)
class SweepReport:
    """The verdict of `verify` over many seeds.

    ``pairs`` holds every seed's `VerifyReport` (in the order the seeds were given)
    when the sweep verified at most `PAIRS_KEPT` seeds, else only the diverged seeds'
    (at most `DIVERGED_KEPT`): ``pairs_complete`` says which. The counts (``seeds``,
    ``diverged_seeds``, ``causes``) cover every seed either way.
    """

    identical: bool
    env: str
    steps: int
    runs: int
    sources: tuple[str, ...]
    pairs: tuple[VerifyReport, ...]
    #: how many different trajectories the seeds gave (their first runs' digests); a
    #: lower bound when ``distinct_exact`` is False
    distinct: int
    wall_s: float
    #: how many seeds were verified, and how many of them diverged
    seeds: int
    diverged_seeds: int
    placement: str = "same-node"
    #: ``"spread"``: the nodes the runs rotated over
    nodes: tuple[str, ...] = ()
    #: ``pairs`` holds every seed's report (else the diverged seeds' only)
    pairs_complete: bool = True
    #: ``distinct`` counts every trajectory (past `DISTINCT_KEPT`: at least that many)
    distinct_exact: bool = True
    #: how many diverged seeds each kind of likely cause has, over every seed
    causes: tuple[tuple[str, int], ...] = ()

    @property
    def diverged(self) -> list[VerifyReport]:
        """The seeds whose runs differ (those kept in ``pairs``)."""
        return [p for p in self.pairs if not p.identical]

    def rows(self) -> list[tuple[str, str]]:
        """The summary as (label, value) rows for a table."""
        out = [("env", self.env), ("sources", ", ".join(self.sources)),
               ("placement", self.placement + (f" over {', '.join(self.nodes)}"
                                               if self.nodes else "")),
               ("seeds", str(self.seeds)), ("steps", str(self.steps)),
               ("runs per seed", str(self.runs)),
               ("identical", "yes" if self.identical else f"NO ({self.diverged_seeds} of "
                f"{self.seeds} seeds diverge)"),
               ("distinct trajectories",
                str(self.distinct) if self.distinct_exact else f"at least {self.distinct}"),
               ("wall time", f"{self.wall_s:.1f} s"),
               ("pairs per minute", f"{self.pairs_per_minute:.1f}")]
        out += [(f"cause ({n} seeds)", c) for c, n in self.causes]
        return out

    @property
    def pairs_per_minute(self) -> float:
        return 60 * self.seeds / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The report as JSON values; `REPORT_SCHEMA` describes them."""
        return {
            "format": 1, "identical": self.identical, "env": self.env, "steps": self.steps,
            "runs": self.runs, "sources": list(self.sources),
            "placement": self.placement, "nodes": list(self.nodes), "seeds": self.seeds,
            "distinct": self.distinct, "distinct_exact": self.distinct_exact,
            "wall_s": round(self.wall_s, 3), "diverged": self.diverged_seeds,
            "pairs_complete": self.pairs_complete,
            "pairs": [p.to_json() for p in self.pairs],
        }


def _cause_kind(report: VerifyReport) -> str:
    return (report.likely_cause or "?").split(" (step")[0]


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
        "placement": {"enum": list(PLACEMENTS),
                      "description": "same-node, or spread: a pair's runs on different "
                                     "nodes"},
        "nodes": {"type": "array", "items": {"type": "string"},
                  "description": "spread: the nodes the runs rotated over"},
        "seeds": {"type": "integer", "minimum": 1},
        "distinct": {"type": "integer", "minimum": 1},
        "distinct_exact": {"type": "boolean",
                           "description": "false: distinct is a lower bound (past "
                                          f"{DISTINCT_KEPT} trajectories)"},
        "wall_s": {"type": "number", "minimum": 0},
        "diverged": {"type": "integer", "minimum": 0},
        "pairs_complete": {"type": "boolean",
                           "description": "pairs holds every seed; false (past "
                                          f"{PAIRS_KEPT} seeds): only the diverged ones, "
                                          f"at most {DIVERGED_KEPT}"},
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
                "nodes": {"type": "array", "items": {"type": "string"},
                          "description": "spread: the node of each run"},
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
    placement: Placement = "same-node", nodes: Sequence[str] | None = None,
    template: bool = False, pickle_by_value: Sequence[Any] = (),
    labels: Mapping[str, str] | None = None, **make_kwargs: Any,
) -> VerifyReport: ...


@overload
def verify(
    source: str | Home | Sequence[str], env: str | Callable[..., Any], *,
    seeds: Iterable[int], steps: int, policy: Policy | None = None, runs: int = 2,
    jobs: int = 4, progress: Callable[[VerifyReport], None] | None = None,
    boxd: Boxd | None = None, placement: Placement = "same-node",
    nodes: Sequence[str] | None = None, template: bool = False,
    pickle_by_value: Sequence[Any] = (), labels: Mapping[str, str] | None = None,
    **make_kwargs: Any,
) -> SweepReport: ...


def verify(
    source: str | Home | Sequence[str], env: str | Callable[..., Any], *,
    seed: int | None = None, seeds: Iterable[int] | None = None, steps: int,
    policy: Policy | None = None, runs: int = 2, jobs: int = 4,
    progress: Callable[[VerifyReport], None] | None = None, boxd: Boxd | None = None,
    placement: Placement = "same-node", nodes: Sequence[str] | None = None,
    template: bool = False, pickle_by_value: Sequence[Any] = (), labels: Labels = None,
    **make_kwargs: Any,
) -> VerifyReport | SweepReport:
    """Run ``env`` in ``runs`` fresh forks of ``source`` with one seed; compare them.

    With ``seeds`` instead of ``seed``: every seed, ``jobs`` at once, in a `SweepReport`
    (each seed's report, and how many distinct trajectories the seeds gave).

    Args:
        source: the machine to fork (name or id), or a `Home`; or several machine
            names, which a seed's runs alternate between (run ``i`` forks
            ``source[i % len(source)]``), e.g. one baseline per engine.
        env: a Gymnasium id, ``"module:function"`` importable in the machine, or a
            callable (see `boxd.rl.Env`).
        seed: the reset seed and the default policy's seed (0 to 2**32 - 1).
        seeds: many seeds, one pair of runs each, drawn as pairs start (see
            `_seed_stream` for how they are checked, `SweepReport` for what is kept).
        steps: steps per run.
        policy: ``policy(obs) -> action``; it must be deterministic itself (and, with
            ``jobs`` > 1, safe to call from several threads).
        runs: how many forks to compare per seed (at least 2).
        jobs: seeds verified at once (``jobs * runs`` forks run together).
        progress: called with each seed's report as it completes (in a worker thread).
        boxd: the client (``Boxd()`` if None).
        placement: ``"same-node"`` or ``"spread"`` (see above).
        nodes: the node ids to spread over (default: every alive node).
        template: fork every run from a template in which the env was built once
            (per source and node): faster, but blind to the constructor (see above).
        pickle_by_value: modules whose code travels with the factory.
        labels: over ``boxd.rl/run=<id>``, ``boxd.rl/owner=verify``: its machines' labels.
        **make_kwargs: keyword arguments for the env's constructor.

    Raises:
        InvalidRequest: ``runs`` < 2, ``steps`` < 1, ``jobs`` < 1, no seeds, a bad or
            repeated seed, both or neither of ``seed`` and ``seeds``; ``"spread"`` over
            fewer than two nodes, of a `Home`, or of a source that cannot leave its
            node. NotFound: a node in ``nodes`` that is not alive.
        EnvError, EnvModuleNotFound: the env failed in a machine (a sweep stops at
            the first such failure and raises it once the seeds in flight are done).
    """
    what = _check(seed=seed, seeds=seeds, steps=steps, runs=runs, jobs=jobs, placement=placement)
    job, owned = _new_job(source, env, boxd, labels, steps=steps, policy=policy, runs=runs,
                          pickle_by_value=pickle_by_value, make_kwargs=make_kwargs,
                          template=template)
    try:
        if placement == "spread":
            job.nodes = _spread_nodes(job.boxd, job.sources, nodes)
        if isinstance(what, int):
            return _one_seed(job, what)
        return _sweep(job, what, jobs=jobs, progress=progress)
    finally:
        job.close()
        if owned is not None:
            owned.close()


def _new_job(source: str | Home | Sequence[str], env: str | Callable[..., Any],
             boxd: Boxd | None, labels: Labels, **fields: Any) -> tuple[_Job, Boxd | None]:
    """The job of one `verify` call, its machines labelled with a new verify run (and
    ``labels``); and the client it made (None: the caller's)."""
    sources = _sources(source)
    owned = _client(sources) if boxd is None else None
    return _Job(sources=sources, env=env, boxd=boxd or owned,
                labels={**run_labels("verify"), **(labels or {})}, **fields), owned


def _client(sources: list[str | Home]) -> Boxd | None:
    """A client for the machines a job forks itself (None: the sources are Homes)."""
    if not all(isinstance(s, str) for s in sources):
        return None
    from boxd.sdk._sync import Boxd

    return Boxd()


def _check(*, seed: int | None, seeds: Iterable[int] | None, steps: int, runs: int,
           jobs: int, placement: str) -> int | Iterator[int]:
    """The arguments checked before anything is made; the seed, or the seeds'
    stream (`_seed_stream`)."""
    from boxd import errors

    if runs < 2:
        raise errors.InvalidRequest("verify needs at least 2 runs to compare", field="runs")
    if steps < 1:
        raise errors.InvalidRequest("steps must be at least 1", field="steps")
    if (seed is None) == (seeds is None):
        raise errors.InvalidRequest("give seed= (one seed) or seeds= (many), not both",
                                    field="seed")
    if seeds is not None and jobs < 1:
        raise errors.InvalidRequest("jobs must be at least 1", field="jobs")
    if placement not in PLACEMENTS:
        raise errors.InvalidRequest(f"placement must be one of {', '.join(PLACEMENTS)}, "
                                    f"not {placement!r}", field="placement")
    return check_seed(seed) if seeds is None else _seed_stream(seeds)


def check_seed(seed: object) -> int:
    """``seed`` as a verify seed: an int (numpy's integers too) with ``0 <= seed <
    SEED_LIMIT``.

    Raises:
        InvalidRequest: not an int (a bool or a float included), or out of range.
    """
    from boxd import errors

    if isinstance(seed, bool) or not isinstance(seed, SupportsIndex):
        raise errors.InvalidRequest(f"a seed must be an int, not {type(seed).__name__} "
                                    f"{seed!r}", field="seeds")
    value = operator.index(seed)
    if not 0 <= value < SEED_LIMIT:
        raise errors.InvalidRequest(
            f"seed {value} is out of range: seeds are 0 to {SEED_LIMIT - 1} (2**32 - 1)",
            hint="Gymnasium refuses a negative seed, and numpy's legacy seeding "
            "(np.random.seed), which many envs call with it, takes only 0 to 2**32 - 1",
            field="seeds")
    return value


def _seed_stream(seeds: Iterable[int]) -> Iterator[int]:
    """The seeds as an iterator, checked as far as can be before any fork: a range by
    its ends (it cannot repeat), a collection such as a list whole (each seed, and no
    repeats: the caller holds it already); any other iterable seed by seed as it is
    drawn (a bad seed then stops the sweep as a failing pair does), and not for
    repeats (that would keep every seed: a repeated seed is verified again).

    Raises:
        InvalidRequest: no seeds, a bad seed, or a repeated one (range, collection).
    """
    from boxd import errors

    empty = errors.InvalidRequest("seeds is empty", field="seeds")
    if isinstance(seeds, range):
        if not seeds:
            raise empty
        check_seed(min(seeds[0], seeds[-1]))
        check_seed(max(seeds[0], seeds[-1]))
        return iter(seeds)
    if isinstance(seeds, Collection):  # numpy arrays too: len(), not truthiness
        if len(seeds) == 0:
            raise empty
        seen: set[int] = set()
        for s in seeds:
            if check_seed(s) in seen:
                raise errors.InvalidRequest(f"seeds repeat ({s} twice)",
                                            hint="give each seed once", field="seeds")
            seen.add(operator.index(s))
        return (operator.index(s) for s in seeds)
    return (check_seed(s) for s in seeds)


def _sources(source: str | Home | Sequence[str]) -> list[str | Home]:
    from boxd import errors

    if isinstance(source, str) or not isinstance(source, Sequence):
        return [source]
    if not source or not all(isinstance(s, str) for s in source):
        raise errors.InvalidRequest("source: give a machine, a Home, or a list of machine "
                                    "names", field="source")
    return list(source)


def _spread_nodes(boxd: Boxd | None, sources: list[str | Home],
                  nodes: Sequence[str] | None) -> tuple[str, ...]:
    """The nodes a ``"spread"`` verify puts a pair's runs on; checked before any fork."""
    from boxd import errors

    assert boxd is not None
    if not all(isinstance(s, str) for s in sources):
        raise errors.InvalidRequest("placement='spread' needs machine sources, not a Home",
                                    field="placement")
    alive = [n.id for n in boxd.nodes.list() if n.health == "alive"]
    chosen = tuple(alive if nodes is None else nodes)
    unknown = [n for n in chosen if n not in alive]
    if unknown:
        raise errors.NotFound(f"no alive node {unknown[0]!r}", field="nodes",
                              hint="`boxd nodes list` shows the nodes")
    if len(set(chosen)) < 2:
        raise errors.InvalidRequest(
            f"placement='spread' needs two nodes or more; {len(set(chosen))} given",
            hint="start boxd on a Ray cluster (`boxd serve --ray`), or verify on one "
            "node (placement='same-node')", field="nodes")
    for s in sources:  # each source exists (either engine's forks spread)
        boxd.machines.get(str(s))
    return chosen


def _env_name(env: str | Callable[..., Any]) -> str:
    return env if isinstance(env, str) else getattr(env, "__qualname__", repr(env))


@dataclass
class _Job:
    """What every seed of one `verify` call runs: the env, how, and where."""

    sources: list[str | Home]
    env: str | Callable[..., Any]
    steps: int
    policy: Policy | None
    runs: int
    boxd: Boxd | None
    pickle_by_value: Sequence[Any]
    make_kwargs: dict[str, Any]
    #: ``"spread"``: the nodes run ``i`` of the ``k``-th seed rotates over
    nodes: tuple[str, ...] = ()
    #: every run forks a template in which the env was built once (per source and node)
    template: bool = False
    #: the labels of every machine the job makes (`boxd.rl._cleanup`)
    labels: dict[str, str] = field(default_factory=lambda: run_labels("verify"))
    _homes: dict[tuple[str, str | None], Home] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def home(self, i: int, k: int) -> str | Home:
        """What run ``i`` of the ``k``-th seed forks: the `Home` this job keeps for its
        source (and node, when runs are pinned to nodes), whose machines carry the job's
        labels; or the source itself when it is a `Home`."""
        source = self.sources[i % len(self.sources)]
        if not isinstance(source, str):
            return source
        node = self.nodes[(i + k) % len(self.nodes)] if self.nodes else None
        with self._lock:
            home = self._homes.get((source, node))
            if home is None:
                from boxd.rl._machines import MachineHome

                home = self._homes[source, node] = MachineHome(source, self.boxd, node=node,
                                                               labels=self.labels)
            return home

    def close(self) -> None:
        """Delete the templates of the homes this job made, and every machine labelled
        with the job's labels."""
        homes, self._homes = list(self._homes.values()), {}
        for home in homes:
            home.close()

    def replay(self) -> _Replay:
        return _Replay(self.home(0, 0), self.env, self.boxd, self.pickle_by_value,
                       self.make_kwargs)


def _sweep(job: _Job, seeds: Iterator[int], *, jobs: int,
           progress: Callable[[VerifyReport], None] | None) -> SweepReport:
    from boxd import errors

    started = time.monotonic()
    tally = _Tally()
    _Pool(jobs, progress).run(lambda k, s: _one_seed(job, s, k=k, rewind=False), seeds,
                              tally)
    if tally.seeds == 0:  # an empty iterator: nothing was started
        raise errors.InvalidRequest("seeds is empty", field="seeds")
    return SweepReport(
        identical=tally.diverged == 0, env=_env_name(job.env),
        steps=job.steps, runs=job.runs,
        sources=tuple(s if isinstance(s, str) else type(s).__name__ for s in job.sources),
        pairs=tuple(r for _, r in sorted(tally.kept, key=lambda kr: kr[0])),
        distinct=len(tally.digests), wall_s=time.monotonic() - started,
        seeds=tally.seeds, diverged_seeds=tally.diverged,
        placement="spread" if job.nodes else "same-node", nodes=job.nodes,
        pairs_complete=tally.complete, distinct_exact=tally.distinct_exact,
        causes=tuple(tally.causes.items()))


@dataclass
class _Tally:
    """What a sweep keeps of its seeds' reports: counts, and a bounded sample (every
    report up to `PAIRS_KEPT` seeds, then the diverged ones up to `DIVERGED_KEPT`)."""

    seeds: int = 0
    diverged: int = 0
    #: (position in the stream, report)
    kept: list[tuple[int, VerifyReport]] = field(default_factory=list)
    complete: bool = True
    #: the first runs' digests (a 128-bit prefix each), up to `DISTINCT_KEPT`
    digests: set[str] = field(default_factory=set)
    distinct_exact: bool = True
    causes: dict[str, int] = field(default_factory=dict)

    def add(self, k: int, report: VerifyReport) -> None:
        self.seeds += 1
        if not report.identical:
            self.diverged += 1
            kind = _cause_kind(report)
            self.causes[kind] = self.causes.get(kind, 0) + 1
        key = report.digest[:32]
        if key not in self.digests:
            if len(self.digests) < DISTINCT_KEPT:
                self.digests.add(key)
            else:
                self.distinct_exact = False
        if self.complete and self.seeds > PAIRS_KEPT:
            self.complete = False
            bad = sorted((kr for kr in self.kept if not kr[1].identical), key=lambda kr: kr[0])
            self.kept = bad[:DIVERGED_KEPT]
        if self.complete or (not report.identical and len(self.kept) < DIVERGED_KEPT):
            self.kept.append((k, report))


class _Pool:
    """Up to ``jobs`` seeds at once, drawn from their iterator only as a place frees
    (never ahead); the first failure stops new seeds and is raised once the seeds in
    flight are done."""

    def __init__(self, jobs: int, progress: Callable[[VerifyReport], None] | None) -> None:
        self.jobs = jobs
        self.progress = progress
        self.stop = threading.Event()
        self.failure: BaseException | None = None

    def run(self, one: Callable[[int, int], VerifyReport], seeds: Iterator[int],
            tally: _Tally) -> None:
        todo = enumerate(seeds)
        with ThreadPoolExecutor(max_workers=self.jobs) as ex:
            pending: dict[Future[VerifyReport], int] = {}
            while True:
                while len(pending) < self.jobs and not self.stop.is_set():
                    item = self._draw(todo)
                    if item is None:
                        break
                    pending[ex.submit(self._guarded, one, *item)] = item[0]
                if not pending:
                    break
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    self._collect(fut, pending.pop(fut), tally)
        if self.failure is not None:
            raise self.failure

    def _draw(self, todo: Iterator[tuple[int, int]]) -> tuple[int, int] | None:
        """The next (position, seed), or None at the end or when the seed failed its
        check (or the caller's iterator raised): that stops the sweep."""
        try:
            return next(todo, None)
        except Exception as exc:
            self._fail(exc)
            return None

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            self.stop.set()

    def _guarded(self, one: Callable[[int, int], VerifyReport], k: int,
                 s: int) -> VerifyReport:
        if self.stop.is_set():  # a pair failed: start no more machines
            raise _Skipped
        return one(k, s)

    def _collect(self, fut: Future[VerifyReport], k: int, tally: _Tally) -> None:
        exc = fut.exception()
        if exc is None:
            report = fut.result()
            tally.add(k, report)
            if self.progress is not None:
                self.progress(report)
        elif not isinstance(exc, _Skipped):
            self._fail(exc)


class _Skipped(Exception):
    """A seed not started because another failed."""


@dataclass
class _Run:
    env: Env
    trajectory: list[Record]

    def close(self) -> None:
        self.env.close()


def _start(job: _Job, i: int, k: int, seed: int, rewindable: bool) -> _Run:
    """Run ``i`` of the ``k``-th seed: build the env in a fresh fork (or fork the
    built template) and roll it out."""
    mode: ResetMode = "refork" if job.template else "rewind" if rewindable else "env"
    e = Env(job.env, source=job.home(i, k), boxd=job.boxd,
            pickle_by_value=job.pickle_by_value, reset_mode=mode, **job.make_kwargs)
    # Rollouts reset in "env" mode; the rewind checkpoint is only for the replay.
    e.reset_mode = "env"
    try:
        return _Run(e, _rollout(e, seed, job.steps, job.policy))
    except BaseException:
        e.close()
        raise


def _one_seed(job: _Job, seed: int, *, k: int = 0, rewind: bool = True) -> VerifyReport:
    # One seed keeps a rewind checkpoint in its first run, for the fallback replay of
    # `_cause`; a sweep does not (a checkpoint per seed), and relies on the trace.
    rewindable = rewind and not job.template and isinstance(job.sources[0], str)
    with ThreadPoolExecutor(max_workers=min(job.runs, 8)) as ex:
        futures = [ex.submit(_start, job, i, k, seed, rewindable and i == 0)
                   for i in range(job.runs)]
    results = [f.result() for f in futures if f.exception() is None]
    try:
        failure = next((f.exception() for f in futures if f.exception() is not None), None)
        if failure is not None:
            raise failure
        return _judge(job, seed, k, results, rewindable)
    finally:
        for r in results:
            r.close()


def _judge(job: _Job, seed: int, k: int, results: list[_Run],
           rewindable: bool) -> VerifyReport:
    """Compare the runs of one seed and, on a divergence, find its likely cause."""
    trajectories = [r.trajectory for r in results]
    divergence = next((d for j in range(1, job.runs)
                       if (d := _compare(trajectories[0], trajectories[j], (0, j)))
                       is not None), None)
    cause = None
    if divergence is not None:
        first = results[0]
        cause = _cause(divergence, (first.env, first.trajectory), seed, job.steps,
                       job.policy, rewindable, job.replay())
    episodes = 1 + sum(1 for r in trajectories[0][1:] if r["terminated"] or r["truncated"])
    return VerifyReport(
        identical=divergence is None, env=_env_name(job.env), seed=seed, steps=job.steps,
        runs=job.runs, episodes=episodes, first_divergence=divergence, likely_cause=cause,
        machines=tuple(r.env.machine for r in results), digest=_digest(trajectories[0]),
        nodes=tuple(job.nodes[(i + k) % len(job.nodes)] for i in range(job.runs))
        if job.nodes else ())


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


__all__ = ["REPORT_SCHEMA", "SEED_LIMIT", "Divergence", "SweepReport", "VerifyReport", "check_seed",
           "verify"]
