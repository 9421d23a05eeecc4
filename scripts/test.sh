#!/usr/bin/env bash
# The test command: installs what it needs, then runs the default suite (slow/GPU tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/install_mooncake.sh  # the storage tests start a local Mooncake master; CI must run them
scripts/install_vllm.sh  # the connector's tests drive vLLM's real scheduler; CI must run them
exec .venv/bin/python -m pytest "$@"
