"""Exports that take no inputs: a function of params only, or of nothing at all.

JAX's own archived test modules are like this (``export_back_compat_test_data``: ``inputs=()``);
the QR case below is rebuilt from one and checked against its archived expected outputs.
"""

from __future__ import annotations

import jax
import jax.export  # jax < 0.8 does not import the submodule by itself
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)


def _archived_qr():
    try:
        from jax._src.internal_test_util.export_back_compat_test_data import (
            cpu_qr_lapack_geqrf as archive,
        )
    except ImportError:
        pytest.skip("this jax wheel has no archived QR test data")
    data = archive.data_2025_04_02["f32"]
    assert data["inputs"] == ()
    return data["expected_outputs"]


def qr():
    # the archived module's function: QR of iota(9).reshape(3, 3), no inputs
    return tuple(jnp.linalg.qr(jnp.arange(9, dtype=jnp.float32).reshape(3, 3)))


def test_function_of_nothing_saves_loads_runs_and_verifies(tmp_path):
    expected = _archived_qr()
    path = tmp_path / "qr"
    exported = jax.export.export(jax.jit(qr))()
    assert exported.in_avals == ()
    mlflow.jaxexp.save_model(exported, path, input_example=())
    model = mlflow.jaxexp.load_model(str(path))
    for got, want in zip(model(), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    pyfunc = mlflow.pyfunc.load_model(str(path))
    assert pyfunc.metadata.signature.inputs is None  # no inputs: MLflow has no empty Schema
    assert [s.name for s in pyfunc.metadata.signature.outputs.inputs] == ["0", "1"]
    for data in (None, {}):
        out = pyfunc.predict(data)
        np.testing.assert_allclose(out["0"], expected[0], rtol=1e-5, atol=1e-5)
    from jaxexp_mlflow.cli import main

    for command in ("verify", "check"):
        result = CliRunner().invoke(main, [command, str(path)])
        assert result.exit_code == 0, result.output


def test_function_of_params_only(tmp_path):
    params = {"w": jnp.arange(3.0), "scale": jnp.float32(2.0)}
    path = tmp_path / "p"
    mlflow.jaxexp.save_model(
        jax.jit(lambda p: p["w"] * p["scale"]), path, params=params, input_example=()
    )
    model = mlflow.jaxexp.load_model(str(path))
    np.testing.assert_allclose(model(), [0.0, 2.0, 4.0])
    assert np.asarray(mlflow.pyfunc.load_model(str(path)).predict(None)).tolist() == [0, 2, 4]
