"""``boxd demo``: the reproducible-RL spec, end to end, on this host.

Runs the flow of ``spec/reproducible-rl-environments.md`` through the public SDK, as a
new user would, and prints what each step cost:

1. build the guest image if needed (local daemon only; a remote daemon builds its own);
2. ``rl-base``: create it, ``pip install gymnasium numpy`` in it (through the guest's
   network, as the spec does), upload and run ``warm_up.py`` (leaves a warm worker);
3. upload ``rollout.py``, ``machines.warm("rl-base", forks=8)`` (8 standby forks of the
   warm baseline, ready before the first batch), then the spec's ``ThreadPoolExecutor``
   loop: 8 forks, all claims, one seeded CartPole episode each;
4. the spec's reproducibility check: two forks with seed 42 give the same bytes;
5. checkpoint reset: on a fork, save ``episode-start``, run an episode that changes a
   file, restore, and show the file is gone and the next episode is identical;
6. snapshot round trip: ``snapshots.save("rl-base", "env-v3")``, then
   ``machines.new("rl-base-2", from_snapshot="env-v3")``; seed 42 there gives the same
   trajectory as on the forks;
7. a summary table; then everything the demo made is deleted (machines, snapshot; the
   guest image stays cached).

A failing step is named with its reason and the command exits 1.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from boxd import errors
from boxd.sdk import Boxd

__all__ = ["DemoFailed", "examples_dir", "run_demo"]

BASE = "rl-base"
SNAPSHOT = "env-v3"
RESTORED = "rl-base-2"
ROLLOUTS = 8
GUEST_HOME = "/home/boxd"
PIP_TIMEOUT = 1800.0
EXAMPLES_ENV = "BOXD_EXAMPLES"  # read in boxd.config

T = TypeVar("T")


class DemoFailed(Exception):
    """A step of the demo failed; ``step`` names it."""

    def __init__(self, step: str, reason: str) -> None:
        super().__init__(f"step '{step}' failed: {reason}")
        self.step = step
        self.reason = reason


def examples_dir() -> Path:
    """``examples/rl`` of this checkout (``$BOXD_EXAMPLES`` overrides)."""
    from boxd.config import ClientSettings

    if override := ClientSettings.from_env().examples:
        return override
    return Path(__file__).resolve().parents[2] / "examples" / "rl"


@dataclass
class _Run:
    console: Console
    client: Boxd
    steps: list[tuple[str, float, str]] = field(default_factory=list)
    made_machines: list[str] = field(default_factory=list)
    made_snapshot: str | None = None
    accel: str = "?"
    engine: str = "?"  # the engine the baseline (and so every fork) runs on
    engine_reason: str = ""  # why the daemon's default engine is that one (auto)
    names_checked: bool = False  # preflight saw none of the demo's machine names in use
    _bar: Progress | None = None  # the running step's progress, for update()
    _task: TaskID | None = None
    _title: str = ""

    def update(self, note: str, fraction: float | None = None) -> None:
        """Show what the running step is doing now (and how far, when known)."""
        if self._bar is None or self._task is None:
            return
        text = f"{self._title}: {note}" if note else self._title
        if fraction is None:
            self._bar.update(self._task, description=text, refresh=True)
        else:
            self._bar.update(self._task, description=text, total=1.0, completed=fraction,
                             refresh=True)

    @contextmanager
    def step(self, title: str) -> Iterator[list[str]]:
        """Run one step under a spinner; record its time and a detail line."""
        detail: list[str] = []
        start = time.monotonic()
        try:
            with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}[/]…"),
                          BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                          console=self.console, transient=True,
                          disable=not self.console.is_terminal) as bar:
                self._bar, self._title = bar, title
                self._task = bar.add_task(title, total=None)
                try:
                    yield detail
                finally:
                    self._bar = self._task = None
        except DemoFailed:
            raise
        except errors.BoxdError as exc:
            self.console.print(f"[red]✗[/] {title} ({time.monotonic() - start:.1f}s)")
            raise DemoFailed(title, str(exc)) from exc
        except Exception as exc:
            self.console.print(f"[red]✗[/] {title} ({time.monotonic() - start:.1f}s)")
            raise DemoFailed(title, f"{type(exc).__name__}: {exc}") from exc
        took = time.monotonic() - start
        text = "; ".join(detail)
        self.steps.append((title, took, text))
        self.console.print(f"[green]✓[/] {title} [dim]({took:.2f}s)[/] {text}")


def _exec_ok(client: Boxd, ref: str, command: str, timeout: float | None = None) -> str:
    result = client.machines.exec(ref, command, timeout=timeout)
    if result.exit_code != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"`{command}` exited {result.exit_code}: " + " | ".join(tail))
    return result.stdout


# pip's lines worth showing while it works: what it fetches and installs.
_PIP_NOTE = re.compile(r"^\s*(Collecting|Downloading|Installing|Successfully|Requirement)\b")


def _pip_install(run: _Run, command: str) -> str:
    """Run pip in the base machine, showing its current step; its stdout, or raise."""
    out: list[str] = []
    err: list[str] = []
    code: int | None = None
    pending = ""
    seen = 0
    for event in run.client.machines.exec_stream(BASE, command, timeout=PIP_TIMEOUT):
        if event.type == "stdout" and event.data:
            out.append(event.data)
            pending += event.data
            *lines, pending = pending.split("\n")
            for line in lines:
                if _PIP_NOTE.match(line):
                    seen += line.lstrip().startswith("Collecting")
                    run.update(f"{line.strip()[:70]} ({seen} collected)")
        elif event.type == "stderr" and event.data:
            err.append(event.data)
        elif event.type == "exit":
            code = event.exit_code
            if event.timed_out:
                raise RuntimeError(f"`{command}` timed out after {PIP_TIMEOUT:.0f} s")
    stdout = "".join(out)
    if code != 0:
        tail = ("".join(err) or stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"`{command}` exited {code}: " + " | ".join(tail))
    return stdout


def _record(line: str) -> dict[str, Any]:
    try:
        rec: dict[str, Any] = json.loads(line)
    except ValueError as exc:
        raise RuntimeError(f"rollout printed no trajectory record: {line[:200]!r}") from exc
    return rec


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.monotonic()
    value = fn()
    return value, time.monotonic() - start


def _exists(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except errors.NotFound:
        return False
    return True


def run_demo(
    client: Boxd,
    *,
    reuse: bool = False,
    keep: bool = False,
    console: Console | None = None,
) -> int:
    """Run the demo; return the process exit code (0 on success, 1 if a step failed)."""
    out = console or Console(highlight=False)
    run = _Run(out, client)
    out.rule("[bold]boxd demo: reproducible RL environments")
    try:
        _demo(run, reuse)
    except DemoFailed as exc:
        out.print(f"[bold red]error:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        out.print("[bold red]interrupted[/]")
        return 130
    finally:
        if not keep:
            _cleanup(run)
        else:
            out.print(f"kept: machines {run.made_machines}, snapshot {run.made_snapshot}")
    return 0


def _demo(run: _Run, reuse: bool) -> None:
    """The spec's flow, step by step (each step prints its ✓ line, or raises
    `DemoFailed`)."""
    files = examples_dir()
    base_exists = _preflight(run, files, reuse)
    if run.client._target.local:
        _guest_image(run)
    _engine(run)

    # --- Prepare one warm baseline --------------------------------------------------
    if base_exists:
        _reuse_base(run)
    else:
        _new_base(run)
    _install_packages(run)
    _warm_up(run, files / "warm_up.py")
    # The rollout script goes in before the pool is sized: a change to the baseline
    # (an upload too) discards its standby forks.
    run.client.machines.files.upload(BASE, f"{GUEST_HOME}/rollout.py",
                                     (files / "rollout.py").read_text())
    _warm_forks(run)

    # --- Fork per rollout: the spec's code ------------------------------------------
    rollout = _Rollout(run.client)
    batch = _parallel_rollouts(run, rollout)

    # --- Verify reproducibility -----------------------------------------------------
    trajectory = _same_seed(run, rollout)

    # --- Reset between episodes: checkpoint -----------------------------------------
    _checkpoint_reset(run)

    # --- A baseline that outlives the machine: snapshot -----------------------------
    _snapshot_round_trip(run, reuse, trajectory)

    _summary(run, batch)
    run.console.print("[bold green]reproducibility check passed[/]: same starting bytes + "
                      "same seed gave the same trajectory on every fork, after a restore "
                      "and from a snapshot")


def _preflight(run: _Run, files: Path, reuse: bool) -> bool:
    """Check the example scripts are there and the demo's names are free (``rl-base``
    and the snapshot may exist with ``reuse``); whether ``rl-base`` exists."""
    client = run.client
    with run.step("preflight") as d:
        for f in (files / "warm_up.py", files / "rollout.py"):
            if not f.is_file():
                raise DemoFailed("preflight", f"{f} not found (set ${EXAMPLES_ENV})")
        base_exists = _exists(lambda: client.machines.get(BASE))
        if base_exists and not reuse:
            raise DemoFailed("preflight", f"a machine named {BASE!r} already exists: delete "
                             f"it (`boxd machine delete {BASE}`) or pass --reuse")
        for name in (RESTORED, "check-a", "check-b", "episode-box",
                     *(f"rollout-{s}" for s in range(ROLLOUTS))):
            if _exists(lambda n=name: client.machines.get(n)):  # type: ignore[misc]
                raise DemoFailed("preflight", f"a machine named {name!r} already exists; "
                                 f"delete it (`boxd machine delete {name}`)")
        run.names_checked = True
        snap_exists = _exists(lambda: client.snapshots.get(SNAPSHOT))
        if snap_exists and not reuse:
            raise DemoFailed("preflight", f"a snapshot named {SNAPSHOT!r} already exists: "
                             f"delete it (`boxd snapshots delete {SNAPSHOT}`) or pass --reuse")
        d.append(f"{files.relative_to(Path.cwd()) if files.is_relative_to(Path.cwd()) else files}")
    return base_exists


def _guest_image(run: _Run) -> None:
    """Build the guest image if it is not cached (a local daemon's; a remote daemon
    builds its own)."""
    with run.step("guest image") as d:
        from boxd.config import Paths, Settings
        from boxd.images import Recipe, ensure_image

        img = ensure_image(Paths.default(), Recipe.for_machines(Settings.from_env()),
                           progress=run.update)  # a bar on first build
        d.append(f"{img.key}, kernel {img.kernel_version}")


def _engine(run: _Run) -> None:
    """Which engine the daemon picked, and why."""
    with run.step("engine") as d:
        info = run.client.info()
        run.engine, run.engine_reason = info.engine, info.engine_reason or ""
        d.append(f"{info.engine}: {info.engine_reason}" if info.engine_reason
                 else f"{info.engine} (BOXD_ENGINE)")


def _reuse_base(run: _Run) -> None:
    """``--reuse``: wait for the existing ``rl-base``."""
    with run.step(f"reuse {BASE}") as d:
        m = run.client.machines.wait_until_ready(BASE, timeout=300)
        run.accel, run.engine = str(m.accelerator).upper(), m.engine or "?"
        d.append(f"{m.id}, {m.engine}, {m.accelerator}")


def _new_base(run: _Run) -> None:
    """``boxd machine new rl-base``, until it is ready."""
    client = run.client
    with run.step(f"boxd machine new {BASE}") as d:
        m = client.machines.new(BASE)
        run.made_machines.append(m.id)
        m = client.machines.wait_until_ready(m.id, timeout=600)
        run.accel, run.engine = str(m.accelerator).upper(), m.engine or "?"
        d.append(f"{m.id}, {m.engine}, {str(m.accelerator).upper()}")


def _install_packages(run: _Run) -> None:
    """``pip install gymnasium numpy`` in ``rl-base``, through the guest's network."""
    with run.step("pip install gymnasium numpy (guest network)") as d:
        stdout = _pip_install(run, "pip install gymnasium numpy")
        got = dict(re.findall(r"\b(gymnasium|numpy)-(\d[\w.]*\w)", stdout))
        d.append(", ".join(f"{n} {v}" for n, v in sorted(got.items())) or "already installed")


