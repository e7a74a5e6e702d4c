"""The old module paths (issue 40's layout) stay importable as deprecated aliases."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxexp_mlflow._moved import MOVED

# what a user or a saved model names by its old path, and must keep working
NAMED = {
    "jaxexp_mlflow.mlserver_runtime": "JaxExpRuntime",  # MLServer's model-settings
    "jaxexp_mlflow.spark": "predict",  # docs/serving.md
    "jaxexp_mlflow.reexport": "refresh",  # jaxexp_mlflow.refresh
}

CHILD = r"""
import importlib, json, sys, warnings
old, new, name = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
try:
    fresh = importlib.import_module(new)
except ImportError as err:  # an optional extra (mlserver) not installed here
    out["new_error"] = err.name
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        module = importlib.import_module(old)
        out["same"] = module is sys.modules[new] and sys.modules[old] is module
        out["attr"] = hasattr(module, name) if name else None
    except ImportError as err:
        out["old_error"] = err.name
out["warned"] = [str(w.message) for w in caught if w.category is DeprecationWarning]
out["where"] = [w.filename for w in caught if w.category is DeprecationWarning]
print(json.dumps(out))
"""


def _child(old: str, new: str, name: str) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, old, new, name],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_old_path_is_the_new_module_with_a_deprecation_warning():
    for old, new in MOVED.items():
        got = _child(old, new, NAMED.get(old, ""))
        if "new_error" in got:  # both paths fail alike without the optional extra
            assert got.get("old_error") == got["new_error"], (old, got)
            continue
        assert got["same"] is True, (old, got)
        assert any(old in w and new in w for w in got["warned"]), (old, got)
        assert got["where"][0] == "<string>", (old, got)  # the importing line, not importlib
        if old in NAMED:
            assert got["attr"] is True, (old, got)


def test_documented_paths_keep_working():
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import jaxexp_mlflow, mlflow\n"
        "from jaxexp_mlflow.flavors.refresh import refresh\n"
        "assert jaxexp_mlflow.refresh is refresh\n"
        "import mlflow.jaxexp\n"
        "assert mlflow.jaxexp.load_model.__module__ == 'jaxexp_mlflow.flavors.jaxexp'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "ok"
