#!/usr/bin/env bash
# Set up a fresh environment and run the main job end to end on a local sqlite MLflow store
# under ./run/: train a small MLP with optax, log it as a jaxexp model, reload it in a fresh
# process and check that the outputs match, then reproduce it with `jaxexp verify`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e . "jax==0.10.2" "jaxlib==0.10.2" "mlflow==3.17.2" optax
mkdir -p run && cd run
export PATH="$PWD/../.venv/bin:$PATH"
export MLFLOW_TRACKING_URI="sqlite:///$PWD/mlruns.db"
../.venv/bin/python ../examples/train_mlp.py "$@"
# Reproduce the archived result from the registry, as someone would months later.
../.venv/bin/jaxexp verify "models:/jaxexp-example-mlp/latest"
