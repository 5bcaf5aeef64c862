"""Write the sync SDK from the async one: ``_async.py`` → ``_sync.py`` and
``_process_async.py`` → ``_process_sync.py`` (the way httpcore's ``unasync.py`` does).

    python scripts/gen_sync.py          # rewrite the sync files
    python scripts/gen_sync.py --check  # exit 1 (with a diff) if one is not current

The rules are line substitutions, applied in order; every rule must be used by some
line (a dead rule means the source changed under it). Besides them: the module
docstring is the sync one given here, and a run of plain ``import x`` lines is sorted
again (``asyncio`` became ``threading``). tests/unit/test_sdk_generated.py runs the
check, so a stale sync file fails the unit tests.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

SDK = Path(__file__).resolve().parent.parent / "src" / "boxd" / "sdk"

HEADER = "# Generated from {source} by scripts/gen_sync.py: edit that file, then run it.\n"

# source -> (target, the target's module docstring)
FILES: dict[str, tuple[str, str]] = {
    "_async.py": ("_sync.py", '''\
"""The synchronous client, ``Boxd``, generated from ``_async.py``.

The logic without I/O (requests, error mapping) lives in ``_base``.

One ``Boxd`` may be shared by many threads: ``httpx.Client`` is thread-safe, the pool
allows 64 concurrent connections, and the lazy connect (which may start the local
daemon) runs once under a lock.
"""
'''),
    "_process_async.py": ("_process_sync.py", '''\
"""`ProcessHandle`: a process started with ``boxd.machines.spawn`` (sync).

Generated from ``_process_async.py``. Each handle holds one WebSocket to the daemon
(`SyncWebSocket`, driven in the caller's thread); each binary message is one frame of
the process's stdin or stdout.
"""
'''),
}

# (pattern, replacement): regular expressions, in order.
RULES: list[tuple[str, str]] = [
    # what runs in a worker thread or concurrently in async code runs inline in sync code
    (r"await asyncio\.to_thread\(([\w.]+), ", r"\1("),
    (r"await asyncio\.gather\((.*)\)$", r"\1"),
    (r"^import asyncio$", "import threading"),
    (r"\basyncio\.Lock\(\)", "threading.Lock()"),
    (r"\b_process_async\b", "_process_sync"),
    (r"\b_ws_async\b", "_ws_sync"),
    (r"\bAsyncWebSocket\b", "SyncWebSocket"),
    (r"\bAsync([A-Z]\w*)", r"\1"),  # AsyncBoxd, AsyncIterator, httpx.AsyncClient, ...
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\(await (self\.[\w.]+\(\))\)", r"\1"),  # (await self._client()).x -> self._client().x
    (r"\bawait ", ""),
    (r"\basynccontextmanager\b", "contextmanager"),
    (r"\baclose\(", "close("),
    (r"\baread\(", "read("),
    (r"\baiter_(lines|bytes)\(", r"iter_\1("),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
]


def unasync(text: str, source: str, docstring: str, used: set[int] | None = None) -> str:
    """The sync module for the async module ``text`` (named ``source``)."""
    if not text.startswith('"""'):
        raise ValueError(f"{source} must start with its module docstring")
    end = text.index('"""', 3) + 3
    body = text[end:].lstrip("\n")
    rules = [(re.compile(p), r) for p, r in RULES]
    lines = []
    for line in body.splitlines(keepends=True):
        newline = "\n" if line.endswith("\n") else ""
        out = line.removesuffix("\n")
        for i, (pattern, repl) in enumerate(rules):
            new = pattern.sub(repl, out)
            if new != out and used is not None:
                used.add(i)
            out = new
        lines.append(out + newline)
    return HEADER.format(source=source) + docstring + "\n" + "".join(_sort_imports(lines))


def _sort_imports(lines: list[str]) -> list[str]:
    """Sort each run of plain ``import x`` lines (isort's order for them)."""
    out: list[str] = []
    run: list[str] = []
    for line in [*lines, ""]:
        if re.fullmatch(r"import \w+\n", line):
            run.append(line)
            continue
        out.extend(sorted(run))
        run = []
        out.append(line)
    return out[:-1]


def generate() -> dict[Path, str]:
    """Each sync file's path and the text it should have.

    Raises:
        SystemExit: a rule matched no line of any source.
    """
    used: set[int] = set()
    result = {
        SDK / target: unasync((SDK / source).read_text(), source, doc, used)
        for source, (target, doc) in FILES.items()
    }
    dead = [RULES[i][0] for i in range(len(RULES)) if i not in used]
    if dead:
        raise SystemExit(f"gen_sync: rules that match nothing (remove them): {dead}")
    return result


def stale() -> list[str]:
    """A unified diff for each sync file that differs from what `generate` writes."""
    diffs = []
    for path, want in generate().items():
        have = path.read_text() if path.exists() else ""
        if have != want:
            diffs.append("".join(difflib.unified_diff(
                have.splitlines(keepends=True), want.splitlines(keepends=True),
                f"{path.name} (on disk)", f"{path.name} (generated)")))
    return diffs


def main(argv: list[str]) -> int:
    if "--check" in argv:
        diffs = stale()
        for d in diffs:
            sys.stdout.write(d)
        if diffs:
            sys.stdout.write("\nthe sync SDK is stale: run python scripts/gen_sync.py\n")
        return 1 if diffs else 0
    for path, text in generate().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
