"""A module imported on first use, so that ``from boxd import Boxd`` stays cheap.

The SDK's wire models are pydantic classes; building them costs about as much as
importing httpx. A client module binds ``models = LazyModule("boxd.models")`` at run time
(and imports the real module for type checkers), so the classes are built by the first
request that needs one, not by the import.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LazyModule"]


class LazyModule:
    """Stands for module ``name``; the first attribute lookup imports it.

    Safe from many threads: the import system's per-module lock makes a second thread
    wait until the first has finished executing the module (unlike the stdlib's
    ``importlib.util.LazyLoader`` on Python 3.11).
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
