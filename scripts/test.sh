#!/usr/bin/env bash
# Set up the test environments from scratch and run the tests:
#  - .venv        : the newest supported stack (jax/jaxlib 0.10.2), the whole default suite;
#  - .venv-oldest : the oldest supported jax (0.6.2), the flavor and params tests.
# Usage: bash scripts/test.sh [pytest args...]   (JAXEXP_SKIP_OLDEST=1 skips the second run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

setup() {  # setup <venv> <pip args...>
  local venv=$1; shift
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "$@"
}

setup .venv -e ".[test,iree]" "jax==0.10.2" "jaxlib==0.10.2" "mlflow==3.17.2"
export PATH="$PWD/.venv/bin:$PATH"  # `mlflow models serve` and `jaxexp` come from the venv
.venv/bin/ruff check jaxexp_mlflow tests benchmarks examples scripts
.venv/bin/pytest -q "$@"

if [ "${JAXEXP_SKIP_OLDEST:-0}" != 1 ]; then
  setup .venv-oldest -e . "jax==0.6.2" "jaxlib==0.6.2" "mlflow==3.17.2" pytest hypothesis
  PATH="$PWD/.venv-oldest/bin:$PATH" .venv-oldest/bin/pytest -q -p no:cacheprovider \
    tests/test_flavor.py tests/test_params.py
fi
