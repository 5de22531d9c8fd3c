#!/usr/bin/env bash
# Set up (.venv-test: the tests' own environment, so that their extra packages (DeepSpeed, bitsandbytes, ...) stay out
# of the demo's .venv) and run the test suite on the CPU (see the README for how long each part takes).
#   bash scripts/test.sh          the fast part: every test that runs in this process (the equivalence matrix against
#                                 stock TRL, layouts, masks, errors)
#   bash scripts/test.sh --all    everything, including the tests marked `long` that start other processes (the command
#                                 line, several processes, DeepSpeed, the README, the demo); CI runs this
# Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not long")
if [[ "${1:-}" == "--all" ]]; then
    tier=()
    shift
fi
VENV=.venv-test EXTRAS=test bash scripts/setup_env.sh
.venv-test/bin/python -m pytest -q ${tier[@]+"${tier[@]}"} "$@"
