"""Spark's ``mlflow.pyfunc.spark_udf`` scores a jaxexp model with no JAX code on the Spark side.

Slow (a local Spark session starts a JVM); needs the ``spark`` extra (pyspark) and Java 17.
No ``result_type`` and no ``PYSPARK_PYTHON``: the default result type comes from the per-row
output schema, and Spark's Python workers are the ``python3`` on PATH (the venv's, as in an
activated venv or CI's ``scripts/test.sh``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401
from tests.models import batch, export_mlp, mlp_apply, mlp_params, two_input_example, two_input_fn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark():
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    if os.environ.get("PYSPARK_PYTHON"):
        pytest.skip("this test checks that PYSPARK_PYTHON is not needed")
    venv_bin = str(Path(sys.executable).parent)
    if not os.environ.get("PATH", "").startswith(venv_bin):
        pytest.skip("run with the venv's bin first on PATH (an activated venv)")
    session = (
        SparkSession.builder.master("local[2]")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    yield session
    session.stop()


def test_default_result_type_for_every_output_shape(spark, tmp_path):
    import mlflow
    import pandas as pd

    params = mlp_params()
    mlflow.jaxexp.save_model(export_mlp(params), tmp_path / "m", params=params)
    mlflow.jaxexp.save_model(
        jax.jit(two_input_fn),
        tmp_path / "two",
        params=params,
        input_example=two_input_example(),
    )
    x = batch(6, seed=4)
    df = spark.createDataFrame(pd.DataFrame({"x": [row.tolist() for row in x]}))
    udf = mlflow.pyfunc.spark_udf(spark, str(tmp_path / "m"), env_manager="local")
    got = np.asarray([r[0] for r in df.select(udf("x")).collect()], np.float32)  # array<float>
    np.testing.assert_allclose(got, mlp_apply(params, x), rtol=1e-5, atol=1e-6)

    inp = two_input_example(6)
    want = two_input_fn(params, inp)
    frame = pd.DataFrame({"ids": inp["ids"].astype(np.int64), "x": [r.tolist() for r in inp["x"]]})
    df2 = spark.createDataFrame(frame)  # ids arrive as int64 (Spark's long) for an int32 input
    udf2 = mlflow.pyfunc.spark_udf(spark, str(tmp_path / "two"), env_manager="local")
    rows = df2.select(udf2("ids", "x").alias("out")).collect()  # struct<logits, score>
    np.testing.assert_allclose([r.out.logits for r in rows], want["logits"], rtol=1e-5)
    np.testing.assert_allclose([r.out.score for r in rows], want["score"], rtol=1e-5)

    # a struct column reaches the model as a DataFrame with the struct's field names: inputs
    # by name, in any order, with no names passed (the signature declares no inputs)
    from mlflow.exceptions import MlflowException
    from pyspark.sql.functions import struct

    rows = df2.select(udf2(struct("x", "ids")).alias("out")).collect()
    np.testing.assert_allclose([r.out.score for r in rows], want["score"], rtol=1e-5)
    rows = df2.select(udf2(struct(*df2.columns)).alias("out")).collect()
    np.testing.assert_allclose([r.out.logits for r in rows], want["logits"], rtol=1e-5)
    with pytest.raises(MlflowException, match="zero columns"):
        udf2()  # the one form that needs an input schema (docs/serving/pyfunc-rest.md, "Signature")
