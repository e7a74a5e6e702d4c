"""Spark ``spark_udf`` throughput for a jaxexp model, against in-process pyfunc on the same data.

Scores ``--rows`` rows (default 1M; ``--quick``: 20k) of 8 float features split over
``--partitions`` partitions on a local Spark session (``local[2]``: this machine's 2 cores), with
the default ``result_type`` (``array<float>`` from the per-row output schema) and
``env_manager="local"``, and reports rows/s beside ``mlflow.pyfunc.load_model(...).predict`` on
the same rows in one process (batches of 10k, the size of Spark's Arrow batches). Needs the
``spark`` extra and Java 17; Spark's Python workers are the ``python3`` on PATH (the venv's).

    python benchmarks/bench_spark.py [--quick] [--rows N] [--partitions P] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pyfunc import apply, make_params  # noqa: E402

WIDTHS = (8, 16, 4)
ARROW_BATCH = 10_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20k rows")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    rows = 20_000 if args.quick else args.rows
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]

    import mlflow

    try:
        from pyspark.sql import SparkSession
    except ImportError:
        print("skipped: pyspark is not installed (pip install -e '.[spark]')")
        return 0
    from pyspark.sql import functions as F  # noqa: N812

    import jaxexp_mlflow  # noqa: F401

    tmp = Path(tempfile.mkdtemp(prefix="jaxexp-bench-spark-"))
    os.environ["JAXEXP_COMPILATION_CACHE"] = str(tmp / "xla")
    params = make_params(WIDTHS)
    model_dir = tmp / "model"
    example = np.zeros((2, WIDTHS[0]), "f4")
    mlflow.jaxexp.save_model(jax.jit(apply), model_dir, params=params, input_example=example)
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(ARROW_BATCH))
        .config("spark.driver.memory", "3g")
        .getOrCreate()
    )
    try:
        cols = [F.rand(seed).cast("float") for seed in range(WIDTHS[0])]
        df = spark.range(rows, numPartitions=args.partitions).select(F.array(*cols).alias("x"))
        df = df.cache()
        frame = df.toPandas()  # the same rows for the in-process baseline
        udf = mlflow.pyfunc.spark_udf(spark, str(model_dir), env_manager="local")
        df.limit(10).select(udf("x")).collect()  # warm the driver side
        t0 = time.perf_counter()
        scored = df.select(udf("x").alias("y")).toPandas()
        spark_s = time.perf_counter() - t0
    finally:
        spark.stop()

    model = mlflow.pyfunc.load_model(str(model_dir))
    model.predict(frame[:ARROW_BATCH])  # warm (buckets compiled at load)
    t0 = time.perf_counter()
    local = [model.predict(frame[i : i + ARROW_BATCH]) for i in range(0, rows, ARROW_BATCH)]
    pyfunc_s = time.perf_counter() - t0
    want = np.concatenate(local)
    got = np.asarray(scored["y"].tolist(), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    results = {
        "jax": jax.__version__,
        "model": f"mlp-{'-'.join(map(str, WIDTHS))}",
        "n_rows": rows,
        "partitions": args.partitions,
        "spark_rows_per_s": round(rows / spark_s),
        "pyfunc_rows_per_s": round(rows / pyfunc_s),
    }
    results["ratio"] = round(results["spark_rows_per_s"] / results["pyfunc_rows_per_s"], 3)
    print(
        f"{rows} rows, {args.partitions} partitions: spark_udf {results['spark_rows_per_s']} "
        f"rows/s, in-process pyfunc {results['pyfunc_rows_per_s']} rows/s, ratio "
        f"{results['ratio']}"
    )
    if args.json:
        results["rows"] = [
            {
                "figure": f"spark_udf rows/s ({rows} rows, {args.partitions} partitions)",
                "value": results["spark_rows_per_s"],
                "baseline_name": "in-process pyfunc rows/s",
                "baseline": results["pyfunc_rows_per_s"],
                "ratio": results["ratio"],
                "goal": "reported",
            }
        ]
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
