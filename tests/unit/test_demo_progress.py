"""``boxd demo``'s steps: a live line (and a bar, when the work says how far it is) on a
terminal, only the ✓ summary lines otherwise. Against a real daemon over the fakes."""

from __future__ import annotations

import io
import re

from rich.console import Console
from tests._support import sdk_daemon as support

from boxd import Boxd
from boxd.api.server import Daemon
from boxd.demo import BASE, _pip_install, _Run

daemon = support.daemon  # fixtures
paths = support.paths


def demo_run(client: Boxd, terminal: bool) -> tuple[_Run, io.StringIO]:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=terminal, width=120, highlight=False)
    return _Run(console=console, client=client), buf


def test_step_shows_updates_and_a_bar_on_a_terminal(daemon: Daemon) -> None:
    with Boxd() as b:
        b.machines.new(BASE)
        run, buf = demo_run(b, terminal=True)
        with run.step("guest image") as d:
            run.update("mmdebstrap bookworm (about a minute)", 0.2)
            run.update("configure rootfs", 0.85)
            d.append("built")
        with run.step("pip install gymnasium numpy (guest network)"):
            out = _pip_install(run, "pip install gymnasium numpy")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())  # no colours
    assert "pip install gymnasium numpy 0" in out  # the fake echoes command and status
    assert "guest image: mmdebstrap bookworm" in text or "guest image: configure" in text
    assert "━" in text  # the bar once a fraction is known
    assert "✓ guest image" in text and "✓ pip install gymnasium numpy" in text
    assert run._bar is None  # no step running: update() is a no-op
    run.update("ignored", 0.5)


def test_no_live_progress_when_not_a_terminal(daemon: Daemon) -> None:
    with Boxd() as b:
        b.machines.new(BASE)
        run, buf = demo_run(b, terminal=False)
        with run.step("guest image"):
            run.update("mmdebstrap bookworm (about a minute)", 0.2)
        with run.step("pip install gymnasium numpy (guest network)"):
            _pip_install(run, "pip install gymnasium numpy")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith("✓ ") for line in lines), lines
    assert "mmdebstrap" not in buf.getvalue() and "━" not in buf.getvalue()
