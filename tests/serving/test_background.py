"""A process that exits while its server compiles buckets in the background ends cleanly
(``serving/background.py``): it used to abort inside XLA (SIGABRT, "FATAL: exception not
rethrown")."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = r"""
import sys
import numpy as np
import jaxexp_mlflow.serving.server  # noqa: F401 - a scoring server: buckets compile meanwhile
import mlflow.pyfunc
model = mlflow.pyfunc.load_model(sys.argv[1])
impl = model._model_impl
print("PRECOMPILING", impl._precompiling is not None and impl._precompiling.is_alive(), flush=True)
model.predict(np.ones((3, 8), np.float32))
"""  # and exits at once, mid-precompile


def test_exit_while_buckets_compile(mlp_dir):
    path, _ = mlp_dir
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXEXP_LITE": "0"}
    env["JAXEXP_COMPILATION_CACHE"] = "0"  # every bucket a real compile: still going at exit
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "PRECOMPILING True" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
