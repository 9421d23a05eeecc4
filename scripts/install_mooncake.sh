#!/usr/bin/env bash
# Installs Mooncake Store (TCP build) for the storage tests: the Debian libraries its binaries
# link even for TCP (libibverbs, libnl) and the pip package `mooncake-transfer-engine-non-cuda`
# into .venv. Idempotent: exits 0 at once when everything is already there.
# Env: MOONCAKE_SPEC (pip spec, default below), PYTHON_VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYTHON_VENV:-.venv}
SPEC=${MOONCAKE_SPEC:-mooncake-transfer-engine-non-cuda}
DEBS="libibverbs1 libnl-3-200 libnl-route-3-200"

have_debs() {
  for p in $DEBS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
  done
}
have_pip() {
  "$VENV/bin/python" -c "import mooncake.store" 2>/dev/null && [ -x "$VENV/bin/mooncake_master" ]
}

if have_debs && have_pip; then
  exit 0
fi

if ! have_debs; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q $DEBS >/dev/null 2>&1 || {
      $SUDO apt-get update -q >/dev/null
      $SUDO apt-get install -y -q $DEBS >/dev/null
    }
  else
    echo "install_mooncake: apt-get not found; install $DEBS by hand" >&2
    exit 1
  fi
fi

if ! have_pip; then
  [ -x "$VENV/bin/python" ] || { echo "install_mooncake: $VENV missing (run scripts/setup.sh first)" >&2; exit 1; }
  "$VENV/bin/python" -m pip install -q "$SPEC"
fi
have_pip || { echo "install_mooncake: mooncake.store still not importable" >&2; exit 1; }
