#!/usr/bin/env bash
# Set up (.venv) and run the demo: stock TRL vs prefix-shared DPO on the shipped dataset, offline, CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PYTHONPATH=. .venv/bin/python scripts/demo.py "$@"
