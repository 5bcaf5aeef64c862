"""docs/reproducibility.md is written by bench/reproducibility.py section by section: a
one-host run and a Ray run each replace only their own part."""

from __future__ import annotations

from pathlib import Path

from tests._support.bench import load

repro = load("reproducibility")
DOC = Path(__file__).resolve().parents[2] / "docs" / "reproducibility.md"


def test_a_run_replaces_its_own_section_and_keeps_the_other(tmp_path: Path) -> None:
    doc = tmp_path / "r.md"
    row = ["CartPole-v1", "fork", "qemu", "5", "5", "5", "-", "-", "9"]
    repro._write(doc, "host", repro._section("host", "## One host", [row]))
    assert doc.read_text().startswith(repro.TITLE)
    repro._write(doc, "ray", repro._section("ray", "## Across Ray nodes",
                                            [[*row[:1], "spread over 3 nodes", *row[2:]]]))
    repro._write(doc, "host", repro._section("host", "## One host", [[*row[:3], "7", "7",
                                                                        "7", "-", "-", "8"]]))
    text = doc.read_text()
    assert text.count("<!-- repro:host ") == text.count("<!-- /repro:host -->") == 1
    assert "| CartPole-v1 | fork | qemu | 7 | 7 | 7 |" in text
    assert "| CartPole-v1 | fork | qemu | 5 |" not in text
    assert "spread over 3 nodes" in text
    assert text.index("repro:host") < text.index("repro:ray")  # order kept


def test_the_committed_report_has_the_host_section_the_bench_writes() -> None:
    text = DOC.read_text()
    assert text.startswith(repro.TITLE)
    head = "| " + " | ".join(repro.HEAD) + " |"
    host = text.split("<!-- repro:host ", 1)[1].split("<!-- /repro:host -->", 1)[0]
    assert head in host and host.count("\n| ") >= 10
