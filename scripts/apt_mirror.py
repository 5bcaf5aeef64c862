"""Print the Debian mirror the host's apt sources use (first deb822 or one-line entry).

Used by setup-host.sh so an added suite goes through the same mirror (and proxy)
as the host's existing entries. It runs with the system Python before the project's
venv exists, so it loads ``boxd/images/_apt.py`` (stdlib only) by file path and never
imports the ``boxd`` package (whose ``__init__`` needs httpx and pydantic).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_APT = Path(__file__).resolve().parent.parent / "src" / "boxd" / "images" / "_apt.py"

spec = importlib.util.spec_from_file_location("boxd_setup_apt", _APT)
assert spec is not None and spec.loader is not None
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module  # dataclasses look the module up while building classes
spec.loader.exec_module(module)
print(module.debian_mirror())
