#!/usr/bin/env bash
# Set up (.venv) and run the test suite (CPU, a few minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pytest -q "$@"
