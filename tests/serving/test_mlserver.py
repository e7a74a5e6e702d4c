"""MLServer (the V2 inference protocol of KServe / Seldon) serves a jaxexp model.

MLflow 3.17 no longer has ``mlflow models serve --enable-mlserver``; what that flag ran is
MLServer with the ``mlserver_mlflow.MLflowRuntime`` runtime, which is what KServe and Seldon
run for MLflow models, so the test starts exactly that: ``mlserver start`` on a model-settings
file pointing at the model directory. mlserver/mlserver-mlflow pin older fastapi, starlette,
protobuf and ml_dtypes than the project's environment, so they live in their own venv
``.venv-mlserver`` (``bash scripts/mlserver_env.sh``); the test is skipped without it. Slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import mlflow
import numpy as np
import pytest
import requests

import jaxexp_mlflow  # noqa: F401
from tests.models import mlp_params, two_input_example, two_input_fn
from tests.servers import MODEL_NAME, OURS, STOCK, start_mlserver, stop_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_mlserver  # noqa: E402


def v2_body(data: dict) -> dict:
    """A V2 inference request with one tensor per input (numpy's default dtypes)."""
    kinds = {"i": "INT64", "f": "FP64"}
    inputs = []
    for name, value in data.items():
        arr = np.asarray(value)
        arr = arr.astype(np.int64 if arr.dtype.kind == "i" else np.float64)
        inputs.append(
            {
                "name": name,
                "shape": list(arr.shape),
                "datatype": kinds[arr.dtype.kind],
                "data": arr.reshape(-1).tolist(),
            }
        )
    return {"inputs": inputs}


# The stock runtime (STOCK) no longer loads a jaxexp model: it reads the MLflow signature's
# inputs, which a jaxexp model does not declare (MLflow then hands inputs over
# unchanged at every door); JaxExpRuntime gives it the inputs from jaxexp.io
# (docs/serving/mlserver.md).
# workers: the model in MLServer's own process (0) or in one spawned worker (1, MLServer's default)
@pytest.mark.parametrize("runtime", [OURS])
@pytest.mark.parametrize("workers", [0, 1])
def test_v2_inference_on_mlserver(tmp_path, runtime, workers):
    params = mlp_params()
    model_dir = tmp_path / "model"
    mlflow.jaxexp.save_model(
        jax.jit(two_input_fn), model_dir, params=params, input_example=two_input_example()
    )
    proc, url = start_mlserver(model_dir, tmp_path / "mlserver", runtime, workers)
    try:
        inp = two_input_example(4)
        want = jax.tree.map(np.asarray, two_input_fn(params, inp))
        r = requests.post(f"{url}/v2/models/{MODEL_NAME}/infer", json=v2_body(inp), timeout=60)
        assert r.status_code == 200, r.text[:1000]
        outs = {o["name"]: o for o in r.json()["outputs"]}
        got = np.asarray(outs["logits"]["data"], np.float32).reshape(outs["logits"]["shape"])
        np.testing.assert_allclose(got, want["logits"], rtol=1e-5, atol=1e-6)
        got = np.asarray(outs["score"]["data"], np.float32).reshape(outs["score"]["shape"])
        np.testing.assert_allclose(got.reshape(-1), want["score"], rtol=1e-5, atol=1e-5)
        bad = {"ids": [1.5, 2.0, 3.0, 4.0], "x": inp["x"]}  # a float into the int32 input
        r = requests.post(f"{url}/v2/models/{MODEL_NAME}/infer", json=v2_body(bad), timeout=60)
        assert r.status_code == 400, (r.status_code, r.text[:1000])
        assert "Floats are not cast" in r.text and len(r.text) < 500, r.text[:1000]
    finally:
        stop_server(proc)


def test_stock_runtime_cannot_load_a_model_without_input_schema(tmp_path):
    """The cost docs/serving/pyfunc-rest.md states ("Why the MLflow signature declares no inputs"):
    MLServer's stock ``MLflowRuntime`` reads ``signature.inputs`` in ``_sync_metadata`` and fails
    to load a jaxexp model, whose signature declares outputs only. A sentinel: when
    mlserver-mlflow loads such a model, the docs are to be updated."""
    if not (bench_mlserver.MLSERVER_BIN / "mlserver").exists():
        pytest.skip("no .venv-mlserver (bash scripts/mlserver_env.sh)")
    model_dir = tmp_path / "model"
    mlflow.jaxexp.save_model(
        jax.jit(two_input_fn), model_dir, params=mlp_params(), input_example=two_input_example()
    )
    work = tmp_path / "mlserver"
    work.mkdir()
    free = bench_mlserver.free_port
    http = free()
    settings = {"host": "127.0.0.1", "http_port": http, "grpc_port": free()}
    settings.update(metrics_port=free(), parallel_workers=0)
    (work / "settings.json").write_text(json.dumps(settings))
    spec = {"name": MODEL_NAME, "implementation": STOCK, "parameters": {"uri": str(model_dir)}}
    (work / "model-settings.json").write_text(json.dumps(spec))
    log = work / "mlserver.log"
    env = {**os.environ, "PATH": f"{bench_mlserver.MLSERVER_BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(
        [str(bench_mlserver.MLSERVER_BIN / "mlserver"), "start", str(work)],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ready_url = f"http://127.0.0.1:{http}/v2/models/{MODEL_NAME}/ready"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and "has no attribute 'inputs'" not in log.read_text():
            try:
                ready = requests.get(ready_url, timeout=5).status_code == 200
            except requests.RequestException:
                ready = False
            assert not ready, "the stock runtime loaded a model without an input schema"
            time.sleep(1)
        assert "AttributeError: 'NoneType' object has no attribute 'inputs'" in log.read_text()
    finally:
        stop_server(proc)


# What `mlserver start` imports before it loads models (its main process, `parallel_workers: 0`)
# and what a spawned MLServer worker imports (`parallel_workers` > 0), then the same load.
WORKER_CHILD = r"""
import importlib, json, os, sys
import numpy as np
importlib.import_module(sys.argv[2])
import mlflow.pyfunc
model = mlflow.pyfunc.load_model(sys.argv[1])
from jaxexp_mlflow.serving.pyfunc import impl_for
impl = impl_for(model.metadata)
x = np.asarray(json.loads(sys.argv[3]), np.float32)
y = model.predict(x)
from jaxexp_mlflow.runtime.dispatch import inline_now
print("RESULT " + json.dumps({
    "background": impl.policy.background,
    "precompiling": impl._precompiling is not None,
    "inline": inline_now(),
    "y": np.asarray(y).tolist(),
}), flush=True)
os._exit(0)  # skip waiting for the buckets still compiling (background.py)
"""


@pytest.mark.parametrize("module", ["mlserver.server", "mlserver.parallel.worker"])
def test_an_mlserver_process_loads_as_a_scoring_server(mlp_dir, module):
    """A model loaded by MLServer gets what `mlflow models serve` gets: every bucket compiled in
    the background at load (no request compiles), CPU computations on the calling thread."""
    from tests.conftest import result_of
    from tests.models import batch, mlp_apply

    python = bench_mlserver.MLSERVER_BIN / "python"
    if not python.exists():
        pytest.skip("no .venv-mlserver (bash scripts/mlserver_env.sh)")
    path, params = mlp_dir
    x = batch(3)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXEXP_LITE": "0"}
    env.pop("JAXEXP_CPU_INLINE", None)
    proc = subprocess.run(
        [str(python), "-c", WORKER_CHILD, str(path), module, json.dumps(x.tolist())],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    got = result_of(proc)
    assert got["background"] and got["precompiling"] and got["inline"], got
    want = np.asarray(mlp_apply(params, x))
    np.testing.assert_allclose(np.asarray(got["y"]), want, rtol=1e-5, atol=1e-6)
