"""A reproducibility report (``boxd rl verify --json``'s sweep format) as one HTML file.

The file stands alone: Chart.js (vendored in ``static/vendor/``) and the report's data
are inlined, so it opens offline, attached to a paper or an issue. It draws the pairs
identical vs diverged, a histogram of the first divergent step, a per-seed strip, and
names the causes, the sources (engines) and nodes compared. Stdlib only: the CLI
imports it.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CHART_JS", "cause_kind", "report_html", "report_sections", "script_json"]

_HERE = Path(__file__).parent
#: The vendored Chart.js build (MIT; static/vendor/chart.js.LICENSE).
CHART_JS = _HERE / "static" / "vendor" / "chart.umd.min.js"
_DRAW = _HERE / "static" / "report.js"
_MAP = re.compile(r"^//# sourceMappingURL=.*$", re.M)


def cause_kind(cause: str | None) -> str:
    """A likely cause without its step: ``"... (step 7)"`` -> ``"..."``."""
    return (cause or "?").split(" (step")[0]


def _causes(report: Mapping[str, Any]) -> list[tuple[str, int]]:
    given = report.get("causes")
    if given:
        return [(str(c), int(n)) for c, n in given]
    counts: dict[str, int] = {}
    for p in report.get("pairs", []):
        if not p.get("identical"):
            kind = cause_kind(p.get("likely_cause"))
            counts[kind] = counts.get(kind, 0) + 1
    return sorted(counts.items(), key=lambda c: -c[1])


def _rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    seeds, diverged = int(report.get("seeds", 0)), int(report.get("diverged", 0))
    distinct = str(report.get("distinct", ""))
    if not report.get("distinct_exact", True):
        distinct = f"at least {distinct}"
    nodes: Sequence[str] = report.get("nodes") or []
    return [
        ("env", str(report.get("env", ""))),
        ("sources (engines) compared", ", ".join(report.get("sources") or [])),
        ("placement", str(report.get("placement", "same-node"))
         + (f" over {', '.join(nodes)}" if nodes else "")),
        ("seeds", str(seeds)),
        ("steps", str(report.get("steps", ""))),
        ("runs per seed", str(report.get("runs", ""))),
        ("identical", "yes" if report.get("identical") else
         f"NO ({diverged} of {seeds} seeds diverge)"),
        ("distinct trajectories", distinct),
        ("wall time", f"{float(report.get('wall_s', 0.0)):.1f} s"),
    ]


def _table(caption: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    e = html.escape
    th = "".join(f'<th scope="col">{e(h)}</th>' for h in head)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return (f"<table><caption>{e(caption)}</caption><thead><tr>{th}</tr></thead>"
            f"<tbody>{body}</tbody></table>")



_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #111; }
table { border-collapse: collapse; margin: .5rem 0 1.5rem; }
caption { text-align: left; font-weight: bold; padding: .25rem 0; }
th, td { border-bottom: 1px solid #d7dbe0; padding: .25rem .5rem; text-align: left; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(22rem, 1fr)); gap: 1rem; }
figure { margin: 0; } figcaption { font-weight: bold; margin-bottom: .25rem; }
.verdict-no { color: #c0392b; } .verdict-yes { color: #2e8b57; }
"""


def report_sections(report: Mapping[str, Any]) -> str:
    """The report's verdict, tables and chart canvases as HTML (escaped; no scripts):
    `report_html`'s body, and the console's report page's."""
    e = html.escape
    identical = bool(report.get("identical"))
    pairs = [p for p in report.get("pairs", []) if not p.get("identical")]
    diverged_rows = [
        (str(p.get("seed")),
         f"step {p['first_divergence']['step']}, {p['first_divergence']['field']}"
         if p.get("first_divergence") else "",
         cause_kind(p.get("likely_cause")),
         ", ".join(m for m in p.get("machines", []) if m),
         ", ".join(p.get("nodes", [])))
        for p in pairs[:200]]
    kept = "" if report.get("pairs_complete", True) else \
        " (the report kept only the diverged seeds: identical ones are not drawn)"
    return "\n".join([
        f'<p class="verdict-{"yes" if identical else "no"}">'
        + ("Every seed's runs are identical." if identical else
           f"{int(report.get('diverged', 0))} of {int(report.get('seeds', 0))} seeds "
           "diverge.") + "</p>",
        _table("Summary", ("", ""), _rows(report)),
        '<section class="charts" aria-label="Charts">',
        '<figure><figcaption id="c1">Pairs: identical vs diverged</figcaption>'
        '<canvas id="chart-pairs" role="img" aria-labelledby="c1"></canvas></figure>',
        '<figure><figcaption id="c2">First divergent step (histogram)</figcaption>'
        '<canvas id="chart-steps" role="img" aria-labelledby="c2"></canvas></figure>',
        f'<figure><figcaption id="c3">Per seed{e(kept)}</figcaption>'
        '<canvas id="chart-seeds" role="img" aria-labelledby="c3"></canvas></figure>',
        "</section>",
        _table("Likely causes (diverged seeds)", ("cause", "seeds"),
               [(c, str(n)) for c, n in _causes(report)]),
        _table("Diverged seeds" + (" (the first 200)" if len(pairs) > 200 else ""),
               ("seed", "first divergence", "likely cause", "machines", "nodes"),
               diverged_rows),
    ])


def script_json(data: Any) -> str:
    """JSON safe inside a <script> element (no ``</``, no ``<!--``)."""
    return json.dumps(data).replace("<", "\\u003c")


def report_html(report: Mapping[str, Any], title: str | None = None) -> str:
    """The standalone HTML page of a sweep report (`SweepReport.to_json`, plus its
    ``causes`` when given)."""
    e = html.escape
    title = title or f"boxd reproducibility report: {report.get('env', '')}"
    chart = _MAP.sub("", CHART_JS.read_text())
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        report_sections(report),
        f'<script type="application/json" id="report-data">{script_json(report)}</script>',
        f"<script>{chart}</script>",
        f"<script>{_DRAW.read_text()}</script>",
        "</body></html>",
    ]
    return "\n".join(parts)
