"""QEMU and gVisor side by side (issue 17): the same API, the same figures, one run.

    python bench/bench_engines.py       # this module alone (bench/run.py runs them all)

For each engine the daemon lists as ``ok`` (``info().engines``), on the daemon the
environment points at (``BOXD_HOME``):

- cold boot: ``machines.new(engine=...)`` → the first ``exec true`` answered;
- a warm RL source as the spec prepares it (gymnasium + numpy from wheels the *host*
  downloads, as tests/integration/test_rl.py does; ``warm_up.py`` run);
- fork → exec-ready (``fork`` + ``exec true``), one at a time from the unchanged warm
  source (standby children on, the daemon's default: the fork claims the standby copy
  made after the previous one), p50/p90; and 8 forks in one call, all exec-ready;
- the spec's 8 rollouts (fork, wait, ``python3 rollout.py --seed N``, delete; 8 threads),
  wall time per round: rounds 2 s apart, then rounds after ``BENCH_ENGINE_ROLLOUT_IDLE``
  (10) idle seconds each, when the daemon has refilled its standby children; and the
  loop's floor in the same run: the 8 ``rollout.py`` execs alone, in 8 fresh forks made
  and idle first (the loop over the floor is what forking and deleting cost it);
- the first batch (issue 25): the same loop's first round from a baseline just made
  ready (a fork of the warm source, no standby copies yet), without a pool and after
  ``machines.warm(forks=8)`` (the call timed apart), alternating, against the floor;
- one CartPole episode (the spec's seeded policy, imports excluded, mean of 20 seeds;
  ``BENCH_ENGINE_EPISODE_N`` (3) runs, once the standby children are refilled) in
  a fork, against the same code on the host's own Python (same wheels, installed with
  ``pip --target`` from the local wheel directory);
- an idle copy's host memory: PSS of the fork's processes (QEMU: its QEMU process;
  gVisor: the sandbox, its systrap stubs and its gofer);
- checkpoint save and restore (API call to done) on the warm source's fork.

Ratios compare gVisor with QEMU's figure measured in the same run; the episode
compares each engine with native.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Row, median, pss_bytes, qemu_pid, row_from, say, standalone
from boxd import Boxd

GROUP = "engines"
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "rl"
WHEELS = REPO / ".cache" / "wheels-rl"
GUEST_WHEELS = "/root/wheels"
BOOT_N = int(os.environ.get("BENCH_ENGINE_BOOT_N", "3"))
FORK_N = int(os.environ.get("BENCH_ENGINE_FORK_N", "10"))
ROLLOUT_ROUNDS = int(os.environ.get("BENCH_ENGINE_ROLLOUT_ROUNDS", "3"))
# Idle seconds before each round of the second rollout figure: time for the daemon to
# refill its standby children after the previous round (8 gVisor restores: ~3-4 s here).
ROLLOUT_IDLE = float(os.environ.get("BENCH_ENGINE_ROLLOUT_IDLE", "10"))
CKPT_N = int(os.environ.get("BENCH_ENGINE_CKPT_N", "3"))
# Runs of the episode figure (each the mean of 20 seeds in a fresh interpreter).
EPISODE_N = int(os.environ.get("BENCH_ENGINE_EPISODE_N", "3"))
ONLY = [e for e in os.environ.get("BENCH_ENGINES", "qemu,gvisor").split(",") if e]
EPISODE_CODE = (
    "import sys, time; sys.path.insert(0, {dir!r}); import rollout, gymnasium as gym, "
    "numpy as np; env = gym.make('CartPole-v1'); w = rollout.make_policy(np); "
    "rollout.episode(0, env, w, np); t = time.perf_counter(); "
    "[rollout.episode(s, env, w, np) for s in range(20)]; "
    "print((time.perf_counter() - t) / 20)"
)


def _ok(client: Boxd, ref: str, cmd: str, timeout: float | None = 900) -> str:
    r = client.machines.exec(ref, cmd, timeout=timeout)
    if r.exit_code != 0:
        raise RuntimeError(f"{cmd!r} exited {r.exit_code}: {r.stderr.strip()[-400:]}")
    return r.stdout


def _timed(fn: Callable[[], Any]) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def _wheels() -> list[Path]:
    have = sorted(WHEELS.glob("*.whl"))
    if not any(p.name.startswith("gymnasium-") for p in have):
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                        "-d", str(WHEELS), "gymnasium", "numpy"], check=True, timeout=600)
        have = sorted(WHEELS.glob("*.whl"))
    return have


def native_episode() -> list[float] | None:
    """The episode on the host's Python, with the same wheels, ``EPISODE_N`` runs (None
    if the wheels don't fit)."""
    with tempfile.TemporaryDirectory(prefix="boxd-bench-native-") as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                            "--find-links", str(WHEELS), "--target", tmp, "gymnasium",
                            "numpy"], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return None
        env = {**os.environ, "PYTHONPATH": tmp}
        runs = []
        for _ in range(EPISODE_N):
            out = subprocess.run(
                [sys.executable, "-c", EPISODE_CODE.format(dir=str(EXAMPLES))],
                capture_output=True, text=True, env=env, timeout=300)
            if out.returncode != 0:
                return None
            runs.append(float(out.stdout.strip()))
        return runs


