#!/usr/bin/env bash
# The test command: sets the host up (QEMU, tools, .venv), then runs the linters and the
# whole test suite: unit tests, and integration tests that boot real machines (the
# guest image is built once into .cache/images), including the TypeScript SDK's tests.
#
# Usage: sudo scripts/test.sh [--fast] [pytest args...]
#   (no args) the whole suite; the fresh-host tier runs in the background beside it
#   pytest args: only what they select (e.g. tests/unit -k spares), one pytest run
#   --fast   the fast tier: ruff, mypy, import-linter and every test not marked vm,
#            fresh_host or packaging (tests/unit and the probe logic of tests/integration):
#            no machine (a test that starts one fails, tests/_support/vm_guard.py), no
#            guest image, about 3 minutes on a quiet 2-core host. pytest runs on every core
#            (pytest-xdist: one worker per CPU, at most 8; BOXD_TEST_WORKERS=N sets it,
#            1 runs it in one process) and mypy runs beside it (its report follows
#            pytest's). The set-up step only checks a set-up host (no apt, no sudo; pip
#            only when pyproject.toml changed), so once `sudo scripts/test.sh` has run,
#            `scripts/test.sh --fast` needs no root. Iterate on it; run the whole suite
#            (no flag, what CI runs) before you submit.
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
if (( fast )); then
  echo "[test] import-linter"; .venv/bin/lint-imports --no-cache
  # mypy (half a minute of one core with no .mypy_cache, as in a fresh clone) runs beside
  # pytest; its report is printed after pytest's, and either failing fails the tier.
  mypy_log=$(mktemp /tmp/boxd-mypy.XXXXXX.log)
  echo "[test] mypy (engine conformance included; in the background, report after pytest)"
  .venv/bin/mypy >"$mypy_log" 2>&1 &
  mypy_pid=$!
  trap 'kill "$mypy_pid" 2>/dev/null' INT TERM
  workers=${BOXD_TEST_WORKERS:-$(nproc)}
  if (( workers > 8 )); then workers=8; fi
  dist=(-n "$workers" --dist worksteal)
  if (( workers <= 1 )); then dist=(-p no:xdist); fi
  echo "[test] pytest (fast tier: not vm, no machines; $workers workers)"
  set +e
  .venv/bin/pytest -p no:cacheprovider -ra --durations=30 "${dist[@]}" \
    -m "not vm and not fresh_host and not packaging" tests "$@"
  pytest_rc=$?
  wait "$mypy_pid"
  mypy_rc=$?
  trap - INT TERM
  set -e
  echo "[test] mypy (exit $mypy_rc):"
  cat "$mypy_log"
  rm -f "$mypy_log"
  if (( pytest_rc != 0 )); then exit "$pytest_rc"; fi
  exit "$mypy_rc"
fi
echo "[test] mypy (engine conformance included)"; .venv/bin/mypy
echo "[test] import-linter"; .venv/bin/lint-imports --no-cache
if (( $# )); then
  echo "[test] pytest $*"
  exec .venv/bin/pytest -p no:cacheprovider -ra --durations=30 "$@"
fi
# The whole suite. The fresh-host tier (set-up in pristine Debian roots: downloads, apt
# and pip, ~13 min, no machine) runs beside the rest at a lower CPU priority, so the
# suite's wall time is the longer of the two, not their sum. Its log follows the main
# run's. --durations: CI's log names the 30 slowest tests (the run must stay < 45 min).
fresh_log=$(mktemp /tmp/boxd-fresh-host.XXXXXX.log)
echo "[test] pytest -m fresh_host (in the background, log after the main run)"
nice -n 10 .venv/bin/pytest -p no:cacheprovider -ra -m fresh_host tests >"$fresh_log" 2>&1 &
fresh_pid=$!
echo "[test] pytest -m 'not fresh_host'"
set +e
.venv/bin/pytest -p no:cacheprovider -ra --durations=30 -m "not fresh_host" tests
main_rc=$?
wait "$fresh_pid"
fresh_rc=$?
set -e
echo "[test] fresh-host tier (exit $fresh_rc):"
cat "$fresh_log"
rm -f "$fresh_log"
(( fresh_rc == 5 )) && fresh_rc=0  # 5: no test collected (a -k or a host without them)
(( main_rc == 0 && fresh_rc == 0 ))
