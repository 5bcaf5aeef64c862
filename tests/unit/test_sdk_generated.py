"""The sync SDK is generated from the async one (scripts/gen_sync.py): the files on
disk are what the generator writes, and the check notices when they are not."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gen_sync.py"


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_sync", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sync_files_are_current() -> None:
    diffs = _gen().stale()
    assert diffs == [], "run python scripts/gen_sync.py\n" + "".join(diffs)


def test_the_check_fails_on_a_hand_edited_sync_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = _gen()
    for source, (target, _) in gen.FILES.items():
        shutil.copy(gen.SDK / source, tmp_path / source)
        shutil.copy(gen.SDK / target, tmp_path / target)
    monkeypatch.setattr(gen, "SDK", tmp_path)
    assert gen.stale() == []
    sync = tmp_path / "_sync.py"
    sync.write_text(sync.read_text().replace("def list(self)", "def list_(self)", 1))
    (diff,) = gen.stale()
    assert "-    def list_(self)" in diff and "+    def list(self)" in diff
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.stale() == []


def test_a_rule_that_matches_nothing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _gen()
    monkeypatch.setattr(gen, "RULES", [*gen.RULES, (r"\bnever_in_the_sdk\b", "x")])
    with pytest.raises(SystemExit, match="never_in_the_sdk"):
        gen.generate()


def test_unasync_rewrites_the_async_idioms() -> None:
    src = (
        '"""async doc"""\n'
        "import os\n"
        "import asyncio\n"
        "class AsyncFoo:\n"
        "    async def __aenter__(self) -> AsyncFoo:\n"
        "        async with self._lock:\n"
        "            await asyncio.to_thread(_local.ensure_daemon, t.paths)\n"
        "        a, b = await asyncio.gather(self.x(), self.y())\n"
        "        async for line in resp.aiter_lines():\n"
        "            await (await self._client()).aclose()\n"
    )
    out = _gen().unasync(src, "_a.py", '"""sync doc"""\n')
    assert out.splitlines() == [
        "# Generated from _a.py by scripts/gen_sync.py: edit that file, then run it.",
        '"""sync doc"""',
        "",
        "import os",  # the run of plain imports sorted again
        "import threading",
        "class Foo:",
        "    def __enter__(self) -> Foo:",
        "        with self._lock:",
        "            _local.ensure_daemon(t.paths)",
        "        a, b = self.x(), self.y()",
        "        for line in resp.iter_lines():",
        "            self._client().close()",
    ]


def test_the_script_runs_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
