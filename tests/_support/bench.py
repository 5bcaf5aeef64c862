"""Modules the tests load from their file: bench helpers (``bench/_cluster.py``: a local
Ray cluster in network namespaces; ``bench/`` is not a package, and the tests do not put
it on ``sys.path``) and examples (`load_path`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .daemon import REPO


def load_path(path: Path) -> ModuleType:
    """The Python file ``path`` as a module named by its stem (loaded anew each call)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(name: str) -> ModuleType:
    """``bench/<name>.py`` as the module ``boxd_bench.<name>`` (loaded once)."""
    qualified = f"boxd_bench.{name}"
    if (module := sys.modules.get(qualified)) is not None:
        return module
    spec = importlib.util.spec_from_file_location(qualified, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module
