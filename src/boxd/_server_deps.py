"""Whether this Python has the daemon's dependencies (the ``server`` extra).

``pip install boxd`` gives the SDK and the CLI only (httpx, pydantic, click, rich); the
daemon needs FastAPI, uvicorn, qemu.qmp and Jinja2 (the web console) as well, from
``pip install 'boxd[server]'``.
``boxd serve`` and the clients' start-a-local-daemon path check here first, so that a
light install says which extra is missing instead of failing with an import traceback.
"""

from __future__ import annotations

import importlib.util

from boxd.errors import HostSetupError

__all__ = ["INSTALL_HINT", "SERVER_MODULES", "missing_server_modules", "require_server"]

#: Top-level modules the daemon imports that the client does not.
SERVER_MODULES = ("fastapi", "uvicorn", "qemu.qmp", "jinja2")
INSTALL_HINT = "pip install 'boxd[server]'"


def missing_server_modules() -> list[str]:
    """The modules of ``SERVER_MODULES`` this interpreter cannot import."""
    missing = []
    for name in SERVER_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the parent package (qemu) is absent
            found = False
        if not found:
            missing.append(name)
    return missing


def require_server() -> None:
    """Check that the daemon can run here.

    Raises:
        HostSetupError: a server dependency is missing; the hint names the extra.
    """
    missing = missing_server_modules()
    if missing:
        raise HostSetupError(
            f"the boxd daemon needs {', '.join(missing)}, which this Python lacks",
            hint=f"install the server extra: {INSTALL_HINT}",
        )
