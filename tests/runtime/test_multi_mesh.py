"""Exports whose shardings use several meshes: JAX's own archived test data.

``export_with_multiple_meshes`` (jax/_src/internal_test_util/export_back_compat_test_data) is
``f(inputs, weights) = [x @ w for x, w in zip(inputs, weights)]`` exported for 2 devices with the
inputs on mesh ``('x1': 1, 'x2': 2)`` and the weights on mesh ``('y2': 2, 'y1': 1)``.
"""

from __future__ import annotations

import json

import mlflow
import pytest
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.cli import main
from jaxexp_mlflow.errors import IncompatibleError
from tests.backcompat import multi_mesh_blob
from tests.conftest import run_on_device_child

ON_TWO_DEVICES = """
import json, sys
import numpy as np
import mlflow
from click.testing import CliRunner
import jaxexp_mlflow
from jaxexp_mlflow.cli import main
from jax._src.internal_test_util.export_back_compat_test_data import (
    export_with_multiple_meshes as archive,
)
path = sys.argv[1]
rng = np.random.default_rng(0)
xs = tuple(rng.random((4, 8), dtype=np.float32) for _ in range(4))
ws = tuple(rng.random((8, 2), dtype=np.float32) for _ in range(4))
blob = bytes(archive.serializations[-1]["exported_serialized"])
mlflow.jaxexp.save_model(blob, path, input_example=(xs, ws))  # runs it to store the reference
check = CliRunner().invoke(main, ["check", path])
verify = CliRunner().invoke(main, ["verify", path])
model = mlflow.jaxexp.load_model(path)
outs = model(xs, ws)
errors = [float(np.abs(np.asarray(o) - x @ w).max()) for o, x, w in zip(outs, xs, ws)]
meshes = sorted({str(dict(zip(s.mesh.axis_names, s.mesh.devices.shape)))
                 for s in model.placement.in_shardings})
print("RESULT " + json.dumps({"check": [check.exit_code, check.output],
                              "verify": [verify.exit_code, verify.output],
                              "errors": errors, "meshes": meshes}))
"""


def test_multi_mesh_export_saves_checks_loads_and_runs_on_two_devices(tmp_path):
    multi_mesh_blob()
    res = run_on_device_child(ON_TWO_DEVICES, 2, str(tmp_path / "m"))
    assert res["check"][0] == 0 and "ok" in res["check"][1], res["check"][1]
    assert res["verify"][0] == 0, res["verify"][1]
    assert len(res["errors"]) == 4 and max(res["errors"]) < 1e-5
    assert res["meshes"] == ["{'x1': 1, 'x2': 2}", "{'y2': 2, 'y1': 1}"]


def test_multi_mesh_export_on_one_device_is_refused_consistently(tmp_path):
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(multi_mesh_blob(), path)  # stored; read back without placement
    result = CliRunner().invoke(main, ["check", "--json", str(path)])
    assert result.exit_code != 0
    assert json.loads(result.output)["status"] == "incompatible"
    with pytest.raises(IncompatibleError, match="2 devices"):
        mlflow.jaxexp.load_model(str(path))
