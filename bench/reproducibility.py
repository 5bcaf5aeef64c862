"""docs/reproducibility.md's table, produced by `boxd.rl.verify` (never typed in).

    python bench/reproducibility.py                      # print the Markdown
    python bench/reproducibility.py --write docs/reproducibility.md
    REPRO_PAIRS=1000 REPRO_ENGINES=gvisor,qemu python bench/reproducibility.py

For each engine (``REPRO_ENGINES``, default: the daemon's default engine), a baseline
is prepared from one recipe: a new machine, gymnasium[mujoco], numpy and cloudpickle
installed from wheels the host downloads, and ``repro_envs.py`` (the leaky envs
below). Then every env is verified over ``REPRO_PAIRS`` seeds (default 20) in each
placement:

- ``fork``: two fresh forks of the baseline;
- ``restored``: forks of a machine that was checkpointed, changed and restored;
- ``snapshot``: forks of a machine started from a snapshot of the baseline;
- ``engines``: one run of each pair on each engine (two engines given).

Envs: CartPole-v1, Acrobot-v1, HalfCheetah-v5 (MuJoCo), an env that reads the clock
into step 37's observation, and one that reads ``os.urandom`` after the fork at step 37.
``--ray N`` instead runs every env with ``placement="spread"`` on a local Ray cluster of
N nodes (bench/_cluster.py: root, Ray), CartPole with ``REPRO_RAY_PAIRS`` pairs (100).
Each run rewrites only its own section of the ``--write`` file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boxd.rl as rl
from _common import describe_host, say
from boxd import Boxd, errors

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".cache" / "wheels-mujoco"
GUEST_WHEELS = "/root/wheels-repro"
PAIRS = int(os.environ.get("REPRO_PAIRS", "20"))
STEPS = int(os.environ.get("REPRO_STEPS", "200"))
JOBS = int(os.environ.get("REPRO_JOBS", "4"))
RAY_PAIRS = int(os.environ.get("REPRO_RAY_PAIRS", "100"))

ENVS_PY = '''
import os, time
import gymnasium as gym
import numpy as np


class ClockEnv(gym.Env):
    """Seeded, except that step 37's observation is the wall clock."""
    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.random(1), {}

    def step(self, action):
        self.t += 1
        v = time.time_ns() % 1_000_003 if self.t == 37 else self.np_random.random()
        return np.array([float(v)]), 1.0, False, self.t >= 100, {}


class UrandomEnv(ClockEnv):
    """Seeded, except that step 37 reads the kernel RNG (reseeded at every fork)."""

    def step(self, action):
        self.t += 1
        v = os.urandom(4)[0] if self.t == 37 else self.np_random.random()
        return np.array([float(v)]), 1.0, False, self.t >= 100, {}
