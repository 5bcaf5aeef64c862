#!/usr/bin/env bash
# The test command: sets the host up (QEMU, tools, .venv), then runs the linters and the
# whole test suite: unit tests, and integration tests that boot real machines (the
# guest image is built once into .cache/images), including the TypeScript SDK's tests.
#
# Usage: sudo scripts/test.sh [--fast] [pytest args...]
#   --fast   the fast tier: ruff, mypy, import-linter and every test not marked vm,
#            fresh_host or packaging (tests/unit and the probe logic of tests/integration):
#            no machine (a test that starts one fails, tests/_support/vm_guard.py), no
#            guest image, a few minutes. The set-up step only checks a set-up host (no
#            apt, no sudo; pip only when pyproject.toml changed), so once `sudo
#            scripts/test.sh` has run, `scripts/test.sh --fast` needs no root. Iterate
#            on it; run the whole suite (no flag, what CI runs) before you submit.
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
  echo "[test] pytest (fast tier: not vm, no machines)"
  exec .venv/bin/pytest -p no:cacheprovider -ra -m "not vm and not fresh_host and not packaging" \
    tests "$@"
fi
echo "[test] pytest"
# --durations: CI's log names the 30 slowest tests (the whole run must stay under 45 min)
exec .venv/bin/pytest -p no:cacheprovider -ra --durations=30 "$@"
