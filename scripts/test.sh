#!/usr/bin/env bash
# Set up (.venv) and run the test suite (CPU; see the README for how long it takes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pytest -q "$@"
