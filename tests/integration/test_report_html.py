"""``boxd rl verify --html``'s page in Chromium: it draws its charts from its own
inlined data, offline (a file:// page), without a console error. The report comes from
real runs on local env servers (no machines: tests/unit/test_console_report.py shows
the CLI writes the same page)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import boxd.rl as rl
from boxd.console.report import report_html
from tests._support import leaky_envs
from tests._support.browser import Shots, chromium


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from chromium()


def test_a_saved_report_draws_its_plots(browser: Any, tmp_path: Path,
                                        request: pytest.FixtureRequest) -> None:
    report = rl.verify(rl.local(), functools.partial(leaky_envs.UrandomEnv, reads_at=7),
                       seeds=range(4), steps=12, pickle_by_value=[leaky_envs])
    data = report.to_json()
    data["causes"] = [list(c) for c in report.causes]
    path = tmp_path / "report.html"
    path.write_text(report_html(data))

    errors: list[str] = []
    ctx = browser.new_context(viewport={"width": 1300, "height": 900})
    try:
        ctx.route("**/*", lambda route: route.abort()
                  if not route.request.url.startswith("file://") else route.continue_())
        page = ctx.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=15_000)
        charts = page.evaluate("""() => Object.fromEntries(Object.entries(window.boxdCharts)
            .map(([k, c]) => [k, c.data.datasets.map(d => d.data)]))""")
        assert charts["pairs"] == [[0, 4]]  # identical, diverged
        histogram = charts["steps"][0]
        assert sum(histogram) == 4 and max(histogram) == 4  # all in the bin of step 7
        strip = charts["seeds"][0]
        assert sorted(p["x"] for p in strip) == [0, 1, 2, 3]
        assert {p["y"] for p in strip} == {7}
        # The canvases were drawn on (not blank).
        drawn = page.evaluate("""() => [...document.querySelectorAll('canvas')].map(c => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })""")
        assert len(drawn) == 3 and all(n > 500 for n in drawn), drawn
        labelled = page.evaluate("""() => [...document.querySelectorAll('canvas')]
            .every(c => c.getAttribute('role') === 'img' &&
                        document.getElementById(c.getAttribute('aria-labelledby')))""")
        assert labelled
        Shots(request.node.nodeid)(page, "report")
    finally:
        ctx.close()
    assert errors == []
