#!/usr/bin/env bash
# The main job: installs what it needs, then runs the demo through the runtime.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
