#!/usr/bin/env bash
# A venv for MLServer (V2 inference protocol, the runtime KServe/Seldon run for MLflow models).
# mlserver / mlserver-mlflow pin older fastapi, starlette, protobuf and ml_dtypes than the project's
# .venv, so they get their own: tests/serving/test_mlserver.py and benchmarks/bench_mlserver.py use it.
# Usage: bash scripts/mlserver_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-mlserver/bin/python ] || "$PY" -m venv .venv-mlserver
.venv-mlserver/bin/python -m pip install -q --upgrade pip
.venv-mlserver/bin/python -m pip install -q -e ".[mlserver]" "jax==0.10.2" "jaxlib==0.10.2" \
  "mlflow==3.17.2"