def _warm_up(run: _Run, warm_up_src: Path) -> None:
    """Upload and run ``warm_up.py`` (it leaves a warm worker in ``rl-base``)."""
    client = run.client
    with run.step("python3 warm_up.py") as d:
        client.machines.files.upload(BASE, f"{GUEST_HOME}/warm_up.py", warm_up_src.read_text())
        said = _exec_ok(client, BASE, "python3 warm_up.py", timeout=600).strip()
        m_imp = re.search(r"imports ([0-9.]+s)", said)
        d.append(f"worker warm, imports took {m_imp.group(1)} in the guest" if m_imp
                 else said[:80])


def _warm_forks(run: _Run) -> None:
    """``machines.warm("rl-base", forks=8)``: standby forks, ready before the first
    batch."""
    with run.step(f"boxd machine warm {BASE} --forks {ROLLOUTS}") as d:
        standby = run.client.machines.warm(BASE, forks=ROLLOUTS)
        d.append(f"{standby.forks} standby forks ready, "
                 f"{standby.memory_bytes / 2**20:.0f} MiB host memory, no CPU while waiting")


class _Rollout:
    """The spec's ``rollout(name, seed)``, timing each fork's way to ready and its
    episode (by fork name)."""

    def __init__(self, client: Boxd) -> None:
        self.client = client
        self.fork_ready: dict[str, float] = {}
        self.exec_time: dict[str, float] = {}

    def __call__(self, name: str, seed: int) -> str:
        client = self.client
        t0 = time.monotonic()
        fork = client.machines.fork(BASE, name)
        client.machines.wait_until_ready(fork.id)
        self.fork_ready[name] = time.monotonic() - t0
        t1 = time.monotonic()
        result = client.machines.exec(
            fork.id, f"python3 {GUEST_HOME}/rollout.py --seed {seed}"
        )
        self.exec_time[name] = time.monotonic() - t1
        client.machines.delete(fork.id)
        if result.exit_code != 0:
            raise RuntimeError(f"rollout {name} exited {result.exit_code}: "
                               f"{result.stderr.strip()[-300:]}")
        return result.stdout.strip()


