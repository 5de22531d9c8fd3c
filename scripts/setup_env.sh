#!/usr/bin/env bash
# Create .venv (if missing) and install this package with its test extras. CPU torch by default:
# `pip install torch==2.13.0` takes the CPU build where a local wheel is provided; set TORCH_SPEC to choose another.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, trl, transformers, peft; print(f'torch {torch.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, peft {peft.__version__}')"
