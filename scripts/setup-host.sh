#!/usr/bin/env bash
# Installs what boxd needs on a Debian host: QEMU (8.2+ where it can be had), runsc (gVisor,
# the second engine; optional), qemu-utils, passt and nftables (machines' network and its
# filter), mmdebstrap and the tools the image builder uses, then the Python venv (.venv).
# Idempotent: a second run only checks. Reads mirrors from the host's own apt sources.
#
# Usage: scripts/setup-host.sh [EXTRAS]
#   EXTRAS: the package extras installed into .venv, comma-separated (default: server,
#   or $BOXD_EXTRAS). scripts/demo.sh asks for `server` (what the daemon runs);
#   scripts/test.sh for `server,dev` (adds pytest, ruff, mypy, schemathesis, build, ...).
#
# Nothing here imports the boxd package before .venv has its dependencies: the system
# Python only runs scripts/apt_mirror.py, which is stdlib only. A failing step prints its
# name and what to do.
set -Eeuo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
extras=${1:-${BOXD_EXTRAS:-server}}
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

log() { printf '[setup] %s\n' "$*" >&2; }

# step NAME HINT: names what runs next, for the error report below.
STEP="start"
HINT=""
step() { STEP=$1; HINT=$2; }
on_error() {
  local rc=$?
  # A command substitution inherits the trap (set -E); report once, from the main shell.
  [ "$BASH_SUBSHELL" -gt 0 ] && exit "$rc"
  printf '[setup] FAILED (exit %s) in step "%s"\n' "$rc" "$STEP" >&2
  [ -n "$HINT" ] && printf '[setup] what to do: %s\n' "$HINT" >&2
  exit "$rc"
}
trap on_error ERR

qemu_ok() {
  command -v qemu-system-x86_64 >/dev/null 2>&1 || return 1
  local v
  v=$(qemu-system-x86_64 --version | sed -n 's/.*version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  set -- $v
  [ "${1:-0}" -gt 8 ] || { [ "${1:-0}" -eq 8 ] && [ "${2:-0}" -ge 2 ]; }
}

# gcc + libc6-dev: the guest's boxd-init (guest/init.c) is compiled, statically, at image build.
# passt + nftables: a machine's network (engine/qemu/_net.py) and the filter that keeps it
# off the host and private ranges.
# buildah + libgpgme11 (its RUN steps need it): `boxd image build -t` builds Dockerfiles.
need_pkgs=(qemu-utils mmdebstrap e2fsprogs cpio kmod xz-utils zstd ca-certificates python3-venv
           gcc libc6-dev passt nftables buildah libgpgme11)
# The test tools only (the dev extra): the tests' own container registry on loopback
# (tests/unit/test_oci_import.py imports through `docker://`), busybox-static (the base of
# the tests' Dockerfile builds), strace (tests/unit/test_fd_ownership.py counts close()
# calls with it), chromium (tests/integration/test_console.py drives it with Playwright,
# whose own browser download is never used).
case ",$extras," in *",dev,"*) need_pkgs+=(docker-registry busybox-static strace chromium) ;; esac
find_missing() {
  missing=()
  for p in "${need_pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 && continue
    # Debian 13 renamed it (the 64-bit time_t transition); apt installs that for this name.
    [ "$p" = libgpgme11 ] && dpkg -s libgpgme11t64 >/dev/null 2>&1 && continue
    missing+=("$p")
  done
  # Node.js and npm for the TypeScript SDK (skipped when a node is already installed).
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    missing+=(nodejs npm)
  fi
}
find_missing

apt_hint="check the host's apt sources (/etc/apt/sources.list*) and its network or proxy, \
then run scripts/setup-host.sh again"

# Debian 12: add the bookworm-backports suite with the mirror the host's apt sources use.
add_backports() {
  if ! apt-cache policy 2>/dev/null | grep -q 'bookworm-backports'; then
    step "find the host's Debian mirror (scripts/apt_mirror.py)" \
      "add a Debian bookworm entry to /etc/apt/sources.list or /etc/apt/sources.list.d/"
    mirror=$(python3 "$here/scripts/apt_mirror.py")
    step "add bookworm-backports" "$apt_hint"
    log "adding bookworm-backports from $mirror"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$mirror" | $SUDO tee /etc/apt/sources.list.d/boxd-backports.sources >/dev/null
    $SUDO apt-get update -qq
  fi
}

