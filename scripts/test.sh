#!/usr/bin/env bash
# Set up the test environments from scratch and run the tests (what CI runs via .ci/run):
#  - main   (.venv):        Python 3.11, the frozen stack (jax/jaxlib 0.10.2, mlflow 3.17.2):
#                           ruff, the prose check, the whole default suite, the Spark
#                           standalone-cluster test, then the
#                           built artifacts (sdist and wheel checked, the wheel installed in a
#                           clean venv, the README's quickstart run from it);
#  - newest (.venv-newest): Python 3.13 (scripts/python313.sh finds or makes one) with the newest
#                           jax, jaxlib, mlflow and orbax-checkpoint the registry serves, resolved
#                           now: the canary, red the day a release breaks us; the whole default suite,
#                           then the GPU suite rehearsed on the CPU;
#  - oldest (.venv-oldest): the oldest supported jax (0.6.2), the flavor and params tests;
#  - docs   (.venv-docs):   the documentation site built with strict checks (scripts/docs.sh).
# Every stage runs even if an earlier one failed; the script fails if any did.
# Two lanes on two cores: main in one, newest, oldest and docs in the other (most of a test's time
# is a fresh interpreter, a server start-up or a compile of one thread; CONTRIBUTING.md, "Tests").
# Each stage's output goes to .ci-logs/<stage>.log and is printed whole when the stage ends; each
# step prints how long it took, and the run ends with every step's time (.ci-logs/steps.tsv).
# JAXEXP_PARALLEL=0 runs the stages one after the other, printing as they go.
# Usage: bash scripts/test.sh [pytest args...]
#   JAXEXP_STAGES="main newest oldest docs" picks stages; JAXEXP_SKIP_OLDEST=1 drops oldest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAGES=${JAXEXP_STAGES:-main newest oldest docs}
[ "${JAXEXP_SKIP_OLDEST:-0}" = 1 ] && STAGES=${STAGES//oldest/}
export PIP_DISABLE_PIP_VERSION_CHECK=1
# every pytest call of every stage: quiet, no cache written into the checkout, and the 25
# slowest tests listed at its end (where the time goes: CONTRIBUTING.md, "Tests"); what each
# stage selects is stated beside the markers in pyproject.toml
PYTEST_OPTS=(-q -p no:cacheprovider --durations=25)
# a private jax/MLflow name that a release removed fails its test by name (internals/*_private.py)
export JAXEXP_STRICT_PRIVATE=${JAXEXP_STRICT_PRIVATE:-1}

setup() {  # setup <python> <venv> <pip args...>
  local py=$1 venv=$2; shift 2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  # pip >= 25.1 installs PEP 735 dependency groups (--group)
  "$venv/bin/python" -m pip install -q --upgrade "pip>=25.1"
  "$venv/bin/python" -m pip install -q "$@"
}

artifacts() {  # artifacts <venv>: build the sdist and wheel with <venv>'s tools (the `release`
  # group), check them, install the wheel alone in a clean venv (no checkout on sys.path, no
  # system site-packages; pip's cache reused) and run the README's quickstart from it
  local venv=$1 root=$PWD dist=$PWD/dist clean=$PWD/.venv-wheel tmp rc=0
  echo "== built artifacts: sdist, wheel, the README's quickstart from the wheel"
  rm -rf "$dist" "$clean"
  "$venv/bin/python" -m build --outdir "$dist" . >"$LOGS/build.log" 2>&1 \
    || { tail -40 "$LOGS/build.log"; return 1; }
  "$venv/bin/twine" check --strict "$dist"/* || return $?
  "$venv/bin/python" - "$dist" <<'PYEOF' || return $?
import sys, tarfile, zipfile
from pathlib import Path
dist = Path(sys.argv[1])
(wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
names = zipfile.ZipFile(wheel).namelist()
for want in (".dist-info/licenses/LICENSE", "jaxexp_mlflow/py.typed", "jaxexp_mlflow/data/"):
    assert any(want in n for n in names), f"{wheel.name} lacks {want}"
top = sdist.name[: -len(".tar.gz")]
members = set(tarfile.open(sdist).getnames())
for want in ("LICENSE", "README.md", "pyproject.toml", "jaxexp_mlflow/py.typed"):
    assert f"{top}/{want}" in members, f"{sdist.name} lacks {want}"
print(f"  {wheel.name} and {sdist.name} hold LICENSE and py.typed")
PYEOF
  "$venv/bin/python" -m venv "$clean" || return $?
  "$clean/bin/python" -m pip install -q "$dist"/*.whl "jax==0.10.2" "jaxlib==0.10.2" \
    "mlflow==3.17.2" || return $?
  tmp=$(mktemp -d)
  (cd "$tmp" && env -u PYTHONPATH -u MLFLOW_TRACKING_URI "$clean/bin/python" \
    "$root/scripts/readme_quickstart.py" "$root/README.md" --installed) || rc=$?
  rm -rf "$tmp"
  return "$rc"
}

step() {  # step <label> <command...>: run one step of the current stage, print its time; its status
  local label=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  echo "-- ${STAGE:-?} / $label: $((SECONDS - t0)) s$([ "$rc" = 0 ] || echo ", FAILED (status $rc)")"
  printf '%s\t%s\t%s\t%s\n' "${STAGE:-?}" "$label" "$((SECONDS - t0))" "$rc" >>"$JAXEXP_STEPS"
  return "$rc"
}

bytecode() {  # bytecode <venv>: compile the checkout's modules once for <venv>'s Python. Where
  # PYTHONDONTWRITEBYTECODE is set (CI's machines) Python never writes what it compiles as it
  # imports, and every child process of the suite would compile the package anew
  "$1/bin/python" -m compileall -q jaxexp_mlflow benchmarks tests/*.py
}

versions() {  # versions <venv>: what the stage resolved, for the log
  "$1/bin/python" - <<'EOF'
import sys
from importlib.metadata import version
pkgs = ("jax", "jaxlib", "mlflow", "mlflow-skinny", "orbax-checkpoint", "numpy")
print(f"  python {sys.version.split()[0]}: " + ", ".join(f"{p} {version(p)}" for p in pkgs))
EOF
}

run_stage() {  # run_stage <name> [pytest args...]: set up and test one stage; its status
  local s=$1 rc
  shift
  case $s in
    main)
      echo "== stage main: Python 3.11 + the frozen stack"
      STAGE=main
      step "venv" setup "$PY" .venv -e ".[test,iree,spark]" --group test "jax==0.10.2" \
        "jaxlib==0.10.2" "mlflow==3.17.2" || return $?
      versions .venv || return $?
      step "bytecode" bytecode .venv || return $?
      rc=0
      step "ruff" .venv/bin/ruff check jaxexp_mlflow tests benchmarks examples scripts || rc=$?
      # text that tells how the project was made (sessions, clock times, issue numbers) fails
      step "prose" .venv/bin/python scripts/check_prose.py || rc=$?
      # `mlflow models serve` and `jaxexp` come from the venv
      PATH="$PWD/.venv/bin:$PATH" step "default suite" .venv/bin/pytest "${PYTEST_OPTS[@]}" "$@" \
        || rc=$?
      # a real Spark standalone cluster (master + worker on 127.0.0.1; needs Java 17), unless
      # pytest arguments picked other tests
      if [ $# -eq 0 ] && command -v java >/dev/null; then
        PATH="$PWD/.venv/bin:$PATH" step "spark cluster" .venv/bin/pytest "${PYTEST_OPTS[@]}" \
          -m slow tests/serving/test_spark_cluster.py || rc=$?
      fi
      # what a user installs: the built sdist and wheel, checked and run outside the checkout
      if [ $# -eq 0 ]; then
        step "built artifacts" artifacts .venv || rc=$?
      fi
      return "$rc"
      ;;
    newest)
      echo "== stage newest: Python 3.13 + the newest releases, resolved now"
      PY313=$(bash scripts/python313.sh) || return $?
      rc=0
      if [ "$PY313" = "$PWD/scripts/in_trixie.sh" ]; then
        # no host CPython 3.13: run this stage inside the Debian 13 root
        IN_TRIXIE_CMD=/bin/bash JAXEXP_STAGES=newest-here JAXEXP_CI_LOGS=.ci-logs/inner PARALLEL=0 \
          PYTHON=/usr/bin/python3.13 JAXEXP_NEWEST_VENV=.venv-trixie bash scripts/in_trixie.sh scripts/test.sh "$@" || rc=$?
      else
        PYTHON=$PY313 JAXEXP_STAGES=newest-here JAXEXP_CI_LOGS=.ci-logs/inner PARALLEL=0 \
          bash scripts/test.sh "$@" || rc=$?
      fi
      return "$rc"
      ;;
    newest-here)  # the newest stage, with $PYTHON a CPython 3.13
      venv=${JAXEXP_NEWEST_VENV:-.venv-newest}
      STAGE=newest
      step "venv" setup "$PY" "$venv" --upgrade -e ".[test,iree]" --group test jax jaxlib mlflow \
        orbax-checkpoint || return $?
      versions "$venv" || return $?
      step "bytecode" bytecode "$venv" || return $?
      # installing the package into this environment (newest jax) changes no JAX version
      "$venv/bin/python" -m pip install -q --dry-run --report "$venv/install-report.json" -e . \
        || return $?
      "$venv/bin/python" - "$venv/install-report.json" <<'EOF' || return $?
import json, sys
names = {i["metadata"]["name"].lower() for i in json.load(open(sys.argv[1]))["install"]}
assert not names & {"jax", "jaxlib"}, f"installing jaxexp-mlflow would change {names}"
print("  pip install -e . beside this stack changes no JAX version")
EOF
      rc=0
      PATH="$PWD/$venv/bin:$PATH" step "default suite" "$venv/bin/pytest" "${PYTEST_OPTS[@]}" "$@" \
        || rc=$?
      # the GPU suite rehearsed on this CPU (its tests skip above without an accelerator), so
      # that it still runs the day a GPU is lent (scripts/gpu_suite.sh; docs/hardware.md)
      if [ $# -eq 0 ]; then
        JAXEXP_GPU_TESTS_ON_CPU=1 PATH="$PWD/$venv/bin:$PATH" step "GPU suite on the CPU" \
          "$venv/bin/pytest" "${PYTEST_OPTS[@]}" -m gpu tests/e2e/test_gpu.py || rc=$?
      fi
      exit "$rc"
      ;;
    oldest)
      echo "== stage oldest: jax 0.6.2"
      STAGE=oldest
      step "venv" setup "$PY" .venv-oldest -e . "jax==0.6.2" "jaxlib==0.6.2" "mlflow==3.17.2" \
        pytest hypothesis || return $?
      versions .venv-oldest || return $?
      step "bytecode" bytecode .venv-oldest || return $?
      rc=0
      PATH="$PWD/.venv-oldest/bin:$PATH" step "flavor and params tests" .venv-oldest/bin/pytest \
        "${PYTEST_OPTS[@]}" tests/flavors/test_flavor.py tests/params/test_params.py \
        tests/internals/test_jax_private.py || rc=$?

      return "$rc"
      ;;
    docs)
      echo "== stage docs: the documentation site"
      STAGE=docs
      # strict: broken links and references fail it
      step "docs site" bash scripts/docs.sh .venv-docs
      ;;
    *) echo "unknown stage $s" >&2; return 2 ;;
  esac
}

LOGS=${JAXEXP_CI_LOGS:-.ci-logs}
mkdir -p "$LOGS"
# every step's time, of every stage (the nested newest-here run appends to the same file)
if [ -z "${JAXEXP_STEPS:-}" ]; then
  export JAXEXP_STEPS=$PWD/$LOGS/steps.tsv
  : >"$JAXEXP_STEPS"
fi
run_logged() {  # run_logged <stage> [pytest args...]: one stage in a subshell; prints its verdict
  local s=$1 t0 rc=0
  t0=$(date +%s)
  if [ "${PARALLEL:-0}" = 1 ]; then
    ( run_stage "$@" ) >"$LOGS/$s.log" 2>&1 || rc=$?
    { flock 9; cat "$LOGS/$s.log"; } 9>"$LOGS/.print"
  else
    ( run_stage "$@" ) || rc=$?
  fi
  echo "== stage $s: $([ "$rc" = 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - t0 )) s"
  echo "$rc" >"$LOGS/$s.rc"
}
run_all() {  # run_all <stages> [pytest args...]: stages one after the other
  local stages=$1 s
  shift
  for s in $stages; do run_logged "$s" "$@"; done
}

rm -f "$LOGS"/*.rc
case " $STAGES " in
  *" newest "*)
    if [ "${JAXEXP_PARALLEL:-1}" = 1 ] && [ "$(echo $STAGES | wc -w)" -gt 1 ]; then
      echo "== two lanes: main, and newest then the other stages (logs: $LOGS/)"
      other=" $STAGES "
      other=${other// newest / }
      PARALLEL=1 run_all "newest${other// main / }" "$@" &
      case " $STAGES " in *" main "*) PARALLEL=1 run_all main "$@" ;; esac
      wait
    else
      run_all "$STAGES" "$@"
    fi
    ;;
  *) run_all "$STAGES" "$@" ;;
esac

if [ "$JAXEXP_STEPS" = "$PWD/$LOGS/steps.tsv" ] && [ -s "$JAXEXP_STEPS" ]; then
  echo "== time per step (s)"
  awk -F'\t' '{ printf "  %-7s %-26s %5d%s\n", $1, $2, $3, ($4 == 0 ? "" : "  FAILED") }' "$JAXEXP_STEPS"
fi
failed=()
for s in $STAGES; do
  [ "$(cat "$LOGS/$s.rc" 2>/dev/null || echo 1)" = 0 ] || failed+=("$s")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED stages: ${failed[*]}"
  exit 1
fi