@dataclass
class _Batch:
    """The parallel rollouts, in seed order: their trajectory records and timings."""

    records: list[dict[str, Any]]
    ready: list[float]  # fork→ready, seconds
    execs: list[float]  # the episode's exec, seconds
    wall: float  # the whole batch, seconds


def _parallel_rollouts(run: _Run, rollout: _Rollout) -> _Batch:
    """The spec's ``ThreadPoolExecutor`` loop: 8 forks, one seeded episode each."""
    with run.step(f"{ROLLOUTS} forked rollouts in parallel") as d:
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda s: rollout(f"rollout-{s}", seed=s), range(ROLLOUTS)))
        wall = time.monotonic() - start
        records = [_record(r) for r in results]
        ready = [rollout.fork_ready[f"rollout-{s}"] for s in range(ROLLOUTS)]
        d.append(f"fork→ready median {statistics.median(ready):.2f}s")
    execs = [rollout.exec_time[f"rollout-{s}"] for s in range(ROLLOUTS)]
    return _Batch(records, ready, execs, wall)


def _same_seed(run: _Run, rollout: _Rollout) -> str:
    """The spec's reproducibility check: two forks with seed 42 give the same bytes;
    that trajectory."""
    with run.step("same seed → same trajectory (check-a, check-b)") as d:
        a = rollout("check-a", seed=42)
        b = rollout("check-b", seed=42)
        if a != b:
            raise RuntimeError(f"seed 42 differed between forks:\n  {a}\n  {b}")
        rec42 = _record(a)
        d.append(f"identical ({rec42['sha256'][:12]}…)")
    return a