if ! qemu_ok || [ ${#missing[@]} -gt 0 ]; then
  step "apt-get update" "$apt_hint"
  log "apt-get update"
  $SUDO apt-get update -qq
fi

if ! qemu_ok; then
  # shellcheck disable=SC1091
  . /etc/os-release
  if [ "${ID:-}" = debian ] && [ "${VERSION_CODENAME:-}" = bookworm ]; then
    # Debian 12 ships QEMU 7.2; bookworm-backports has 10.0. Add the backports suite
    # with the same mirror the host's apt sources already use.
    add_backports
    log "installing QEMU from bookworm-backports"
    $SUDO apt-get install -y -qq -t bookworm-backports qemu-system-x86 qemu-utils >/dev/null \
      || log "WARNING: QEMU from backports unavailable; falling back to the distribution's QEMU"
  fi
  if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    step "install QEMU" "$apt_hint"
    $SUDO apt-get install -y -qq qemu-system-x86 >/dev/null
  fi
  qemu_ok || log "WARNING: $(qemu-system-x86_64 --version | head -1) is older than 8.2: forks cannot map templates read-only and process start-up is slower"
fi

# gVisor's runsc, the second engine (optional: without it `boxd info` says gvisor is
# unavailable and why). Debian 12's own runsc (2022) runs only with the ptrace platform and
# hangs on checkpoint; bookworm-backports has a 2024 snapshot that works with systrap.
runsc_ok() {
  command -v runsc >/dev/null 2>&1 || return 1
  local d
  d=$(runsc --version 2>/dev/null | grep -o '20[0-9]\{6\}' | head -1)
  [ "${d:-0}" -ge 20230101 ]
}
if ! runsc_ok; then
  # shellcheck disable=SC1091
  . /etc/os-release
  step "install runsc (gVisor)" "$apt_hint"
  if [ "${ID:-}" = debian ] && [ "${VERSION_CODENAME:-}" = bookworm ]; then
    add_backports
    log "installing runsc (gVisor) from bookworm-backports"
    $SUDO apt-get install -y -qq -t bookworm-backports runsc >/dev/null \
      || log "WARNING: runsc from bookworm-backports unavailable: the gvisor engine is off"
  else
    $SUDO apt-get update -qq
    log "installing runsc (gVisor)"
    $SUDO apt-get install -y -qq runsc >/dev/null \
      || log "WARNING: runsc unavailable from the distribution: the gvisor engine is off"
  fi
  runsc_ok || log "WARNING: $(runsc --version 2>/dev/null | head -1 || echo 'no runsc'): the gvisor engine needs a 2023 or later build"
fi

find_missing
if [ ${#missing[@]} -gt 0 ]; then
  step "install ${missing[*]}" "$apt_hint"
  log "installing ${missing[*]}"
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The unprivileged user QEMU drops to when the daemon runs as root (-run-with user=).
if ! id boxd-qemu >/dev/null 2>&1; then
  step "add the system user boxd-qemu" \
    "run as root (or with sudo), or set BOXD_QEMU_USER= to run QEMU as the daemon's user"
  log "adding the system user boxd-qemu (QEMU processes run as it)"
  $SUDO useradd --system --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin boxd-qemu
fi

# The unprivileged user passt runs as (root daemon); the egress filter matches its uid.
if ! id boxd-net >/dev/null 2>&1; then
  step "add the system user boxd-net" \
    "run as root (or with sudo), or set BOXD_NET_USER to another unprivileged user"
  log "adding the system user boxd-net (machines' network, passt, runs as it)"
  $SUDO useradd --system --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin boxd-net
fi

# The Python environment: a venv in .venv with boxd installed editable and $extras.
# .venv/.boxd-installed records the extras installed, so that scripts/demo.sh after
# scripts/test.sh (server after server,dev) does not reinstall.
py=${PYTHON:-python3}
if [ ! -x "$here/.venv/bin/python" ]; then
  step "create .venv" "install python3-venv (apt-get install python3-venv), or set PYTHON"
  log "creating .venv"
  "$py" -m venv "$here/.venv"
fi
marker="$here/.venv/.boxd-installed"
have=""
[ -f "$marker" ] && have=$(cat "$marker")
need_install=0
IFS=, read -r -a wanted <<<"$extras"
for e in "${wanted[@]}"; do
  case ",$have," in *",$e,"*) ;; *) need_install=1 ;; esac
done
if [ ! -f "$marker" ] || [ "$here/pyproject.toml" -nt "$marker" ] \
   || ! "$here/.venv/bin/python" -c 'import boxd' >/dev/null 2>&1; then
  need_install=1
fi
if [ "$need_install" = 1 ]; then
  all=$(printf '%s\n' "${wanted[@]}" ${have//,/ } | sed '/^$/d' | sort -u | paste -sd, -)
  step "pip install boxd[$all] into .venv" \
    "check the pip configuration (pip config list) and the network or proxy; the pip output above names the package that failed"
  log "installing boxd[$all] into .venv"
  spec=$here
  [ -n "$all" ] && spec="$here[$all]"
  "$here/.venv/bin/pip" install -q -e "$spec"
  echo "$all" >"$marker"
fi
runsc_v=$(runsc --version 2>/dev/null | head -1 || true)
log "ready: $(qemu-system-x86_64 --version | head -1); ${runsc_v:-no runsc}; .venv has boxd[$(cat "$marker")]"