def _descendants(pid: int) -> list[int]:
    out = [pid]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += _descendants(int(child))
    return out


def _vm_id(machine_id: str) -> str:
    import sqlite3

    from boxd.config import Paths

    db = Paths.default().db
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        row = conn.execute("SELECT vm_id FROM machines WHERE id=?", (machine_id,)).fetchone()
    return str(row[0]) if row else machine_id


def machine_pss(client: Boxd, engine: str, machine_id: str) -> int | None:
    """Host PSS of one machine's processes."""
    vm = _vm_id(machine_id)  # a claimed standby child runs under its own VM id
    if engine == "qemu":
        pid = qemu_pid(vm)
        return pss_bytes(pid) if pid else None
    out = subprocess.run(["pgrep", "-f", f"runsc-sandbox .* {vm}$"], capture_output=True,
                         text=True).stdout.split()
    if not out:
        return None
    sandbox = int(out[0])
    pids = _descendants(sandbox)
    # The gofer: started by the same `runsc` with the same bundle (its run directory).
    bundle = next((a for a in Path(f"/proc/{sandbox}/cmdline").read_bytes().decode()
                   .split("\0") if a.startswith("--bundle=")), None)
    if bundle:
        gofers = subprocess.run(["pgrep", "-f", f"runsc-gofer .*{bundle}"],
                                capture_output=True, text=True).stdout.split()
        pids += [int(p) for p in gofers]
    total = 0
    for p in pids:
        with contextlib.suppress(OSError, RuntimeError):
            total += pss_bytes(p)
    return total


