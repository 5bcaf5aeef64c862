"""Saved reproducibility reports: ``/v1/reports`` through the SDK and the CLI against a
real daemon over fake services; the console lists and shows them (the browser draws
them in tests/integration/test_console.py)."""

from __future__ import annotations

import asyncio
import functools
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from tests._support import leaky_envs
from tests._support import sdk_daemon as support

import boxd.rl as rl
from boxd import AsyncBoxd, Boxd, errors
from boxd.api.server import Daemon
from boxd.cli import main as cli
from boxd.console.login import login_url, url_file

daemon = support.daemon  # fixtures
paths = support.paths


@pytest.fixture(scope="module")
def sweep() -> rl.SweepReport:
    return rl.verify(rl.local(), functools.partial(leaky_envs.UrandomEnv, reads_at=5),
                     seeds=range(2), steps=8, pickle_by_value=[leaky_envs])


@pytest.fixture(scope="module")
def data(sweep: rl.SweepReport) -> dict[str, Any]:
    report = sweep
    out = report.to_json()
    out["causes"] = [list(c) for c in report.causes]
    return out


def test_save_list_get_delete(daemon: Daemon, data: dict[str, Any]) -> None:
    with Boxd() as b:
        saved = b.reports.save("leaky", data)
        assert (saved.name, saved.identical, saved.seeds, saved.diverged) == \
            ("leaky", False, 2, 2)
        assert [r.name for r in b.reports.list()] == ["leaky"]
        whole = b.reports.get("leaky")
        assert whole.report == data and whole.env == data["env"]
        b.reports.save("leaky", {**data, "env": "again"})  # a name saved again: replaced
        assert b.reports.get("leaky").env == "again"
        b.reports.delete("leaky")
        assert b.reports.list() == []
        with pytest.raises(errors.NotFound):
            b.reports.get("leaky")
        with pytest.raises(errors.NotFound):
            b.reports.delete("leaky")


def test_reports_are_private_files_of_their_account(daemon: Daemon,
                                                   data: dict[str, Any]) -> None:
    with Boxd() as b:
        b.reports.save("mine", data)
        key = b.keys.create("other", account="other").secret
    with Boxd(api_key=key) as other:
        assert other.reports.list() == []
        with pytest.raises(errors.NotFound):
            other.reports.get("mine")
        with pytest.raises(errors.NotFound):
            other.reports.delete("mine")
    [path] = (daemon.paths.home / "reports").glob("*/mine.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # The reports folder too: it was 0755 (mkdir's parents), listable by every local
    # user (test_file_access found it on the whole suite's daemon).
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize(("name", "report", "why"), [
    ("Bad_Name", None, "name"),
    ("../x", None, "name"),
    ("ok", {"env": "x"}, "identical"),
    ("ok", "not-an-object", "report"),
])
def test_bad_names_and_reports_are_400(daemon: Daemon, data: dict[str, Any], name: str,
                                       report: Any, why: str) -> None:
    with Boxd() as b, pytest.raises(errors.InvalidRequest, match=why):
        b.reports.save(name, data if report is None else report)


def test_a_name_no_report_can_have_is_not_found_not_a_bad_request(daemon: Daemon) -> None:
    # Found by the API fuzz: GET /v1/reports/{name} answered 400 for a name outside the
    # rule; a path names an existing report, so it is the 404 of an unknown one.
    with Boxd() as b:
        for name in ("Bad_Name", ">l\u00b9", "x" * 80):
            with pytest.raises(errors.NotFound):
                b.reports.get(name)
            with pytest.raises(errors.NotFound):
                b.reports.delete(name)


def test_the_async_client_saves_too(daemon: Daemon, data: dict[str, Any]) -> None:
    async def go() -> list[str]:
        async with AsyncBoxd() as b:
            await b.reports.save("async-one", data)
            return [r.name for r in await b.reports.list()]

    assert asyncio.run(go()) == ["async-one"]


def test_cli_save_then_the_console_shows_it(daemon: Daemon, sweep: rl.SweepReport,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rl, "verify", lambda *a, **k: sweep)
    r = CliRunner().invoke(cli, ["rl", "verify", "m", "CartPole-v1", "--seeds", "0:2",
                                 "--save", "from-cli"], catch_exceptions=False)
    assert r.exit_code == 1, r.output  # the seeds diverge
    assert "report saved as from-cli" in r.stderr
    bad = CliRunner().invoke(cli, ["rl", "verify", "m", "CartPole-v1", "--save", "No!"])
    assert bad.exit_code == 2  # refused before anything runs
    key = (daemon.paths.home / "local.key").read_text().strip()
    url = login_url(url_file(daemon.paths.home).read_text().strip(), key)
    with httpx.Client(follow_redirects=True) as browser:
        browser.get(url)
        base = url.split("/login?")[0]
        listing = browser.get(f"{base}/reports")
        assert listing.status_code == 200 and 'href="/reports/from-cli"' in listing.text
        page = browser.get(f"{base}/reports/from-cli")
        assert page.status_code == 200
        assert 'id="report-data"' in page.text and "chart-steps" in page.text
        assert "/static/vendor/chart.umd.min.js" in page.text
        assert browser.get(f"{base}/reports/nope").status_code == 404


def test_saved_reports_survive_a_new_store(tmp_path: Path, data: dict[str, Any]) -> None:
    from boxd import models
    from boxd.storage.reports import ReportStore

    asyncio.run(ReportStore(tmp_path).save("acct_1", models.ReportSave(name="r", report=data)))
    again = asyncio.run(ReportStore(tmp_path).get("acct_1", "r"))
    assert again.report == data
