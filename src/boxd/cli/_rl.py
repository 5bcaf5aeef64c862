"""``boxd rl``: the reproducibility verifier on the command line (needs ``boxd[rl]``)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import click

from boxd import errors
from boxd.cli import _render

__all__ = ["rl"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def rl() -> None:
    """Reinforcement-learning tools (boxd.rl)."""


@rl.command("verify")
@click.argument("source")
@click.argument("env")
@click.option("--seed", type=int, default=42, show_default=True, help="Reset and policy seed.")
@click.option("--steps", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--runs", type=click.IntRange(min=2), default=2, show_default=True,
              help="Fresh forks to compare.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def verify(state: Any, source: str, env: str, seed: int, steps: int, runs: int,
           as_json: bool) -> None:
    """Run ENV in fresh forks of SOURCE with one seed and compare them step by step.

    ENV is a Gymnasium id (CartPole-v1) or module:function importable in the machine
    (installed there, or under /home/boxd). Exits 1 when the runs diverge.
    """
    try:
        from boxd import rl as boxd_rl
    except ImportError as exc:
        raise errors.HostSetupError(
            f"boxd rl needs gymnasium and cloudpickle ({exc.name} is missing)",
            hint="pip install 'boxd[rl]'") from exc
    with _render.activity(f"running {env} in {runs} forks of {source}", as_json=as_json):
        report = boxd_rl.verify(source, env, seed=seed, steps=steps, runs=runs,
                                boxd=state.boxd)
    if as_json:
        out = dataclasses.asdict(report)
        if out["first_divergence"] is not None:  # numpy values: their repr, for JSON
            out["first_divergence"]["values"] = [repr(v) for v in
                                                 out["first_divergence"]["values"]]
        _render.print_json(out)
    else:
        _render.details(report.rows())
    if not report.identical:
        sys.exit(1)