def bench_engine(client: Boxd, engine: str, log: Callable[[str], None]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    made: list[str] = []

    def new(name: str, **kw: Any) -> str:
        m = client.machines.new(name, engine=engine, **kw)
        made.append(m.id)
        return m.id

    try:
        log(f"{engine}: cold boots")
        boots = []
        for i in range(BOOT_N):
            t = time.monotonic()
            mid = new(f"bench-{engine}-boot-{i}")
            client.machines.wait_until_ready(mid, timeout=300)
            _ok(client, mid, "true")
            boots.append(time.monotonic() - t)
            client.machines.delete(mid)
            made.remove(mid)
        res["boot"] = boots

        log(f"{engine}: warm RL source (wheels, pip install, warm_up.py)")
        src = new(f"bench-{engine}-rl")
        client.machines.wait_until_ready(src, timeout=300)
        for whl in _wheels():
            client.machines.files.upload(src, f"{GUEST_WHEELS}/{whl.name}", whl.read_bytes())
        _ok(client, src, f"pip install -q --no-cache-dir --no-index --find-links {GUEST_WHEELS}"
                         f" gymnasium numpy && rm -rf {GUEST_WHEELS}", timeout=1800)
        client.machines.files.upload(src, "/home/boxd/warm_up.py",
                                     (EXAMPLES / "warm_up.py").read_text())
        client.machines.files.upload(src, "/home/boxd/rollout.py",
                                     (EXAMPLES / "rollout.py").read_text())
        _ok(client, src, "cd /home/boxd && python3 warm_up.py", timeout=900)

        log(f"{engine}: fork -> exec-ready x{FORK_N}")
        client.machines.delete(client.machines.fork(src).id)  # template made once
        forks = []
        for _ in range(FORK_N):
            t = time.monotonic()
            child = client.machines.fork(src)
            _ok(client, child.id, "true")
            forks.append(time.monotonic() - t)
            client.machines.delete(child.id)
            time.sleep(2.0)  # the standby copy the fork claimed is replaced meanwhile
        res["fork"] = forks
        batch = []
        for _ in range(2):
            t = time.monotonic()
            kids = client.machines.fork(src, count=8)
            ids = [k.id for k in kids if not isinstance(k, Exception)]
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(lambda i: _ok(client, i, "true"), ids))
            batch.append(time.monotonic() - t)
            for mid in ids:
                client.machines.delete(mid)
            assert len(ids) == 8, kids
            time.sleep(2.0)
        res["fork8"] = batch

        log(f"{engine}: 8 rollouts x{ROLLOUT_ROUNDS}")

        def rollout(seed: int, source: str = src) -> str:
            fork = client.machines.fork(source)
            client.machines.wait_until_ready(fork.id)
            out = _ok(client, fork.id, f"python3 /home/boxd/rollout.py --seed {seed}")
            client.machines.delete(fork.id)
            return out

        def batch(source: str = src) -> float:
            """The spec's loop once: 8 threads, each fork, wait, rollout, delete."""
            with ThreadPoolExecutor(max_workers=8) as pool:
                t = time.monotonic()
                outs = list(pool.map(lambda s: rollout(s, source), range(8)))
                wall = time.monotonic() - t
            assert len(set(outs)) > 1
            return wall

        def rounds(gap: float) -> list[float]:
            walls = []
            for _ in range(ROLLOUT_ROUNDS):
                time.sleep(gap)
                walls.append(batch())
            return walls

        res["rollouts"] = rounds(2.0)
        log(f"{engine}: 8 rollouts x{ROLLOUT_ROUNDS}, {ROLLOUT_IDLE:.0f} s idle before each")
        res["rollouts_idle"] = rounds(ROLLOUT_IDLE)

        # The first batch a user sees: the loop's first round from a baseline that has
        # just become ready (a fork of the warm source: warm worker, files, no standby
        # copies yet), without a pool and after machines.warm(forks=8), alternating.
        log(f"{engine}: first batch from a new baseline, without and with warm x{ROLLOUT_ROUNDS}")
        res["first"], res["first_warm"], res["warm_call"] = [], [], []
        for _ in range(ROLLOUT_ROUNDS):
            for pooled in (False, True):
                time.sleep(ROLLOUT_IDLE)
                base = client.machines.fork(src)
                made.append(base.id)
                client.machines.wait_until_ready(base.id)
                _ok(client, base.id, "true")
                if pooled:
                    res["warm_call"].append(_timed(
                        lambda b=base.id: client.machines.warm(b, forks=8)))
                res["first_warm" if pooled else "first"].append(batch(base.id))
                client.machines.delete(base.id)
                made.remove(base.id)

        # The loop's floor on this host right now: the same 8 rollouts in 8 fresh forks
        # of the same source (made, exec-ready and idle first), only the execs timed. The
        # loop's wall over this is what forking and deleting per rollout cost it; this
        # figure itself is the machines' own work, which the host's pace moves.
        log(f"{engine}: 8 rollout execs alone in 8 fresh forks x{ROLLOUT_ROUNDS}")
        floor = []
        for _ in range(ROLLOUT_ROUNDS):
            time.sleep(ROLLOUT_IDLE)
            fresh = [k.id for k in client.machines.fork(src, count=8)
                     if not isinstance(k, Exception)]

            def episode(seed: int, fresh: list[str] = fresh) -> str:
                return _ok(client, fresh[seed], f"python3 /home/boxd/rollout.py --seed {seed}")

            try:
                assert len(fresh) == 8, fresh
                for mid in fresh:
                    client.machines.wait_until_ready(mid)
                time.sleep(2.0)  # past the claims' own settling (identity, refill start)
                with ThreadPoolExecutor(max_workers=8) as pool:
                    t = time.monotonic()
                    outs = list(pool.map(episode, range(8)))
                    floor.append(time.monotonic() - t)
                assert len(set(outs)) > 1
            finally:
                for mid in fresh:
                    client.machines.delete(mid)
        res["rollout_floor"] = floor

        log(f"{engine}: episode in a fork, idle PSS, checkpoints")
        # After the standby children's refill (as before the idle rounds): an episode is
        # a few ms, and the 8 restores of the refill right after the last round made
        # one run of it 12x slower than the same fork measured on a quiet host.
        time.sleep(ROLLOUT_IDLE)
        child = client.machines.fork(src)
        made.append(child.id)
        code = "python3 -c " + _sh(EPISODE_CODE.format(dir="/home/boxd"))
        res["episode"] = [float(_ok(client, child.id, code).strip()) for _ in range(EPISODE_N)]
        time.sleep(3)
        res["pss"] = machine_pss(client, engine, child.id)
        saves, restores = [], []
        for i in range(CKPT_N):
            saves.append(_timed(lambda i=i: client.machines.checkpoints.save(child.id, f"c{i}")))
            restores.append(_timed(lambda i=i: (
                client.machines.checkpoints.restore(child.id, f"c{i}"),
                _ok(client, child.id, "true"))))
        res["ckpt_save"], res["ckpt_restore"] = saves, restores
    finally:
        for mid in made:
            with contextlib.suppress(Exception):
                client.machines.delete(mid)
    return res


