#!/usr/bin/env bash
# Installs vLLM 0.33.0 for the tiers-only connector's tests (vLLM's real scheduler on CPU) into
# .venv: vllm itself with --no-deps (its requirements pin a CUDA torch and an older
# transformers; neither is needed by the scheduler and connector code on CPU), then the modules
# it imports there, pinned, also --no-deps so that nothing installed before changes.
# Idempotent: exits 0 at once when vllm's scheduler already imports.
# Env: PYTHON_VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYTHON_VENV:-.venv}
have() {
  HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "import vllm.v1.core.sched.scheduler, vllm.distributed.kv_transfer.kv_connector.v1.base, einops" 2>/dev/null
}
have && exit 0
[ -x "$VENV/bin/python" ] || { echo "install_vllm: $VENV missing (run scripts/setup.sh first)" >&2; exit 1; }
"$VENV/bin/python" -m pip install -q --no-deps vllm==0.33.0
"$VENV/bin/python" -m pip install -q --no-deps -r scripts/requirements-vllm.txt
have || { echo "install_vllm: vllm's scheduler still does not import" >&2; exit 1; }
