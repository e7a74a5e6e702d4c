#!/usr/bin/env bash
# Build the documentation site with strict checks (broken links and references fail it).
#
#   bash scripts/docs.sh [VENV]     # VENV: the docs tools' virtualenv (default .venv-docs)
#
# Installs the `docs` dependency group (mkdocs-material, mkdocstrings, mkdocs-click, ruff) into
# VENV (made if absent),
# then runs `mkdocs build --strict` into a temporary directory, removed afterwards. The API and
# command-line references are read from the source tree (PYTHONPATH): neither JAX nor MLflow
# needs to be installed in VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-docs}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# pip >= 25.1 installs PEP 735 dependency groups: the `docs` group of pyproject.toml
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "pip>=25.1"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --group docs
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$venv/bin/mkdocs" build --strict --site-dir "$site"
