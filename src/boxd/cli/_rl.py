"""``boxd rl``: the reproducibility verifier on the command line (needs ``boxd[rl]``)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from boxd import errors, models
from boxd.cli import _render

__all__ = ["rl"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def rl() -> None:
    """Reinforcement-learning tools (boxd.rl)."""


#: boxd.rl's SEED_LIMIT (checked equal by tests/unit/test_rl_verify_sweep.py): this
#: module must not import gymnasium before it knows boxd[rl] is installed.
SEED_LIMIT = 2**32
SEEDS_FORM = "give START:STOP, both ints, STOP excluded (e.g. 0:1000)"


def _seed_range(ctx: click.Context, param: click.Parameter, value: str | None) -> range | None:
    """``--seeds START:STOP`` as a range, checked whole before anything is made: an
    open range (``0:``, ``:5``, ``:``) or a lone seed is a usage error, as are seeds
    outside 0 to 2**32 - 1."""
    if value is None:
        return None
    lo, colon, hi = value.partition(":")
    try:
        if not colon:
            raise ValueError
        start, stop = int(lo), int(hi)
    except ValueError:
        hint = f" (one seed: --seed {lo.strip()})" if not colon and lo.strip().isdecimal() else ""
        raise click.BadParameter(f"{value!r}: {SEEDS_FORM}{hint}") from None
    if start < 0 or stop > SEED_LIMIT:
        raise click.BadParameter(
            f"{value}: seeds are 0 to {SEED_LIMIT - 1} (so START >= 0 and STOP <= "
            f"{SEED_LIMIT}): Gymnasium refuses a negative seed, and numpy's legacy seeding "
            "(np.random.seed), which many envs call with it, takes only 0 to 2**32 - 1")
    if stop <= start:
        raise click.BadParameter(f"{value} holds no seed: STOP must be above START")
    return range(start, stop)


def _csv(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise click.BadParameter("give one name or more, comma-separated")
    return items


@rl.command("verify")
@click.argument("source")
@click.argument("env")
@click.option("--seed", type=click.IntRange(0, SEED_LIMIT - 1), default=None,
              help="Reset and policy seed (one pair), 0 to 2**32 - 1. [default: 42]")
@click.option("--seeds", callback=_seed_range, metavar="START:STOP",
              help="Many seeds, one pair each (STOP excluded), e.g. 0:1000; seeds are 0 "
              "to 2**32 - 1. The seeds are drawn as pairs start: a long sweep's memory "
              "stays bounded.")
@click.option("--steps", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--runs", type=click.IntRange(min=2), default=2, show_default=True,
              help="Fresh forks to compare per seed.")
@click.option("--jobs", type=click.IntRange(min=1), default=4, show_default=True,
              help="Seeds verified at once (jobs x runs forks together).")
@click.option("--engines", callback=_csv, metavar="E1,E2",
              help="A seed's runs alternate between these engines: each engine's baseline "
              "is SOURCE if it runs there, else the machine SOURCE-ENGINE, prepared from "
              "the same recipe (a snapshot cannot move between engines).")
@click.option("--nodes", callback=_csv, metavar="all|ID,ID",
              help="Spread a seed's runs over these cluster nodes (all: every alive node; "
              "`boxd nodes list`), one node per run.")
@click.option("--template", is_flag=True, help="Fork every run from a template in which "
              "the env was built once (per source and node): no env build per run, but "
              "what the env's constructor reads outside its seed goes unseen.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts (the schema: "
              "--schema).")
@click.option("--schema", is_flag=True, help="Print the JSON Schema of the --seeds --json "
              "report and exit.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False, writable=True,
              path_type=Path), metavar="FILE",
              help="Also write the report as one standalone HTML page with its charts "
              "(opens offline: to attach to a paper or an issue).")
@click.option("--save", "save_name", metavar="NAME",
              help="Also keep the report in the daemon under NAME (replacing one of that "
              "name): `boxd console` lists and draws it.")
@click.pass_obj
def verify(state: Any, source: str, env: str, seed: int | None, seeds: range | None,
           steps: int, runs: int, jobs: int, engines: list[str] | None,
           nodes: list[str] | None, template: bool, as_json: bool, schema: bool,
           html_file: Path | None, save_name: str | None) -> None:
    """Run ENV in fresh forks of SOURCE, seed by seed, and compare them step by step.

    ENV is a Gymnasium id (CartPole-v1) or module:function importable in the machine
    (installed there, or under /home/boxd). SOURCE is a machine, or several
    comma-separated (a seed's runs alternate between them: e.g. one baseline per
    engine; --engines finds those by name). Exits 0 when every seed's runs are
    identical, 1 otherwise.
    """
    if schema:
        from boxd.rl._verify import REPORT_SCHEMA

        _render.print_json(REPORT_SCHEMA)
        return
    if seed is not None and seeds is not None:
        raise click.UsageError("give --seed or --seeds, not both")
    if save_name is not None and not models.NAME_RE.match(save_name):
        raise click.BadParameter(models.NAME_RULE, param_hint="--save")
    try:
        from boxd import rl as boxd_rl
    except ImportError as exc:
        raise errors.HostSetupError(
            f"boxd rl needs gymnasium and cloudpickle ({exc.name} is missing)",
            hint="pip install 'boxd[rl]'") from exc
    sources: str | list[str] = source.split(",") if "," in source else source
    if engines is not None:
        sources = _engine_sources(state.boxd, source, engines)
    where: dict[str, Any] = {"template": template} if nodes is None else {
        "placement": "spread", "nodes": None if nodes == ["all"] else nodes,
        "template": template}
    # Its machines carry this run's labels; SIGTERM or SIGINT deletes them by label
    # before the process ends (docs/rl.md, "Cleanup after a crash").
    from boxd.rl._cleanup import delete_on_signals, run_labels

    where["labels"] = run_labels("verify")
    click.get_current_context().with_resource(delete_on_signals(state.boxd, where["labels"]))
    if seeds is not None:
        _sweep(state, sources, env, seeds, steps, runs, jobs, as_json, boxd_rl, where,
               (html_file, save_name))
        return
    with _render.activity(f"running {env} in {runs} forks of {source}", as_json=as_json):
        report = boxd_rl.verify(sources, env, seed=42 if seed is None else seed,
                                steps=steps, runs=runs, boxd=state.boxd, **where)
    if as_json:
        out = dataclasses.asdict(report)
        if out["first_divergence"] is not None:  # numpy values: their repr, for JSON
            out["first_divergence"]["values"] = [repr(v) for v in
                                                 out["first_divergence"]["values"]]
        _render.print_json(out)
    else:
        _render.details(report.rows())
    _keep(state, _single_json(report, sources), html_file, save_name)
    if not report.identical:
        sys.exit(1)


def _single_json(report: Any, sources: str | list[str]) -> dict[str, Any]:
    """A one-seed report in the sweep report's shape (what the HTML page draws)."""
    return {
        "format": 1, "identical": report.identical, "env": report.env,
        "steps": report.steps, "runs": report.runs,
        "sources": sources if isinstance(sources, list) else [sources],
        "placement": "spread" if report.nodes else "same-node",
        "nodes": sorted(set(report.nodes)), "seeds": 1, "distinct": 1,
        "distinct_exact": True, "wall_s": 0.0, "diverged": 0 if report.identical else 1,
        "pairs_complete": True, "pairs": [report.to_json()],
    }


