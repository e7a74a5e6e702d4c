"""What the model-family examples share: the MLflow store, the fresh-process reload, the report.

The reload runs in a new interpreter where importing Flax or Equinox fails: a logged model needs
neither to load (its params are a flat dict of named arrays, see docs/model-families.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlflow
import numpy as np

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)

RELOAD = """
import sys, json
sys.modules["flax"] = None; sys.modules["equinox"] = None  # prove neither is needed
import numpy as np, mlflow, jaxexp_mlflow
model = mlflow.jaxexp.load_model(sys.argv[1])
np.save(sys.argv[3], np.asarray(model(np.load(sys.argv[2]))))
served = mlflow.pyfunc.load_model(sys.argv[1]).predict(np.load(sys.argv[2]))
np.save(sys.argv[4], np.asarray(served))
print(json.dumps(list(model.params)))
"""


def use_store(experiment: str = "jaxexp-families") -> None:
    """A local sqlite MLflow store under the working directory, unless MLFLOW_TRACKING_URI is
    set."""
    if "MLFLOW_TRACKING_URI" not in os.environ:
        mlflow.set_tracking_uri(f"sqlite:///{Path('mlruns.db').resolve()}")
    if mlflow.get_experiment_by_name(experiment) is None:
        mlflow.create_experiment(
            experiment, artifact_location=Path("mlartifacts").resolve().as_uri()
        )
    mlflow.set_experiment(experiment)


def reload_and_compare(model_uri: str, probe: np.ndarray, expected: np.ndarray) -> int:
    """Load ``model_uri`` in a fresh process (load_model and pyfunc), compare with ``expected``;
    print the params names and the verdict; 0 when both match."""
    with tempfile.TemporaryDirectory() as tmp:
        files = [str(Path(tmp, n)) for n in ("probe.npy", "loaded.npy", "served.npy")]
        np.save(files[0], probe)
        env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}
        proc = subprocess.run(
            [sys.executable, "-c", RELOAD, model_uri, *files],
            check=True,
            env=env,
            capture_output=True,
            text=True,
        )
        names = json.loads(proc.stdout.strip().splitlines()[-1])
        loaded, served = np.load(files[1]), np.load(files[2])
    err = float(max(np.max(np.abs(loaded - expected)), np.max(np.abs(served - expected))))
    ok = np.allclose(loaded, expected, rtol=1e-5, atol=1e-5) and np.allclose(
        served, expected, rtol=1e-5, atol=1e-5
    )
    print(f"params names: {', '.join(names)}")
    print(
        f"fresh-process reload (no flax/equinox importable): max abs difference {err:.2e} over "
        f"{probe.shape[0]} rows -> {'MATCH' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1
