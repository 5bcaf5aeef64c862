"""boxd.rl: the step channel, vector env throughput, reset cost per mode, PPO wall time.

    python bench/bench_rl.py            # this module alone (bench/run.py runs them all)

Needs ``boxd[sb3]`` on the host. A warm source machine is prepared once (a cold boot,
then gymnasium, numpy and cloudpickle installed from wheels the host downloads), or
taken from ``BOXD_BENCH_RL_SOURCE`` (a machine name that already has them). Figures:

- channel: a 100-byte message through ``machines.spawn`` to a framed echo process in
  the guest and back (SDK, WebSocket, daemon, agent, guest pipe), against an agent
  ``ping`` (the guest channel's floor); the breakdown: the same echo driven by the
  engine's own ``AgentClient`` on a machine booted without the daemon (agent channel,
  boxd-init, the echo process: the guest side) and the daemon's own HTTP round trip
  without the guest (``wait`` on a running machine); and a whole ``exec`` of ``true``;
- vector: ``boxd.rl.VectorEnv`` and ``boxd.rl.sb3.VecEnv`` steps/s for 1, 4, 8 and 16
  CartPole sub-envs (``BENCH_RL_SIZES``), one machine per env and
  ``envs_per_machine=8``, ``BENCH_RL_STEPS`` vector steps each (default 100), against
  Gymnasium's ``AsyncVectorEnv`` on the host in the same run, with a breakdown per
  vector step of the time inside the guests' ``env.step`` (the env server's own
  clock) and the rest (channel, daemon, agent);
- overlap: a learner that works ``BENCH_RL_LEARNER_MS`` (default 5) between
  ``step_async`` and ``step_wait`` of a ``boxd.rl.VectorEnv`` and a
  ``boxd.rl.sb3.VecEnv`` of 4 CartPole sub-envs: time per step now that
  ``step_async`` sends (the sub-envs step while the learner works) against the same
  env stepped the way ``step_async`` used to (it stored the actions, so the whole round
  trip came after the learner's work: emulated as the work, then ``step``), the two
  alternating in blocks;
- reset: ``boxd.rl.Env.reset`` per reset mode (env, rewind, refork), after 10 steps;
- ppo: PPO wall time over ``boxd.rl.sb3.VecEnv`` against a local ``DummyVecEnv``.

``BENCH_RL_PARTS=channel,vector`` measures only those parts (default: all five).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Row, median, row_from, say, standalone

GROUP = "rl"
REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".cache" / "wheels-rl"
PACKAGES = ["gymnasium", "numpy", "cloudpickle"]
ECHO = (
    "import sys\n"
    "r, w = sys.stdin.buffer, sys.stdout.buffer\n"
    "while True:\n"
    "    h = r.read(4)\n"
    "    if len(h) < 4: break\n"
    "    body = r.read(int.from_bytes(h, 'big'))\n"
    "    w.write(h + body); w.flush()\n"
)
CHANNEL_N = 300
BLOCK = 25
PARTS = [p.strip() for p in os.environ.get("BENCH_RL_PARTS", "").split(",") if p.strip()]
VECTOR_SIZES = tuple(int(x) for x in os.environ.get("BENCH_RL_SIZES", "1,4,8,16").split(","))
#: Sub-envs per machine: 1 (one fork per env) and 8.
VECTOR_PER_MACHINE = (1, 8)
VECTOR_STEPS = int(os.environ.get("BENCH_RL_STEPS", "100"))
RESETS = 5
#: The learner's work between step_async and step_wait (the overlap part), and its envs.
LEARNER_S = float(os.environ.get("BENCH_RL_LEARNER_MS", "5")) / 1e3
OVERLAP_ENVS = 4


def _accel(client: Any, machine: str) -> str:
    return str(client.machines.get(machine).accelerator or "?")


def _prepare_source(client: Any, tell: Callable[[str], None]) -> tuple[str, bool]:
    """A warm source machine; True when this run made it (and must delete it)."""
    name = os.environ.get("BOXD_BENCH_RL_SOURCE")
    if name:
        return name, False
    tell("bench_rl: preparing a warm source (cold boot + pip install, minutes under TCG)")
    if not all(any(p.name.lower().startswith(k) for p in WHEELS.glob("*.whl"))
               for k in PACKAGES):
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                        "-d", str(WHEELS), *PACKAGES], check=True)
    m = client.machines.new("bench-rl-source")
    client.machines.wait_until_ready(m.id, timeout=600)
    for whl in WHEELS.glob("*.whl"):
        client.machines.files.upload(m.id, f"/root/wheels-rl/{whl.name}", whl.read_bytes())
    r = client.machines.exec(m.id, "pip install -q --no-index --find-links /root/wheels-rl "
                             + " ".join(PACKAGES), timeout=1800)
    assert r.exit_code == 0, r.stderr[-800:]
    client.machines.exec(m.id, "python3 -c 'import gymnasium, numpy, cloudpickle'",
                         timeout=600)
    return m.id, True


async def _agent_level(accel: str, reason: str, n: int) -> tuple[list[float], list[float]]:
    """Agent pings and 100-byte echo round trips through the engine's own AgentClient
    (no daemon, WebSocket or SDK), interleaved, on a machine booted for it."""
    from bench_runtime import engine_machine

    async with engine_machine(accel, reason, "bench-rl-agent") as agent:
        await agent.write_file("/home/boxd/echo.py", ECHO.encode())
        proc = await agent.start(["python3", "-u", "/home/boxd/echo.py"])
        events = aiter(proc)
        frame = (100).to_bytes(4, "big") + b"x" * 100

        async def rt() -> None:
            await proc.write(frame)
            got = 0
            while got < len(frame):
                item = await asyncio.wait_for(anext(events), 60)
                got += len(item.data)

        for _ in range(50):
            await rt()
            await agent.ping()
        pings, stream = [], []
        for _ in range(n):
            t = time.perf_counter()
            await rt()
            stream.append(time.perf_counter() - t)
            pings.append(await agent.ping())
        await proc.kill()
        return pings, stream


def _channel(client: Any, source: str, tell: Callable[[str], None]) -> list[Row]:
    tell("bench_rl: agent ping and echo through the engine's AgentClient (own machine)")
    info = client.info()
    pings, agent_rt = asyncio.run(_agent_level(info.accelerator, info.accelerator_reason,
                                               CHANNEL_N))
    tell("bench_rl: channel round trips")
    m = client.machines.fork(source, "bench-rl-echo")
    try:
        client.machines.wait_until_ready(m.id)
        accel = _accel(client, m.id)
        client.machines.files.upload(m.id, "/home/boxd/echo.py", ECHO)
        proc = client.machines.spawn(m.id, ["python3", "-u", "/home/boxd/echo.py"])
        msg = b"x" * 100

        def rt() -> None:
            proc.send(msg)
            proc.recv(timeout=60)

        for _ in range(50):
            rt()
        chan: list[float] = []
        http: list[float] = []
        # In alternating blocks, so load on the shared host hits both alike while each
        # runs back to back, as an RL loop's steps do.
        for _ in range(CHANNEL_N // BLOCK):
            for _ in range(BLOCK):
                t = time.perf_counter()
                rt()
                chan.append(time.perf_counter() - t)
            for _ in range(BLOCK):
                t = time.perf_counter()
                client.machines.wait_until_ready(m.id)
                http.append(time.perf_counter() - t)
        execs = []
        for _ in range(20):
            t = time.perf_counter()
            client.machines.exec(m.id, "true")
            execs.append(time.perf_counter() - t)
        proc.kill()
        return [
            row_from(GROUP, "channel round trip, 100 B (SDK -> guest -> SDK)", chan,
                     accel=accel, note="target p50 <= 1 ms", baseline="agent ping",
                     baseline_values=pings),
            row_from(GROUP, "agent ping (engine AgentClient, no daemon)", pings, accel=accel,
                     note="the guest channel's floor"),
            row_from(GROUP, "echo round trip, 100 B (engine AgentClient -> guest -> back)",
                     agent_rt, accel=accel, baseline="agent ping", baseline_values=pings,
                     note="the guest side of the channel: agent channel, boxd-init, echo"),
            row_from(GROUP, "daemon HTTP round trip (wait, running machine)", http,
                     accel=accel, note="SDK -> daemon -> SDK, no guest"),
            row_from(GROUP, "exec `true` (SDK)", execs, accel=accel,
                     note="a whole command, for comparison", baseline="channel round trip",
                     baseline_values=chan),
        ]
    finally:
        client.machines.delete(m.id)


def _vector(client: Any, source: str, tell: Callable[[str], None]) -> list[Row]:
    import gymnasium as gym
    import numpy as np

    import boxd.rl as rl
    from boxd.rl.sb3 import VecEnv

    rows: list[Row] = []
    for n in VECTOR_SIZES:
        tell(f"bench_rl: AsyncVectorEnv of {n} CartPole envs (host)")
        actions = np.zeros(n, dtype=np.int64)
        ref = gym.vector.AsyncVectorEnv([lambda: gym.make("CartPole-v1")] * n)
        try:
            ref.reset(seed=0)
            for _ in range(10):
                ref.step(actions)
            host = []
            for _ in range(VECTOR_STEPS):
                t = time.perf_counter()
                ref.step(actions)
                host.append(time.perf_counter() - t)
        finally:
            ref.close()
        for k in VECTOR_PER_MACHINE:
            if k > 1 and n <= 1:
                continue
            for kind in ("VectorEnv", "sb3.VecEnv"):
                tell(f"bench_rl: {kind} of {n} CartPole envs, envs_per_machine={k}")
                t0 = time.perf_counter()
                env: Any = (rl.VectorEnv if kind == "VectorEnv" else VecEnv)(
                    "CartPole-v1", n, source=source, boxd=client, envs_per_machine=k)
                build = time.perf_counter() - t0
                try:
                    accel = _accel(client, str(env.machines[0]))
                    if kind == "VectorEnv":
                        env.reset(seed=0)
                    else:
                        env.seed(0)
                        env.reset()
                    for _ in range(10):
                        env.step(actions)
                    stats0 = env._pool.values(env._pool.broadcast([("stats",)] * n))
                    times = []
                    for _ in range(VECTOR_STEPS):
                        t = time.perf_counter()
                        env.step(actions)
                        times.append(time.perf_counter() - t)
                    stats1 = env._pool.values(env._pool.broadcast([("stats",)] * n))
                finally:
                    env.close()
                # Guest compute per vector step: the slowest machine's time inside
                # step/reset (its sub-envs run one after another).
                inside: dict[int, float] = {}
                for i, (a, b) in enumerate(zip(stats0, stats1, strict=True)):
                    secs = sum(b.get(op, (0, 0.0))[1] - a.get(op, (0, 0.0))[1]
                               for op in ("step", "reset"))
                    inside[i // k] = inside.get(i // k, 0.0) + secs / VECTOR_STEPS
                per_step = sorted(times)[len(times) // 2]
                host_step = sorted(host)[len(host) // 2]
                rows.append(row_from(
                    GROUP, f"{kind} step, {n} envs, {k} per machine (s per vector step)",
                    times, accel=accel,
                    note=(f"{n / per_step:.0f} env steps/s vs {n / host_step:.0f} host; "
                          f"{n / per_step / n:.0f} per env; guest env.step "
                          f"{max(inside.values()) * 1e3:.2f} ms, channel+daemon "
                          f"{(per_step - max(inside.values())) * 1e3:.2f} ms; "
                          f"build {build:.1f} s"),
                    baseline="AsyncVectorEnv (host)", baseline_values=host))
    return rows


def _learner_work() -> None:
    """The learner's share of a step (a policy's forward pass, say): ``LEARNER_S`` of
    waiting, which takes no CPU from the envs (on a 2-core host a busy loop would
    measure the contention instead)."""
    time.sleep(LEARNER_S)


def _overlap(client: Any, source: str, tell: Callable[[str], None]) -> list[Row]:
    import numpy as np

    import boxd.rl as rl
    from boxd.rl.sb3 import VecEnv

    rows: list[Row] = []
    n = OVERLAP_ENVS
    actions = np.zeros(n, dtype=np.int64)
    for kind in ("VectorEnv", "sb3.VecEnv"):
        tell(f"bench_rl: {kind} of {n} CartPole envs, learner {LEARNER_S * 1e3:g} ms "
             "between step_async and step_wait")
        env: Any = (rl.VectorEnv if kind == "VectorEnv" else VecEnv)(
            "CartPole-v1", n, source=source, boxd=client)
        try:
            accel = _accel(client, str(env.machines[0]))
            env.reset()
            sent, stored, waits, bare = [], [], [], []
            for _ in range(VECTOR_STEPS // BLOCK or 1):
                for _ in range(BLOCK):  # now: the envs step during the learner's work
                    t = time.perf_counter()
                    env.step_async(actions)
                    _learner_work()
                    w = time.perf_counter()
                    env.step_wait()
                    sent.append(time.perf_counter() - t)
                    waits.append(time.perf_counter() - w)
                for _ in range(BLOCK):  # before: nothing left until step_wait
                    t = time.perf_counter()
                    _learner_work()
                    w = time.perf_counter()
                    env.step(actions)
                    stored.append(time.perf_counter() - t)
                    bare.append(time.perf_counter() - w)
        finally:
            env.close()
        rows.append(row_from(
            GROUP, f"{kind} step with {LEARNER_S * 1e3:g} ms of learner work between "
            f"step_async and step_wait, {n} envs (s per step)", sent, accel=accel,
            note=(f"step_async sends; the sub-envs step while the learner works: "
                  f"step_wait {median(waits) * 1e3:.2f} ms after it, against "
                  f"{median(bare) * 1e3:.2f} ms for a whole step"),
            baseline="step_async storing the actions (emulated)", baseline_values=stored))
    return rows


def _resets(client: Any, source: str, tell: Callable[[str], None]) -> list[Row]:
    import boxd.rl as rl

    rows = []
    for mode in ("env", "rewind", "refork"):
        tell(f"bench_rl: reset mode {mode}")
        env = rl.Env("CartPole-v1", source=source, boxd=client, reset_mode=mode)  # type: ignore[arg-type]
        try:
            accel = _accel(client, str(env.machine))
            env.reset(seed=0)
            times = []
            for i in range(RESETS):
                for _ in range(10):
                    env.step(0)
                t = time.perf_counter()
                env.reset(seed=i)
                times.append(time.perf_counter() - t)
        finally:
            env.close()
        rows.append(row_from(GROUP, f"Env.reset, reset_mode={mode!r}", times, accel=accel,
                             note="after 10 steps"))
    return rows


def _ppo(client: Any, source: str, tell: Callable[[str], None]) -> list[Row]:
    tell("bench_rl: PPO over boxd vs DummyVecEnv")
    import gymnasium as gym
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv

    from boxd.rl.sb3 import VecEnv

    torch.set_num_threads(1)
    steps = 1024

    def train(venv: Any) -> float:
        model = PPO("MlpPolicy", venv, n_steps=256, batch_size=64, n_epochs=2, seed=0,
                    device="cpu")
        t = time.perf_counter()
        model.learn(total_timesteps=steps)
        return time.perf_counter() - t

    local = DummyVecEnv([lambda: gym.make("CartPole-v1")] * 2)
    base = [train(local)]
    venv = VecEnv("CartPole-v1", 2, source=source, boxd=client)
    try:
        accel = _accel(client, str(venv.machines[0]))
        ours = [train(venv)]
    finally:
        venv.close()
    return [row_from(GROUP, f"PPO {steps} steps, 2 envs over boxd.rl.sb3.VecEnv", ours,
                     accel=accel, baseline="DummyVecEnv (host)", baseline_values=base)]


def run(client: Any | None = None, log: Callable[[str], None] | None = None) -> list[Row]:
    """Every figure of the module docstring, against one warm source machine."""
    from boxd import Boxd

    tell = log or say
    own_client = client is None
    c = client if client is not None else Boxd()
    source, made = _prepare_source(c, tell)
    try:
        parts = {"channel": _channel, "vector": _vector, "overlap": _overlap,
                 "reset": _resets, "ppo": _ppo}
        unknown = set(PARTS) - set(parts)
        if unknown:
            raise SystemExit(f"BENCH_RL_PARTS: no part {sorted(unknown)}; parts: {list(parts)}")
        rows: list[Row] = []
        for name, part in parts.items():
            if not PARTS or name in PARTS:
                rows += part(c, source, tell)
        return rows
    finally:
        if made:
            with contextlib.suppress(Exception):
                c.machines.delete(source)
        if own_client:
            c.close()


if __name__ == "__main__":
    standalone(run)
