#!/usr/bin/env bash
# Create .venv (if missing) and install this package with its test extras. CPU torch by default:
# `pip install torch==2.13.0` takes the CPU build where a local wheel is provided; set TORCH_SPEC to choose another.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip_install() {  # quiet, without the local-index notices; a failed install stops the script with pip's output
  local log
  if ! log=$(.venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    printf '%s\n' "$log" >&2
    echo "setup_env.sh: pip install $* failed" >&2
    return 1
  fi
  printf '%s\n' "$log" | grep -v "^WARNING: Location" || true
}
pip_install "${TORCH_SPEC:-torch==2.13.0}"
pip_install -e ".[test]"
.venv/bin/python -c "import torch, trl, transformers, peft, bitsandbytes; print(f'torch {torch.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, bitsandbytes {bitsandbytes.__version__}')" 2>&1 | grep -v "kernels-community"
