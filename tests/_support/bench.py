"""Bench helpers the tests share (``bench/_cluster.py``: a local Ray cluster in network
namespaces), loaded from their file: ``bench/`` is not a package, and the tests do not
put it on ``sys.path``."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from .daemon import REPO


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
