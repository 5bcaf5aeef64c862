#!/usr/bin/env bash
# The main job: sets the host up (QEMU, gVisor, tools, .venv), then runs the spec's RL
# demo on the embedded default (a local daemon started on demand, SQLite, and the engine
# BOXD_ENGINE=auto picks: QEMU where KVM boots the guest, else gVisor where runsc works,
# else QEMU/TCG; the demo's summary says which and why): a warm baseline, 8 forked
# rollouts, the reproducibility check, a checkpoint reset and a snapshot round trip.
# Usage: sudo scripts/demo.sh [boxd demo options...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
# Only what the demo runs: boxd with the daemon's dependencies (no test or lint tools).
bash "$here/scripts/setup-host.sh" server
exec "$here/.venv/bin/boxd" demo "$@"