def _keep(state: Any, data: dict[str, Any], html_file: Path | None,
          save_name: str | None) -> None:
    """Write the report's HTML page (--html) and keep it in the daemon (--save)."""
    if html_file is not None:
        from boxd.console.report import report_html

        try:
            html_file.write_text(report_html(data), encoding="utf-8")
        except OSError as exc:
            raise errors.InvalidRequest(f"cannot write {html_file}: {exc.strerror}",
                                        field="html") from exc
        click.echo(f"report: {html_file}", err=True)
    if save_name is not None:
        saved = state.boxd.reports.save(save_name, data)
        click.echo(f"report saved as {saved.name} (boxd console: Reports)", err=True)


def _engine_sources(boxd: Any, source: str, engines: list[str]) -> list[str]:
    """One baseline per engine: SOURCE where it runs, else the machine SOURCE-ENGINE."""
    if "," in source:
        raise click.UsageError("give one SOURCE with --engines (it finds SOURCE-ENGINE)")
    base = boxd.machines.get(source)
    out = []
    for engine in engines:
        if base.engine == engine:
            out.append(base.name)
            continue
        name = f"{base.name}-{engine}"
        try:
            m = boxd.machines.get(name)
        except errors.MachineNotFound:
            raise errors.MachineNotFound(
                f"no {engine} baseline for {base.name}: --engines looks for {name}",
                hint=f"prepare it from {base.name}'s recipe: `boxd machine new {name} "
                f"--engine {engine}`, then the same set-up (a snapshot cannot move "
                "between engines)", machine=name) from None
        if m.engine != engine:
            raise errors.InvalidRequest(f"{name} runs on {m.engine}, not {engine}",
                                        hint=f"make {name} with --engine {engine}",
                                        field="engines")
        out.append(m.name)
    return out


def _sweep(state: Any, sources: str | list[str], env: str, seeds: range, steps: int,
           runs: int, jobs: int, as_json: bool, boxd_rl: Any, where: dict[str, Any],
           keep: tuple[Path | None, str | None] = (None, None)) -> None:
    with _render.progress(f"verifying {env}: {len(seeds)} seeds x {runs} forks",
                          total=len(seeds), as_json=as_json) as advance:
        report = boxd_rl.verify(sources, env, seeds=seeds, steps=steps, runs=runs,
                                jobs=jobs, boxd=state.boxd,
                                progress=lambda r: advance(not r.identical), **where)
    if as_json:
        _render.print_json(report.to_json())
    else:
        bad = report.diverged
        if bad:
            _render.table(
                ["seed", "first divergence", "likely cause"],
                [(str(p.seed),
                  f"step {p.first_divergence.step}, {p.first_divergence.field}"
                  if p.first_divergence else "", p.likely_cause or "")
                 for p in bad[:20]], empty="")
            more = report.diverged_seeds - min(len(bad), 20)
            if more > 0:
                kept = "all" if report.pairs_complete else f"the first {len(bad)}"
                _render.console().print(f"... and {more} more seeds (--json: {kept})")
        _render.details(report.rows())
    data = report.to_json()
    data["causes"] = [list(c) for c in report.causes]
    _keep(state, data, *keep)
    if not report.identical:
        sys.exit(1)
