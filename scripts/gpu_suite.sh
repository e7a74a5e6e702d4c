#!/usr/bin/env bash
# The GPU suite (tests/e2e/test_gpu.py, marked `gpu`) and the GPU benchmark, on a machine that has
# jax with an accelerator plugin (CUDA, ROCm, TPU) but maybe no mlflow and no network
# (docs/hardware.md, "The GPU suite"):
#   here, with network:  bash scripts/gpu_suite.sh fetch [PYTHON_VERSION]
#                        wheels of mlflow, google-crc32c and their requirements for that Python
#                        (default 3.12) into .whl/; copy the checkout with .whl/ to the machine
#   there:               bash scripts/gpu_suite.sh run [pytest args...]
#                        installs, into $JAXEXP_GPU_SITE (default /tmp/jaxexp-site), only the
#                        wheels of .whl/ whose distribution that Python lacks (what it has stays,
#                        its jax included), then runs the suite with the checkout on PYTHONPATH
#                        and XLA_PYTHON_CLIENT_PREALLOCATE=false
#                        bash scripts/gpu_suite.sh bench [bench_gpu.py args...]: the benchmark
#                        bash scripts/gpu_suite.sh llm [bench_llm.py args...]: the 1b LLM's
#                        figures on this accelerator
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${JAXEXP_GPU_SITE:-/tmp/jaxexp-site}
WHEELS=${JAXEXP_GPU_WHEELS:-.whl}

install_missing() {  # the carried wheels whose distribution this Python lacks
  [ -d "$WHEELS" ] || return 0
  "$PY" - "$WHEELS" "$SITE" <<'PYEOF'
import importlib.metadata as md
import pathlib
import re
import subprocess
import sys

wheels, site = pathlib.Path(sys.argv[1]), sys.argv[2]
missing = []
for whl in sorted(wheels.glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(str(whl))
print(f"gpu_suite: installing {len(missing)} missing distributions into {site}", flush=True)
if missing:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", site, *missing]
    subprocess.run(cmd, check=True)
PYEOF
}

setup_env() {
  install_missing
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
  export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:////tmp/jaxexp-gpu-mlflow.db}
  "$PY" -c "import jax, mlflow; print('gpu_suite:', jax.__version__, jax.devices(), 'mlflow', mlflow.__version__)"
}

case "${1:-run}" in
  fetch)
    mkdir -p "$WHEELS"
    "$PY" -m pip download -q --only-binary=:all: --python-version "${2:-3.12}" --implementation cp \
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$WHEELS" "mlflow==3.17.2" google-crc32c
    ;;
  run)
    shift || true
    setup_env
    "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/e2e/test_gpu.py "$@"
    ;;
  bench)
    shift || true
    setup_env
    "$PY" benchmarks/bench_gpu.py "$@"
    ;;
  llm)
    shift || true
    setup_env
    "$PY" benchmarks/bench_llm.py "$@"
    ;;
  *) echo "usage: $0 fetch [PYTHON_VERSION] | run [pytest args] | bench [args] | llm [args]" >&2
     exit 2 ;;
esac
