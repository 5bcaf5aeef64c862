"""The light client: what ``import boxd`` and ``from boxd import Boxd`` load, and the
one-line hint a daemon start gives without the ``server`` extra.

Each check runs in a fresh interpreter (``sys.modules`` of this one is full of
everything the other tests imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import boxd

# What a light client is made of; every other module of the package tree (the daemon's
# layers, the CLI, the demo, boxd.rl, the guest agent, and any package added later) is
# one that ``from boxd import Boxd`` must not load.
CLIENT = {"sdk", "errors", "models", "process_models", "config", "_lazy", "_version",
          "_server_deps", "__init__", "__main__"}
PACKAGE = Path(boxd.__file__).parent


def server_modules() -> tuple[str, ...]:
    """``boxd.X`` for each top-level module or package of src/boxd outside `CLIENT`."""
    names = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    return tuple(sorted(f"boxd.{n}" for n in names - CLIENT))


# Modules of the daemon and the CLI, and the daemon's own dependencies.
DAEMON_OR_CLI = (*server_modules(), "fastapi", "starlette", "uvicorn", "qemu")


def test_the_server_list_is_todays_package_tree() -> None:
    # the derived list names the daemon's layers as they are (no deleted boxd.core)
    for name in ("boxd.api", "boxd.cli", "boxd.control", "boxd.demo", "boxd.engine",
                 "boxd.images", "boxd.node", "boxd.state", "boxd.storage", "boxd.services"):
        assert name in DAEMON_OR_CLI
    assert all((PACKAGE / m.split(".")[1]).exists() or (PACKAGE / f"{m.split('.')[1]}.py")
               .exists() for m in DAEMON_OR_CLI if m.startswith("boxd."))


def loaded_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return set(json.loads(out))


def offenders(loaded: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_from_boxd_import_boxd_loads_no_daemon_or_cli_module() -> None:
    loaded = loaded_after("from boxd import Boxd")
    assert "boxd.sdk._sync" in loaded
    assert offenders(loaded, DAEMON_OR_CLI) == []
    # the async twin (and its WebSocket client) and the pydantic models wait for first use
    assert offenders(loaded, ("boxd.sdk._async", "boxd.sdk._process_async",
                              "boxd.sdk._ws_async", "boxd.models")) == []



def test_import_boxd_loads_only_the_errors() -> None:
    loaded = loaded_after("import boxd; from boxd import BoxdError, MachineNotFound")
    assert offenders(loaded, ("httpx", "pydantic", "boxd.sdk", "boxd.models")) == []
    assert offenders(loaded, DAEMON_OR_CLI) == []


def test_lazy_names_resolve_to_the_real_objects() -> None:
    import boxd
    from boxd import models, sdk

    assert boxd.Boxd is sdk.Boxd
    assert boxd.AsyncBoxd is sdk.AsyncBoxd
    assert boxd.Machine is models.Machine
    assert set(boxd.__all__) <= set(dir(boxd))
    with pytest.raises(AttributeError):
        _ = boxd.NoSuchThing  # type: ignore[attr-defined]


def test_models_load_once_under_concurrent_first_use() -> None:
    # 16 threads make the first model lookup at once: each must see the finished module.
    code = textwrap.dedent("""
        import threading
        from boxd.sdk import _base
        barrier = threading.Barrier(16)
        got = []
        def first_use():
            barrier.wait()
            got.append(_base.models.Machine.__name__)
        threads = [threading.Thread(target=first_use) for _ in range(16)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert got == ["Machine"] * 16, got
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# Hides the server extra's modules, as on `pip install boxd`. A sitecustomize on
# PYTHONPATH applies to every interpreter the test starts, the daemon the SDK would spawn
# included (so a regression fails the test instead of leaving a daemon running).
_HIDE_SERVER = textwrap.dedent("""
    import sys
    class HideServer:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"fastapi", "uvicorn", "qemu", "jinja2"}:
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None
    sys.meta_path.insert(0, HideServer())
""")


@pytest.fixture
def light_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HIDE_SERVER)
    env = {k: v for k, v in os.environ.items() if k != "BOXD_URL"}
    env["PYTHONPATH"] = str(site)
    env["BOXD_HOME"] = str(tmp_path / "home")
    return env


def test_server_modules_hidden_in_light_env(light_env: dict[str, str]) -> None:
    code = "from boxd._server_deps import missing_server_modules as m; print(m())"
    out = subprocess.run([sys.executable, "-c", code], env=light_env, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert out.strip() == "['fastapi', 'uvicorn', 'qemu.qmp', 'jinja2']"


def test_serve_without_server_extra_prints_one_line_hint(light_env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "boxd", "serve"], env=light_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: the boxd daemon needs fastapi, uvicorn, qemu.qmp")
    assert "pip install 'boxd[server]'" in lines[0]


def test_sdk_autostart_without_server_extra_raises_host_setup_error(
    light_env: dict[str, str],
) -> None:
    code = textwrap.dedent("""
        from boxd import Boxd, HostSetupError
        try:
            Boxd().machines.list()
        except HostSetupError as exc:
            print(exc)
        else:
            raise SystemExit("no error")
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=light_env, capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'boxd[server]'" in proc.stdout
