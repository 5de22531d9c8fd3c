#!/usr/bin/env bash
# Set up (.venv) and run the demo: stock TRL vs prefix-shared DPO on the shipped dataset, offline, CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS-}" bash scripts/setup_env.sh  # the package alone: no test extras
PYTHONPATH=. .venv/bin/python scripts/demo.py "$@"
