"""Spark's ``mlflow.pyfunc.spark_udf`` scores a jaxexp model with no JAX code on the Spark side.

Slow (a local Spark session starts a JVM); needs pyspark (`pip install pyspark`) and Java.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401
from tests.models import batch, export_mlp, mlp_apply, mlp_params

pytestmark = pytest.mark.slow


def test_spark_udf_matches_in_process(tmp_path, monkeypatch):
    pyspark = pytest.importorskip("pyspark")
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)  # workers use this venv
    import mlflow
    import pandas as pd
    from pyspark.sql import SparkSession

    params = mlp_params()
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch(2))
    x = batch(6, seed=4)
    spark = (
        SparkSession.builder.master("local[1]")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    try:
        # one array-valued column per input, as Spark carries tensors
        df = spark.createDataFrame(pd.DataFrame({"x": [row.tolist() for row in x]}))
        udf = mlflow.pyfunc.spark_udf(
            spark, str(path), env_manager="local", result_type="array<float>"
        )
        got = np.asarray([r[0] for r in df.select(udf("x")).collect()], np.float32)
    finally:
        spark.stop()
    np.testing.assert_allclose(got, mlp_apply(params, x), rtol=1e-5, atol=1e-6)
    assert pyspark.__version__
