"""``jaxexp_mlflow.serving.spark.predict`` and ``spark_udf`` on a real Spark standalone cluster.

Slow; needs the ``spark`` extra (pyspark) and Java 17. A master and one worker (2 cores) are
started from the pyspark package's ``spark-class`` on 127.0.0.1, each in its own process group
with its logs and work directory under the test's temporary directory; the driver connects with
``.master("spark://...")`` and the executor's Python workers run this venv's interpreter
(``PYSPARK_PYTHON``). Models are logged to a sqlite MLflow store and read back by ``runs:/`` URI,
so ``spark.predict`` ships them to the executor with ``SparkContext.addFile``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401
from tests.conftest import sqlite_uri
from tests.models import batch, mlp_apply, mlp_params, two_input_example, two_input_fn
from tests.servers import free_port

pytestmark = pytest.mark.slow

ROWS = 2000
PARTITIONS = 5
STARTUP_S = 90


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else f"({path}: no log)"


def _stop(proc: subprocess.Popen) -> None:
    """End ``proc`` and everything it started (its process group: JVM, executor, Python)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _alive_workers(webui: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{webui}/json/", timeout=2) as resp:
            state = json.load(resp)
    except (OSError, ValueError):
        return 0
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``(master URL, worker work dir)`` of a standalone master and one 2-core worker."""
    pytest.importorskip("pyspark")
    import pyspark

    root = tmp_path_factory.mktemp("spark-cluster")
    home = Path(pyspark.__file__).parent
    spark_class = home / "bin" / "spark-class"
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(root / "logs"),
        "SPARK_WORKER_DIR": str(root / "work"),
        "SPARK_LOCAL_DIRS": str(root / "local"),
        "PYSPARK_PYTHON": sys.executable,
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    }
    port, webui, worker_webui = free_port(), free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    logs = {"master": root / "master.log", "worker": root / "worker.log"}
    commands = {
        "master": [
            *("org.apache.spark.deploy.master.Master", "--host", "127.0.0.1"),
            *("--port", str(port), "--webui-port", str(webui)),
        ],
        "worker": [
            *("org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1"),
            *("--cores", "2", "--memory", "2g", "--webui-port", str(worker_webui)),
            *("--work-dir", str(root / "work")),
        ],
    }
    try:
        for name in ("master", "worker"):
            with logs[name].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [str(spark_class), *commands[name]],
                        env=env,
                        cwd=root,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group, killed at teardown
                    )
                )
        deadline = time.monotonic() + STARTUP_S
        while _alive_workers(webui) < 1:
            dead = [p.args[1] for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail(
                    f"the Spark worker did not register with {url} within {STARTUP_S} s "
                    f"(exited: {dead}).\nmaster log:\n{_tail(logs['master'])}\n"
                    f"worker log:\n{_tail(logs['worker'])}"
                )
            time.sleep(0.5)
        yield url, root / "work"
    finally:
        for proc in reversed(procs):  # the worker (and its executors) first
            _stop(proc)


@pytest.fixture(scope="module")
def spark(cluster, tmp_path_factory):
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is not None:
        pytest.skip("another SparkContext is active in this process")
    url, _ = cluster
    mp = pytest.MonkeyPatch()
    mp.setenv("PYSPARK_PYTHON", sys.executable)  # the executors' Python: this venv's
    mp.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    session = (
        SparkSession.builder.master(url)
        .appName("jaxexp-cluster-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.executor.memory", "1g")
        # a bad row fails the same way on every attempt: no retries (Spark's default is 4, each
        # in a fresh Python worker that imports JAX again)
        .config("spark.task.maxFailures", "1")
        .config("spark.local.dir", str(tmp_path_factory.mktemp("spark-driver")))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "300")  # several batches each
        .getOrCreate()
    )
    try:
        assert session.sparkContext.master == url
        yield session
    finally:
        session.stop()
        mp.undo()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``runs:/`` URIs of an MLP and of a two-input model logged to a sqlite MLflow store."""
    import mlflow

    tmp_path = tmp_path_factory.mktemp("mlflow")
    mlflow.set_tracking_uri(sqlite_uri(tmp_path / "m.db"))
    exp = mlflow.create_experiment("spark", artifact_location=(tmp_path / "artifacts").as_uri())
    params = mlp_params()
    try:
        with mlflow.start_run(experiment_id=exp):
            mlp = mlflow.jaxexp.log_model(
                jax.jit(mlp_apply), name="mlp", params=params, input_example=batch(2)
            )
            two = mlflow.jaxexp.log_model(
                jax.jit(two_input_fn),
                name="two",
                params=params,
                input_example=two_input_example(),
            )
        yield {"mlp": mlp.model_uri, "two": two.model_uri, "params": params}
    finally:
        mlflow.end_run()
        mlflow.set_tracking_uri(None)


def _rows_df(spark, x: np.ndarray):
    frame = [(i, row.tolist()) for i, row in enumerate(x)]
    return spark.createDataFrame(frame, "id long, x array<float>").repartition(PARTITIONS)


def test_predict_and_spark_udf_match_pyfunc(spark, cluster, models):
    import mlflow

    from jaxexp_mlflow.serving import spark as jspark

    x = batch(ROWS, seed=7)
    want = mlflow.pyfunc.load_model(models["mlp"]).predict(x)
    np.testing.assert_allclose(want, mlp_apply(models["params"], x), rtol=1e-5, atol=1e-6)
    df = _rows_df(spark, x)
    assert df.rdd.getNumPartitions() == PARTITIONS

    scored = jspark.predict(df, models["mlp"])
    assert scored.columns == ["id", "x", "prediction"]
    rows = sorted(scored.collect(), key=lambda r: r.id)
    assert [r.id for r in rows] == list(range(ROWS))
    got = np.asarray([r.prediction for r in rows], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    udf = mlflow.pyfunc.spark_udf(spark, models["mlp"], env_manager="local")
    rows = sorted(df.select("id", udf("x").alias("y")).collect(), key=lambda r: r.id)
    np.testing.assert_allclose(np.asarray([r.y for r in rows], np.float32), want, rtol=1e-5)

    # predict again on the same model: nothing shipped again, the workers keep their model
    again = jspark.predict(df.filter("id < 10"), models["mlp"], keep_columns=False)
    assert again.count() == 10
    # the executor ran on our worker and unpacked the model once, into its own files directory
    _, work = cluster
    unpacked = list(work.glob("app-*/*/*.jaxexp-model.d"))
    assert len(unpacked) == 1 and (unpacked[0] / "MLmodel").is_file(), unpacked
    assert not list(work.glob("app-*/*/MLmodel"))  # not untarred into the shared directory
    assert not list(work.glob("app-*/*/.*.jaxexp-model-*"))  # no staging left behind


def test_bad_rows_fail_with_the_input_contract(spark, models):
    import mlflow
    from pyspark.errors import PythonException

    from jaxexp_mlflow.errors import InputError
    from jaxexp_mlflow.serving import spark as jspark

    n = 40
    narrow = np.ones((n, 3), np.float32)  # 3 features for an input of 8
    with pytest.raises(InputError) as local:
        mlflow.pyfunc.load_model(models["mlp"]).predict(narrow)
    message = str(local.value)
    assert f"[{n},3]" in message
    # the same text, whatever number of rows the failing Arrow batch held
    pattern = re.escape(message).replace(re.escape(f"[{n},3]"), r"\[\d+,3\]")
    with pytest.raises(PythonException) as remote:
        jspark.predict(_rows_df(spark, narrow).coalesce(1), models["mlp"]).collect()
    assert re.search(pattern, str(remote.value)), str(remote.value)[-2000:]
    assert "jaxexp_mlflow.errors.InputError" in str(remote.value)

    ragged = spark.createDataFrame([(0, [1.0] * 8), (1, [1.0] * 3)], "id long, x array<float>")
    with pytest.raises(PythonException) as remote:
        jspark.predict(ragged.coalesce(1), models["mlp"]).collect()
    text = str(remote.value)
    assert "InputError: Input 'x': expected x: float32[-1,8], found rows of different" in text


def test_two_inputs_by_column_name(spark, models):
    import mlflow

    from jaxexp_mlflow.serving import spark as jspark

    inp = two_input_example(500)
    want = mlflow.pyfunc.load_model(models["two"]).predict(inp)
    np.testing.assert_allclose(want["score"], two_input_fn(models["params"], inp)["score"])
    # columns in another order than the inputs, an extra column, ids as Spark longs (int32 input)
    pairs = enumerate(zip(inp["x"], inp["ids"], strict=True))
    frame = [(float(i), r.tolist(), int(k)) for i, (r, k) in pairs]
    df = spark.createDataFrame(frame, "rank double, x array<float>, ids long").repartition(3)
    scored = jspark.predict(df, models["two"])
    assert scored.columns == ["rank", "x", "ids", "logits", "score"]
    rows = sorted(scored.collect(), key=lambda r: r["rank"])
    np.testing.assert_allclose([r.logits for r in rows], want["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r.score for r in rows], want["score"], rtol=1e-5, atol=1e-5)
