"""Small helpers shared by the image build steps: running tools, atomic writes."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from boxd.errors import HostSetupError
from boxd.storage._files import fsync_dir, fsync_path

Progress = Callable[[str, float | None], None]

SETUP_HINT = "run scripts/setup-host.sh"


def need_tool(name: str, step: str) -> str:
    """The absolute path of ``name``, or a HostSetupError naming the step."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        raise HostSetupError(
            f"image build step {step!r} failed: {name} not found", hint=SETUP_HINT, step=step
        )
    return path


def run(
    argv: Sequence[str | os.PathLike[str]],
    step: str,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    hint: str = SETUP_HINT,
    timeout: float = 3600,
) -> str:
    """Run a build command; on failure raise HostSetupError with the output's tail."""
    try:
        proc = subprocess.run(
            [os.fspath(a) for a in argv],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError as exc:
        raise HostSetupError(
            f"image build step {step!r} failed: {argv[0]} not found", hint=hint, step=step
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise HostSetupError(
            f"image build step {step!r} timed out after {timeout:.0f} s", hint=hint, step=step
        ) from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-25:])
        raise HostSetupError(
            f"image build step {step!r} failed (exit {proc.returncode}): "
            f"{' '.join(os.fspath(a) for a in argv)[:300]}\n{tail}",
            hint=hint,
            step=step,
        )
    return proc.stdout


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under ``root`` (not the rootfs contents)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                continue
            fsync_path(p)
        fsync_dir(Path(dirpath))
