#!/usr/bin/env bash
# The test command: sets the host up (QEMU, tools, .venv), then runs the linters and the
# whole test suite: unit tests, and integration tests that boot real machines (the
# guest image is built once into .cache/images), including the TypeScript SDK's tests.
#
# Usage: sudo scripts/test.sh [--fast] [pytest args...]
#   --fast   the fast tier: set-up, ruff, mypy, import-linter and tests/unit only (no
#            machines, no guest image; a few minutes). Iterate on it; run the whole
#            suite (no flag, what CI runs) before you submit.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
fast=0
if [[ "${1:-}" == "--fast" ]]; then
  fast=1
  shift
fi
bash scripts/setup-host.sh server,dev
export BOXD_IMAGE_CACHE="$here/.cache/images"
echo "[test] ruff"; .venv/bin/ruff check src tests bench examples
echo "[test] mypy (engine conformance included)"; .venv/bin/mypy
echo "[test] import-linter"; .venv/bin/lint-imports --no-cache
if (( fast )); then
  echo "[test] pytest (fast tier: tests/unit, no machines)"
  exec .venv/bin/pytest -p no:cacheprovider -ra tests/unit "$@"
fi
echo "[test] pytest"
exec .venv/bin/pytest -p no:cacheprovider -ra "$@"
