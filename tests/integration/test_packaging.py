"""The built wheel, installed as a user would: ``pip install boxd`` into a clean venv.

``python -m build`` makes the sdist and, from it, the wheel (in a temporary directory:
the checkout gets no ``build/`` or ``dist/``); the wheel goes into a new venv with the
client's dependencies only (httpx, pydantic, click, rich: pip fetches them through the
host's pip configuration). There ``boxd --version`` and ``from boxd import Boxd`` work,
and starting a daemon fails with one line naming the ``server`` extra.

    .venv/bin/pytest -m packaging
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[2]
HINT = "pip install 'boxd[server]'"


def _run(argv: list[str | Path], timeout: float = 600, **kw: object) -> str:
    # The clean venv sees only what it installed: a PYTHONPATH of the caller's (a
    # checkout's src/, with its egg-info) would make pip skip the wheel as installed.
    env = dict(kw.pop("env", None) or os.environ)  # type: ignore[call-overload]
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{argv}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return str(proc.stdout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.fail("the dev extra's `build` is missing: pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", out, REPO], timeout=900)
    wheels = sorted(out.glob("boxd-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    return wheels[0]


def test_wheel_carries_the_package_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("boxd/py.typed", "boxd/guest/agent.py", "boxd/guest/init.c",
                   "boxd/_server_deps.py",
                   # the web console's pages and assets, the graph library vendored
                   "boxd/console/templates/machines.html", "boxd/console/static/console.js",
                   "boxd/console/static/console.css",
                   "boxd/console/static/vendor/cytoscape.min.js",
                   "boxd/console/static/vendor/cytoscape.LICENSE",
                   "boxd/console/static/report.js",
                   "boxd/console/static/vendor/chart.umd.min.js",
                   "boxd/console/static/vendor/chart.js.LICENSE"):
        assert needed in names, needed
    assert any(n.startswith("boxd/state/") and n.endswith(".sql") for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    base = sorted(r.split()[1].split(">")[0] for r in requires if "extra ==" not in r)
    # websockets: the SDK's process streams (machines.spawn); imported only when used
    assert base == ["click", "httpx", "pydantic", "rich", "websockets"], requires
    server = {r.split()[1].split(">")[0] for r in requires if "extra == \"server\"" in r}
    # uvloop: the daemon's event loop where it installs (BOXD_EVENT_LOOP falls back)
    # jinja2: the web console's pages (boxd.console)
    assert server == {"fastapi", "uvicorn", "uvloop", "qemu.qmp", "websockets", "jinja2"}, \
        requires


def test_clean_venv_with_client_dependencies_only(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py, boxd = env_dir / "bin" / "python", env_dir / "bin" / "boxd"
    _run([py, "-m", "pip", "install", "--quiet", wheel])
    missing = _run([py, "-c", "from boxd._server_deps import missing_server_modules as m; "
                    "print(m())"])
    assert missing.strip() == "['fastapi', 'uvicorn', 'qemu.qmp', 'jinja2']"  # truly light

    assert _run([boxd, "--version"]).startswith("boxd, version ")
    assert _run([py, "-c", "from boxd import Boxd; print(Boxd.__name__)"]).strip() == "Boxd"

    env = {k: v for k, v in os.environ.items()
           if not k.startswith("BOXD_") and k != "PYTHONPATH"}
    env["BOXD_HOME"] = str(tmp_path / "home")
    serve = subprocess.run([boxd, "serve"], capture_output=True, text=True, env=env,
                           timeout=60)
    lines = serve.stderr.strip().splitlines()
    assert serve.returncode == 1 and len(lines) == 1, serve.stderr
    assert lines[0].startswith("error: the boxd daemon needs") and HINT in lines[0]

    listing = subprocess.run([boxd, "machine", "list"], capture_output=True, text=True,
                             env=env, timeout=60)  # the CLI would start a local daemon
    assert listing.returncode == 1 and HINT in listing.stderr, listing.stderr
    assert len(listing.stderr.strip().splitlines()) == 1, listing.stderr

    code = textwrap.dedent("""
        from boxd import Boxd, HostSetupError
        try:
            Boxd().machines.list()
        except HostSetupError as exc:
            print(exc)
    """)
    assert HINT in _run([py, "-c", code], env=env)