'''

ENVS = [("CartPole-v1", "CartPole-v1"), ("Acrobot-v1", "Acrobot-v1"),
        ("HalfCheetah-v5 (MuJoCo)", "HalfCheetah-v5"),
        ("reads the clock at step 37", "repro_envs:ClockEnv"),
        ("reads os.urandom at step 37", "repro_envs:UrandomEnv")]


def _wheels() -> list[Path]:
    if not any(p.name.startswith("mujoco-") for p in WHEELS.glob("*.whl")):
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                        "-d", str(WHEELS), "gymnasium[mujoco]", "numpy", "cloudpickle"],
                       check=True, timeout=900)
    return sorted(WHEELS.glob("*.whl"))


def _ok(client: Boxd, ref: str, cmd: str, timeout: float = 1200) -> None:
    r = client.machines.exec(ref, cmd, timeout=timeout)
    if r.exit_code != 0:
        raise RuntimeError(f"{cmd!r} exited {r.exit_code}: {r.stderr[-800:]}")


def _baseline(client: Boxd, engine: str, made: list[str]) -> str:
    m = client.machines.new(f"repro-{engine}", engine=engine)
    made.append(m.id)
    client.machines.wait_until_ready(m.id, timeout=600)
    for whl in _wheels():
        client.machines.files.upload(m.id, f"{GUEST_WHEELS}/{whl.name}", whl.read_bytes())
    _ok(client, m.id, f"pip install -q --no-cache-dir --no-index --find-links {GUEST_WHEELS} "
        f"'gymnasium[mujoco]' numpy cloudpickle && rm -rf {GUEST_WHEELS}")
    client.machines.files.upload(m.id, "/home/boxd/repro_envs.py", ENVS_PY)
    _ok(client, m.id, "cd /home/boxd && python3 -c 'import repro_envs, gymnasium as g; "
        "g.make(\"HalfCheetah-v5\").reset(seed=0)'")
    return m.id


def _restored(client: Boxd, base: str, made: list[str]) -> str:
    m = client.machines.fork(base, None)
    made.append(m.id)
    client.machines.wait_until_ready(m.id)
    client.machines.checkpoints.save(m.id, "before")
    _ok(client, m.id, "echo changed > /root/changed && python3 -c 'import os; os.urandom(64)'")
    client.machines.checkpoints.restore(m.id, "before")
    return m.id


def _from_snapshot(client: Boxd, base: str, made: list[str], snaps: list[str]) -> str:
    snap = client.snapshots.save(base, f"repro-snap-{base.replace('_', '-')}")
    ref = f"{snap.name}@{snap.version}"
    snaps.append(ref)
    m = client.machines.new(None, from_snapshot=ref)
    made.append(m.id)
    client.machines.wait_until_ready(m.id, timeout=600)
    return m.id


def _cell(report: Any) -> list[str]:
    bad = report.diverged
    first = bad[0].first_divergence if bad else None
    cause = (bad[0].likely_cause or "").split(" (step")[0] if bad else ""
    return [str(report.seeds), f"{report.seeds - report.diverged_seeds}",
            str(report.distinct),
            f"step {first.step}, {first.field}" if first else "-",
            cause or "-", f"{report.pairs_per_minute:.0f}"]


def _host_rows(client: Boxd) -> list[list[str]]:
    """Every env x (fork, restored, snapshot[, engines]) on this host's engines."""
    engines = [e for e in os.environ.get("REPRO_ENGINES", "").split(",") if e] or [
        client.info().engine]
    made: list[str] = []
    snaps: list[str] = []
    rows: list[list[str]] = []
    try:
        bases = {}
        for engine in engines:
            say(f"preparing the {engine} baseline")
            bases[engine] = _baseline(client, engine, made)
        placements: list[tuple[str, str, str | list[str]]] = []
        for engine, base in bases.items():
            placements.append(("fork", engine, base))
            placements.append(("restored", engine, _restored(client, base, made)))
            placements.append(("snapshot", engine, _from_snapshot(client, base, made, snaps)))
        if len(bases) >= 2:
            placements.append(("engines", "+".join(bases), list(bases.values())))
        for label, env in ENVS:
            for placement, engine, source in placements:
                say(f"{label}: {placement} on {engine}, {PAIRS} seeds")
                report = rl.verify(source, env, seeds=range(PAIRS), steps=STEPS, jobs=JOBS,
                                   boxd=client)
                rows.append([label, placement, engine, *_cell(report)])
    finally:
        for mid in reversed(made):
            with contextlib.suppress(errors.BoxdError):
                client.machines.delete(mid)
        for sid in snaps:
            with contextlib.suppress(errors.BoxdError):
                client.snapshots.delete(sid)
    return rows


def _ray_rows(nodes: int) -> list[list[str]]:
    """Every env with ``placement="spread"`` on a local Ray cluster of ``nodes`` nodes
    (QEMU: a gVisor machine's forks cannot leave their node); CartPole gets
    ``REPRO_RAY_PAIRS`` pairs, the others ``PAIRS``."""
    from _cluster import local_cluster

    rows: list[list[str]] = []
    cap = str(2 * JOBS + 2)  # a pair's two runs per job, the baseline and a template
    with local_cluster(nodes=nodes, cap=int(cap)) as cluster:
        client = cluster.client
        made: list[str] = []
        try:
            say(f"preparing the qemu baseline on a {nodes}-node Ray cluster")
            base = _baseline(client, "qemu", made)
            for label, env in ENVS:
                pairs = RAY_PAIRS if env == "CartPole-v1" else PAIRS
                say(f"{label}: spread over {nodes} nodes, {pairs} seeds")
                report = rl.verify(base, env, seeds=range(pairs), steps=STEPS, jobs=JOBS,
                                   boxd=client, placement="spread")
                spread = {frozenset(p.nodes) for p in report.pairs}
                assert all(len(n) == 2 for n in spread), "a pair's runs on two nodes"
                rows.append([label, f"spread over {nodes} nodes", "qemu", *_cell(report)])
        finally:
            for mid in reversed(made):
                with contextlib.suppress(errors.BoxdError):
                    client.machines.delete(mid)
    return rows


HEAD = ["env", "placement", "engine", "pairs", "identical", "distinct",
        "first divergence", "likely cause", "pairs/min"]


def _section(name: str, intro: str, rows: list[list[str]]) -> str:
    lines = [
        f"<!-- repro:{name} (bench/reproducibility.py writes this part) -->",
        intro, "",
        f"Measured {time.strftime('%Y-%m-%d')} on {describe_host()}.", "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "|".join("---" for _ in HEAD) + "|",
        *("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows),
        f"<!-- /repro:{name} -->",
    ]
    return "\n".join(lines)


def _write(path: Path, name: str, section: str) -> None:
    """Replace the section ``name`` of ``path`` (append it if it has none)."""
    text = path.read_text() if path.exists() else TITLE
    begin, end = f"<!-- repro:{name} ", f"<!-- /repro:{name} -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


TITLE = (
    "# Reproducibility: what `boxd.rl.verify` measured\n\n"
    "Produced by `bench/reproducibility.py` (do not edit the tables by hand). Every pair "
    f"is two fresh forks running the env {STEPS} steps with one seed and a seeded "
    "policy, compared exactly (type, dtype, bytes); *distinct* counts the different "
    "trajectories across the seeds.\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", type=Path, help="write the Markdown section into this file")
    p.add_argument("--ray", type=int, metavar="N", help="instead: every env with "
                   "placement='spread' on a local Ray cluster of N nodes (root, Ray)")
    args = p.parse_args()
    if args.ray:
        name, rows = "ray", _ray_rows(args.ray)
        intro = (f"## Across Ray nodes\n\nA pair's two runs on two of {args.ray} Ray nodes "
                 "on this machine (`placement=\"spread\"`: run `i` of the `k`-th seed "
                 "on node `(i + k) % n`), forked from one QEMU baseline whose template "
                 "streams to each node once.")
    else:
        name, rows = "host", _host_rows(Boxd())
        intro = ("## One host\n\nPlacements: `fork` (forks of the baseline), `restored` "
                 "(forks of a machine restored from a checkpoint), `snapshot` (forks of a "
                 "machine started from a snapshot of the baseline), `engines` (a pair's "
                 "runs on two engines, each from its own baseline made by the same "
                 "recipe).")
    section = _section(name, intro, rows)
    if args.write:
        _write(args.write, name, section)
        say(f"wrote {args.write}")
    else:
        print(section)


if __name__ == "__main__":
    main()
