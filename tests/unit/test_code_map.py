"""The docs and the settings stay true to the code: every package under src/boxd is in
docs/design.md's map, and every ``BOXD_*`` variable is read in boxd/config.py alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import boxd

PACKAGE = Path(boxd.__file__).parent
DESIGN = PACKAGE.parents[1] / "docs" / "design.md"
# (``pop`` is not among them: `env.pop("BOXD_URL")` takes a variable out of a child's
# environment, it reads no setting)
_READERS = {"get", "getenv", "setdefault", "getenvb"}


def packages() -> list[str]:
    """``api/``, ``engine/gvisor/``, ...: every directory of src/boxd with an __init__.py."""
    return sorted(f"{p.parent.relative_to(PACKAGE).as_posix()}/"
                  for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def test_every_package_is_in_the_design_map() -> None:
    text = DESIGN.read_text()
    table = set(re.findall(r"^\| `([a-z0-9_/]+/)` \|", text, re.M))
    assert packages(), "no package found under src/boxd"
    missing = [p for p in packages() if p not in table]
    assert missing == [], f"docs/design.md's package table lacks {missing}: add a row"
    gone = sorted(table - set(packages()))
    assert gone == [], f"docs/design.md's package table names packages that are gone: {gone}"


def boxd_env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a module looks a ``BOXD_*`` variable up (``environ.get("BOXD_X")``,
    ``getenv``, ``environ["BOXD_X"]`` read, ``"BOXD_X" in environ``)."""
    found: list[tuple[int, str]] = []

    def named(node: ast.AST | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("BOXD_"):
            return node.value
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            attr = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else ""
            if attr in _READERS and (name := named(node.args[0])):
                found.append((node.lineno, name))
        else:
            key = node.slice if isinstance(node, ast.Subscript) \
                and isinstance(node.ctx, ast.Load) else node.left \
                if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn) \
                else None
            if name := named(key):
                found.append((getattr(node, "lineno", 0), name))
    return found


def test_boxd_settings_are_read_in_config_alone() -> None:
    reads = {f"{path.relative_to(PACKAGE)}:{line}": name
             for path in sorted(PACKAGE.rglob("*.py")) if path.name != "config.py"
             or path.parent != PACKAGE
             for line, name in boxd_env_reads(ast.parse(path.read_text(), str(path)))}
    assert reads == {}, f"BOXD_* read outside boxd/config.py (add it to Settings): {reads}"


def test_the_env_read_check_finds_reads() -> None:
    # the check itself: each way of reading is found, a write or a mention is not
    code = ('import os\nos.environ.get("BOXD_A")\nos.getenv("BOXD_B", "")\n'
            'x = os.environ["BOXD_C"]\nif "BOXD_D" in os.environ: pass\n'
            'os.environ["BOXD_E"] = "1"\nprint("BOXD_F")\n')
    assert [n for _, n in boxd_env_reads(ast.parse(code))] == \
        ["BOXD_A", "BOXD_B", "BOXD_C", "BOXD_D"]
