#!/usr/bin/env bash
# Installs what boxd needs on a Debian/Ubuntu host: QEMU (8.2+ where it can be had),
# qemu-utils, mmdebstrap and the tools the image builder uses, then the Python venv.
# Idempotent: a second run only checks. Reads mirrors from the host's own apt sources.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

log() { printf '[setup] %s\n' "$*" >&2; }

qemu_ok() {
  command -v qemu-system-x86_64 >/dev/null 2>&1 || return 1
  local v
  v=$(qemu-system-x86_64 --version | sed -n 's/.*version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  set -- $v
  [ "${1:-0}" -gt 8 ] || { [ "${1:-0}" -eq 8 ] && [ "${2:-0}" -ge 2 ]; }
}

# gcc + libc6-dev: the guest's boxd-init (guest/init.c) is compiled, statically, at image build.
need_pkgs=(qemu-utils mmdebstrap e2fsprogs cpio kmod xz-utils zstd ca-certificates python3-venv
           gcc libc6-dev)
find_missing() {
  missing=()
  for p in "${need_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  # Node.js and npm for the TypeScript SDK (skipped when a node is already installed).
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    missing+=(nodejs npm)
  fi
}
find_missing

if ! qemu_ok || [ ${#missing[@]} -gt 0 ]; then
  log "apt-get update"
  $SUDO apt-get update -qq
fi

if ! qemu_ok; then
  # shellcheck disable=SC1091
  . /etc/os-release
  if [ "${ID:-}" = debian ] && [ "${VERSION_CODENAME:-}" = bookworm ]; then
    # Debian 12 ships QEMU 7.2; bookworm-backports has 10.0. Add the backports suite
    # with the same mirror the host's apt sources already use.
    if ! apt-cache policy 2>/dev/null | grep -q 'bookworm-backports'; then
      mirror=$(python3 "$here/scripts/apt_mirror.py")
      log "adding bookworm-backports from $mirror"
      printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "$mirror" | $SUDO tee /etc/apt/sources.list.d/boxd-backports.sources >/dev/null
      $SUDO apt-get update -qq
    fi
    log "installing QEMU from bookworm-backports"
    $SUDO apt-get install -y -qq -t bookworm-backports qemu-system-x86 qemu-utils >/dev/null \
      || log "WARNING: QEMU from backports unavailable; falling back to the distribution's QEMU"
  fi
  if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    $SUDO apt-get install -y -qq qemu-system-x86 >/dev/null
  fi
  qemu_ok || log "WARNING: $(qemu-system-x86_64 --version | head -1) is older than 8.2: forks cannot map templates read-only and process start-up is slower"
fi

find_missing
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The unprivileged user QEMU drops to when the daemon runs as root (-run-with user=).
if ! id boxd-qemu >/dev/null 2>&1; then
  log "adding the system user boxd-qemu (QEMU processes run as it)"
  $SUDO useradd --system --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin boxd-qemu
fi

# The Python environment: a venv in .venv with boxd installed editable and the dev tools.
py=${PYTHON:-python3}
if [ ! -x "$here/.venv/bin/python" ]; then
  log "creating .venv"
  "$py" -m venv "$here/.venv"
fi
if ! "$here/.venv/bin/python" -c 'import boxd, pytest' >/dev/null 2>&1 \
   || [ "$here/pyproject.toml" -nt "$here/.venv/.boxd-installed" ]; then
  log "installing boxd into .venv"
  "$here/.venv/bin/pip" install -q -e "$here[dev]"
  touch "$here/.venv/.boxd-installed"
fi
log "ready: $(qemu-system-x86_64 --version | head -1)"
