#!/usr/bin/env bash
# Cold start as a user's process has it: jaxexp-mlflow installed from its wheel into a new venv
# beside its runtime requirements only (the main stage's frozen jax, jaxlib and MLflow; no test
# extras), then benchmarks/bench_cold_start.py run from there, outside the repository (so the
# children import the installed package). The repository's .venv holds the test extras too
# (~165 distributions against ~110), and MLflow's dependency check in pyfunc.load_model walks
# every installed distribution, for the peer and for jaxexp alike.
#
#   bash benchmarks/cold_start_installed.sh --rounds 9 --modes pyfunc,peer
#
# The venv is .venv-bench (JAXEXP_BENCH_VENV to move it), made again on every run (~1 minute
# with pip's cache warm).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${JAXEXP_BENCH_VENV:-$here/.venv-bench}
python=${PYTHON:-python3}

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip wheel -q --no-deps -w "$venv/wheel" "$here"
"$venv/bin/python" -m pip install -q "$venv"/wheel/jaxexp_mlflow-*.whl \
  "jax==0.10.2" "jaxlib==0.10.2" "mlflow==3.17.2"
echo "== $("$venv/bin/python" -m pip list 2>/dev/null | tail -n +3 | wc -l) distributions in $venv"
cd "$(mktemp -d)"
exec "$venv/bin/python" "$here/benchmarks/bench_cold_start.py" "$@"