def _checkpoint_reset(run: _Run) -> None:
    """On a fork: save ``episode-start``, run an episode that writes a file, restore;
    the file is gone and the next episode is identical."""
    client = run.client
    with run.step("checkpoint reset between episodes") as d:
        box = client.machines.fork(BASE, "episode-box")
        run.made_machines.append(box.id)
        client.machines.wait_until_ready(box.id)
        client.machines.checkpoints.save(box.id, "episode-start")
        episode = (f"python3 {GUEST_HOME}/rollout.py --seed 7 > {GUEST_HOME}/episode.json"
                   f" && cat {GUEST_HOME}/episode.json")
        first = _exec_ok(client, box.id, episode).strip()
        seen = _exec_ok(client, box.id, f"ls {GUEST_HOME}/episode.json").strip()
        client.machines.checkpoints.restore(box.id, "episode-start")
        gone = client.machines.exec(box.id, f"test -e {GUEST_HOME}/episode.json")
        if gone.exit_code == 0:
            raise RuntimeError("episode.json still exists after restore")
        second = _exec_ok(client, box.id, episode).strip()
        if first != second:
            raise RuntimeError(f"episode after restore differs:\n  {first}\n  {second}")
        client.machines.delete(box.id)
        run.made_machines.remove(box.id)
        d.append(f"{Path(seen).name} gone after restore; replay identical")


