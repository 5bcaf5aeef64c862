"""A reproducibility report as one standalone HTML page (``boxd rl verify --html``), from
real reports of local env servers (tests/integration/test_report_html.py draws it in
Chromium)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tests._support import leaky_envs
from tests._support import sdk_daemon as support

import boxd.rl as rl
from boxd.api.server import Daemon
from boxd.cli import main as cli
from boxd.console.report import CHART_JS, report_html

daemon = support.daemon  # fixtures
paths = support.paths


@pytest.fixture(scope="module")
def leaky() -> rl.SweepReport:
    """Three seeds whose runs diverge at step 7 (the env reads the kernel RNG)."""
    return rl.verify(rl.local(), functools.partial(leaky_envs.UrandomEnv, reads_at=7),
                     seeds=range(3), steps=10, pickle_by_value=[leaky_envs])


def sweep_json(report: rl.SweepReport) -> dict[str, Any]:
    data = report.to_json()
    data["causes"] = [list(c) for c in report.causes]
    return data


def test_the_page_stands_alone_with_its_data_and_chart_library(
        leaky: rl.SweepReport) -> None:
    page = report_html(sweep_json(leaky))
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)  # nothing fetched
    assert "Chart.js v4" in page and CHART_JS.stat().st_size > 100_000
    assert "sourceMappingURL" not in page
    assert "3 of 3 seeds diverge" in page
    assert "the env reads the kernel RNG" in page
    assert "step 7, " in page  # each diverged seed's first divergence
    for caption in ("Likely causes", "Diverged seeds", "Summary"):
        assert f"<caption>{caption}" in page


def test_a_report_cannot_close_its_script_or_inject_markup(leaky: rl.SweepReport) -> None:
    data = sweep_json(leaky)
    data["env"] = "</script><script>alert(1)</script><b>x</b>"
    page = report_html(data)
    assert "<script>alert(1)" not in page
    assert "<b>x</b>" not in page
    assert "&lt;/script&gt;" in page  # shown as text in the tables


def test_a_clean_sweep_says_so(tmp_path: Path) -> None:
    clean = rl.verify(rl.local(), "CartPole-v1", seeds=range(2), steps=20)
    page = report_html(sweep_json(clean))
    assert "Every seed&#x27;s runs are identical." in page or \
        "Every seed's runs are identical." in page


def test_cli_html_writes_the_page(daemon: Daemon, leaky: rl.SweepReport, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rl, "verify", lambda *a, **k: leaky)
    out = tmp_path / "report.html"
    r = CliRunner().invoke(cli, ["rl", "verify", "m", "CartPole-v1", "--seeds", "0:3",
                                 "--html", str(out)], catch_exceptions=False)
    assert r.exit_code == 1  # the seeds diverge
    assert f"report: {out}" in r.stderr
    assert "3 of 3 seeds diverge" in out.read_text()


def test_cli_html_of_one_seed(daemon: Daemon, leaky: rl.SweepReport, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rl, "verify", lambda *a, **k: leaky.pairs[0])
    out = tmp_path / "one.html"
    r = CliRunner().invoke(cli, ["rl", "verify", "m", "CartPole-v1", "--seed", "0",
                                 "--html", str(out)], catch_exceptions=False)
    assert r.exit_code == 1
    page = out.read_text()
    assert "1 of 1 seeds diverge" in page and "step 7, " in page