def _sh(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def run(client: Boxd | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    log = log or say
    own = client is None
    client = client or Boxd()
    try:
        info = client.info()
        engines = [e for e in info.engines if e.status == "ok" and e.name in ONLY]
        accel = {e.name: (e.accelerator or e.name) for e in engines}
        data = {e.name: bench_engine(client, e.name, log) for e in engines}
    finally:
        if own:
            client.close()
    native = native_episode()
    rows: list[Row] = []
    q = data.get("qemu", {})

    def row(engine: str, name: str, key: str, note: str = "", unit: str = "s") -> None:
        vals = data[engine].get(key)
        if vals is None:
            return
        vals = vals if isinstance(vals, list) else [vals]
        base = q.get(key) if engine != "qemu" else None
        base = base if base is None or isinstance(base, list) else [base]
        rows.append(row_from(GROUP, f"{engine}: {name}", vals, unit=unit, accel=accel[engine],
                             note=note, baseline="qemu" if base else None,
                             baseline_values=base))

    for engine in data:
        row(engine, "cold boot -> exec-ready", "boot")
        row(engine, "fork -> exec-ready (warm RL source)", "fork",
            "target gvisor <= 200 ms" if engine == "gvisor" else "")
        row(engine, "8 forks in one call -> all exec-ready", "fork8",
            "2 rounds: 1 standby child ready, then those refilled in 2 s")
        row(engine, "8 rollouts, wall (spec loop, 8 threads)", "rollouts",
            "target gvisor <= 1 s; spec 1.6 s" if engine == "gvisor" else "spec 1.6 s")
        row(engine, f"8 rollouts, wall, after {ROLLOUT_IDLE:.0f} s idle", "rollouts_idle",
            "standby children refilled before each round")
        if (fl := data[engine].get("rollout_floor")) and (idle := data[engine].get(
                "rollouts_idle")):
            row(engine, "8 rollout execs alone, 8 fresh forks (the loop's floor)",
                "rollout_floor", f"loop after idle / floor: {median(idle) / median(fl):.2f}x")
        fl = data[engine].get("rollout_floor")
        for key, name in (("first", "first batch, new baseline, no pool"),
                          ("first_warm", "first batch after warm(forks=8)")):
            vals = data[engine].get(key)
            if vals and fl:
                row(engine, name, key, f"{median(vals) / median(fl):.2f}x the floor; "
                    "spec 1.6 s" + ("; target <= 1.2x floor" if key == "first_warm" else ""))
        row(engine, "machines.warm(forks=8) call", "warm_call",
            "before the first batch; not in its wall")
        row(engine, "checkpoint save", "ckpt_save")
        row(engine, "checkpoint restore -> exec-ready", "ckpt_restore")
        if data[engine].get("pss") is not None:
            row(engine, "idle fork, host PSS", "pss", unit="B")
        ep = data[engine].get("episode")
        if ep is not None:
            rows.append(row_from(
                GROUP, f"{engine}: CartPole episode in a fork", ep, accel=accel[engine],
                note="each run the mean of 20 seeds" + (" ; target gvisor <= 3x native"
                                                         if engine == "gvisor" else ""),
                baseline="native" if native else None, baseline_values=native))
    if native is not None:
        rows.append(row_from(GROUP, "host: CartPole episode, native Python", native,
                             accel="host", note="same wheels, pip --target"))
    return rows


if __name__ == "__main__":
    standalone(run)