def _snapshot_round_trip(run: _Run, reuse: bool, trajectory: str) -> None:
    """Save ``rl-base`` as snapshot ``env-v3`` (a new version with ``reuse``), make
    ``rl-base-2`` from it; seed 42 there must give the forks' ``trajectory``."""
    client = run.client
    with run.step(f"snapshot {SNAPSHOT} → {RESTORED}") as d:
        snap = client.snapshots.save(BASE, SNAPSHOT, new_version=reuse)
        run.made_snapshot = f"{snap.name}@{snap.version}"
        m2 = client.machines.new(RESTORED, from_snapshot=run.made_snapshot)
        run.made_machines.append(m2.id)
        client.machines.wait_until_ready(m2.id, timeout=600)
        again = _exec_ok(client, m2.id, f"python3 {GUEST_HOME}/rollout.py --seed 42").strip()
        if again != trajectory:
            raise RuntimeError(f"seed 42 on {RESTORED} differs from the forks:\n  "
                               f"{trajectory}\n  {again}")
        d.append(f"{run.made_snapshot}; seed 42 identical")


def _summary(run: _Run, batch: _Batch) -> None:
    """The rollouts table, the steps table and the one-line result."""
    out = run.console
    records, ready, execs, wall = batch.records, batch.ready, batch.execs, batch.wall
    rt = Table(title=f"{ROLLOUTS} rollouts, one fork each (in parallel)", title_justify="left")
    for col in ("seed", "steps", "reward", "trajectory sha256", "fork→ready", "exec"):
        rt.add_column(col, justify="right" if col != "trajectory sha256" else "left")
    for rec, r, e in zip(records, ready, execs, strict=True):
        rt.add_row(str(rec["seed"]), str(rec["steps"]), f"{rec['reward']:.0f}",
                   rec["sha256"][:16] + "…", f"{r:.2f}s", f"{e:.2f}s")
    out.print(rt)
    st = Table(title="summary", title_justify="left")
    st.add_column("step")
    st.add_column("time", justify="right")
    st.add_column("detail", overflow="fold")
    for title, took, text in run.steps:
        st.add_row(title, f"{took:.2f}s", text)
    out.print(st)
    out.print(f"[bold]{ROLLOUTS} isolated rollouts in {wall:.1f}s[/] (fork→ready median "
              f"{statistics.median(ready):.2f}s, {run.engine}, {run.accel}); seed 42 gave the "
              f"same trajectory on two forks.")
    if run.engine_reason:
        out.print(f"[dim]engine {run.engine}: {run.engine_reason}[/]")


def _cleanup(run: _Run) -> None:
    client, out = run.client, run.console
    # A rollout that failed half-way may have left its fork (the spec's loop deletes only
    # on success); the preflight checked that none of these names existed before.
    ours = {"check-a", "check-b", "episode-box", *(f"rollout-{s}" for s in range(ROLLOUTS))}
    try:
        if run.names_checked:
            run.made_machines += [m.id for m in client.machines.list()
                                  if m.name in ours and m.id not in run.made_machines]
    except errors.BoxdError:
        pass
    for mid in reversed(run.made_machines):
        try:
            client.machines.delete(mid)
        except errors.NotFound:
            pass
        except errors.BoxdError as exc:
            out.print(f"[yellow]warning:[/] could not delete machine {mid}: {exc}")
    if run.made_snapshot is not None:
        try:
            client.snapshots.delete(run.made_snapshot)
        except errors.NotFound:
            pass
        except errors.BoxdError as exc:
            out.print(f"[yellow]warning:[/] could not delete snapshot {run.made_snapshot}: {exc}")
    if run.made_machines or run.made_snapshot:
        out.print(f"[dim]cleaned up {len(run.made_machines)} machine(s)"
                  f"{' and snapshot ' + run.made_snapshot if run.made_snapshot else ''}[/]")
