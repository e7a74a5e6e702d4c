"""Serving processes against hostile requests and model configs.

* Defect 4: a small REST body must not cost a large allocation. ``dataframe_records`` rows were
  widened to the first record's keys and a CSV header widened every short row, so ~270 kB grew
  the server by gigabytes; both are now refused by their width before anything is
  widened (a real server, its RSS watched while the request runs).
* Defects 6 and 7: MLmodel's ``python_function.config`` (MLflow passes it to the loader as the
  ``model_config`` defaults) went around the flavor section's checks: it chose the compilation
  cache, the IREE cache and the backend, and bypassed every bound (``max_batch: 2**40``). It is
  now validated like the flavor section; loading such a model is an ``ArtifactError`` naming the
  key. The user's own ``model_config=`` keeps working.
* Defect 10: MLServer with ``JaxExpRuntime`` answers every client-input error (declared shape
  not matching the data, 50-digit integers, an unsupported content type) with a short 4xx, no
  traceback, no install paths.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import mlflow
import numpy as np
import psutil
import pytest
import requests
import yaml

import jaxexp_mlflow  # noqa: F401
from tests.models import batch, export_mlp, mlp_apply, mlp_params
from tests.servers import server_env, start_jaxexp_server, stop_server, tree_rss

REPO = Path(__file__).resolve().parents[2]
RSS_BOUND_MB = 100
ANSWER_WITHIN_S = 5.0

# -- defect 4: a small body never costs a large allocation ----------------------------------------


def _hostile_records() -> bytes:
    """~270 kB of ``dataframe_records``: a first record of 12 000 keys, then 28 000 ``{}``."""
    first = "{" + ", ".join(f'"c{i:05d}": 0' for i in range(12_000)) + "}"
    body = '{"dataframe_records": [' + first + ", {}" * 28_000 + "]}"
    return body.encode()


def _hostile_csv() -> bytes:
    """~270 kB of CSV: a header of 4 000 columns, then 120 000 one-cell rows."""
    header = ",".join(f"c{i:04d}" for i in range(4_000))
    return (header + "\n" + "1\n" * 120_000).encode()


@pytest.fixture(scope="module")
def served_mlp(tmp_path_factory):
    """The single-input MLP (``x: float32[-1, 8]``) served by ``jaxexp serve``, one server for
    the module's hostile bodies (each measured from the server's RSS when it is sent)."""
    tmp_path = tmp_path_factory.mktemp("served-mlp")
    params = mlp_params()
    model_dir = tmp_path / "mlp"
    mlflow.jaxexp.save_model(
        export_mlp(params),
        model_dir,
        params=params,
        input_example=batch(2),
        serving_config={"buckets": [1, 8]},
    )
    proc, url = start_jaxexp_server(str(model_dir), server_env(tmp_path), tmp_path / "log")
    tree = psutil.Process(proc.pid).children(recursive=True)
    try:
        yield url, proc, params
    finally:
        stop_server(proc)
        for child in tree:  # a worker stuck in a long computation ignores SIGTERM
            with contextlib.suppress(psutil.Error):
                child.kill()


def _post_watching_rss(url: str, proc, body: bytes, content_type: str) -> tuple:
    """POST ``body`` while sampling the server's RSS; (response or None, seconds, peak MB)."""
    result: dict = {}

    def send() -> None:
        try:
            result["r"] = requests.post(
                f"{url}/invocations",
                data=body,
                headers={"Content-Type": content_type},
                timeout=60,
            )
        except requests.RequestException as err:
            result["err"] = err

    base = tree_rss(proc.pid)
    peak = base
    start = time.monotonic()
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    while thread.is_alive() and time.monotonic() - start < 3 * ANSWER_WITHIN_S:
        peak = max(peak, tree_rss(proc.pid))
        if peak - base > 4 * RSS_BOUND_MB * 2**20:
            break  # growing without bound (the defect): stop watching, the fixture kills it
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    peak = max(peak, tree_rss(proc.pid))
    return result.get("r"), elapsed, (peak - base) / 2**20


@pytest.mark.parametrize(
    ("body", "content_type"),
    [(_hostile_records, "application/json"), (_hostile_csv, "text/csv")],
    ids=["dataframe_records", "csv"],
)
def test_small_hostile_body_is_refused_fast_without_allocation(served_mlp, body, content_type):
    url, proc, params = served_mlp
    data = body()
    assert 250_000 < len(data) < 300_000
    r, elapsed, grown_mb = _post_watching_rss(url, proc, data, content_type)
    assert r is not None, f"no answer within {elapsed:.1f} s; server grew by {grown_mb:.0f} MB"
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert elapsed < ANSWER_WITHIN_S, f"answered in {elapsed:.1f} s"
    assert grown_mb < RSS_BOUND_MB, f"server RSS grew by {grown_mb:.0f} MB"
    message = r.json()["message"]
    assert "expected" in message.lower() and "found" in message.lower(), message
    assert len(message) < 1000, message
    # still serving, with the numbers of the in-process model
    x = batch(3)
    rows = [{f"f{j}": float(v) for j, v in enumerate(row)} for row in x]
    good = requests.post(f"{url}/invocations", json={"dataframe_records": rows}, timeout=60)
    assert good.status_code == 200, good.text[:500]
    want = np.asarray(mlp_apply(params, x))
    np.testing.assert_allclose(np.asarray(good.json()["predictions"]), want, rtol=1e-5)


# -- defects 6 and 7: python_function.config is validated like the flavor section ----------------


CASES = {
    # defect 6: keys only the user loading the model may set
    "compilation_cache": {"compilation_cache": "MODEL_DIR/cache"},
    "iree_cache": {"iree_cache": "MODEL_DIR/iree"},
    "backend": {"backend": "iree"},
    # defect 7: the bounds of the flavor section
    "max_batch": {"max_batch": 2**40, "precompile": False},
    "max_request_bytes": {"max_request_bytes": 2**50},
    "buckets": {"buckets": list(range(1, 1001)), "precompile": False},
}
ACCEPTED = {
    "within_bounds": {"max_batch": 8, "buckets": "1,2,4", "allow_nan": True},
}

_LOADER = textwrap.dedent(
    """
    import json, sys
    import mlflow
    out = {}
    for name, path, config in json.loads(sys.argv[1]):
        try:
            mlflow.pyfunc.load_model(path, model_config=config)
            out[name] = {"loaded": True}
        except Exception as err:
            out[name] = {"type": type(err).__name__, "message": str(err)[:2000]}
    print("RESULT " + json.dumps(out))
    """
)


def _with_pyfunc_config(src: Path, dst: Path, config: dict) -> Path:
    shutil.copytree(src, dst)
    meta = yaml.safe_load((dst / "MLmodel").read_text())
    values = {
        k: (v.replace("MODEL_DIR", str(dst)) if isinstance(v, str) else v)
        for k, v in config.items()
    }
    meta["flavors"]["python_function"]["config"].update(values)
    (dst / "MLmodel").write_text(yaml.safe_dump(meta))
    return dst


@pytest.fixture(scope="module")
def config_outcomes(tmp_path_factory):
    """Load every case with ``mlflow.pyfunc.load_model`` in one child process (bounded)."""
    tmp = tmp_path_factory.mktemp("pyfunc-config")
    params = mlp_params()
    clean = tmp / "clean"
    mlflow.jaxexp.save_model(
        export_mlp(params),
        clean,
        params=params,
        input_example=batch(2),
        serving_config={"buckets": [1, 2]},
    )
    jobs = [
        (name, str(_with_pyfunc_config(clean, tmp / name, cfg)), None)
        for name, cfg in {**CASES, **ACCEPTED}.items()
    ]
    # the user's own model_config at load time, on the clean model
    user = {"compilation_cache": str(tmp / "user-cache"), "max_batch": 4, "buckets": "pow2"}
    jobs.append(("user_model_config", str(clean), user))
    env = {**os.environ, "JAXEXP_COMPILATION_CACHE": str(tmp / "xla")}
    env.pop("MLFLOW_PYFUNC_INFERENCE_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-c", _LOADER, json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("key", ["compilation_cache", "iree_cache", "backend"])
def test_model_config_cannot_choose_caches_or_backend(config_outcomes, key):
    """Defect 6: the model directory may not set what only the loading user may choose."""
    out = config_outcomes[key]
    assert out.get("type") == "ArtifactError", out
    assert key in out["message"] and "model directory" in out["message"], out
    assert "load option" in out["message"] or "model_config" in out["message"], out


@pytest.mark.parametrize("key", ["max_batch", "max_request_bytes", "buckets"])
def test_model_config_is_bounded_like_the_flavor_section(config_outcomes, key):
    """Defect 7: python_function.config has the bounds of the flavor section."""
    out = config_outcomes[key]
    assert out.get("type") == "ArtifactError", out
    assert key in out["message"], out
    assert len(out["message"]) < 600, out


@pytest.mark.parametrize("case", ["within_bounds", "user_model_config"])
def test_valid_model_config_and_user_config_still_load(config_outcomes, case):
    assert config_outcomes[case].get("loaded"), config_outcomes[case]


# -- defect 10: MLServer answers client-input errors with a short 4xx ---------------------------


@pytest.fixture(scope="module")
def mlserver_url(tmp_path_factory):
    from tests.models import two_input_example, two_input_fn
    from tests.servers import OURS, start_mlserver

    tmp = tmp_path_factory.mktemp("mlserver-safety")
    model_dir = tmp / "model"
    # concrete shapes (batch 2): .venv-mlserver has jax 0.10.2, which cannot read the
    # batch-polymorphic blobs of newer jax (custom_call_v2) but runs their concrete ones
    mlflow.jaxexp.save_model(
        jax.jit(two_input_fn),
        model_dir,
        params=mlp_params(),
        input_example=two_input_example(2),
        batch_polymorphic=False,
    )
    proc, url = start_mlserver(model_dir, tmp / "mlserver", OURS)
    try:
        yield url
    finally:
        stop_server(proc)


def _v2(x_shape=(2, 8), x_data=None, ids=(1, 2), **extra) -> dict:
    x_data = x_data if x_data is not None else [0.5] * int(np.prod(x_shape))
    return {
        "inputs": [
            {"name": "x", "shape": list(x_shape), "datatype": "FP64", "data": x_data},
            {"name": "ids", "shape": [len(ids)], "datatype": "INT64", "data": list(ids)},
        ],
        **extra,
    }


MARK = 12345.678  # a value that must never come back in an error message


def _tensor(name: str, shape: list, datatype: str, data: list) -> dict:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


MLSERVER_CASES = {
    "declared_shape_mismatch": _v2(x_shape=(4, 8), x_data=[0.5] * 30),
    "fifty_digit_int": _v2(ids=(10**49, 2)),
    "content_type_pd": _v2(parameters={"content_type": "pd"}),
    # refused by the input contract (every door names expected and found)
    "float_into_int": {
        "inputs": [
            _tensor("x", [2, 8], "FP64", [MARK] * 16),
            _tensor("ids", [2], "FP64", [1.5, MARK]),
        ]
    },
    "wrong_width": {
        "inputs": [
            _tensor("x", [2, 7], "FP64", [MARK] * 14),
            _tensor("ids", [2], "INT64", [1, 2]),
        ]
    },
    "missing_input": {"inputs": [_tensor("x", [2, 8], "FP64", [MARK] * 16)]},
    "strings": {
        "inputs": [
            _tensor("x", [2, 8], "BYTES", ["a"] * 16),
            _tensor("ids", [2], "INT64", [1, 2]),
        ]
    },
}


@pytest.mark.parametrize("case", list(MLSERVER_CASES))
def test_mlserver_client_errors_are_short_4xx(mlserver_url, case):
    from tests.servers import MODEL_NAME

    infer = f"{mlserver_url}/v2/models/{MODEL_NAME}/infer"
    r = requests.post(infer, json=MLSERVER_CASES[case], timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:2000])
    assert "Traceback" not in r.text and "site-packages" not in r.text, r.text[:2000]
    assert str(REPO) not in r.text and ".py" not in r.text, r.text[:2000]
    assert len(r.content) < 1000, r.text[:2000]
    message = r.json()["error"].lower()
    assert "expected" in message and "found" in message, r.text[:2000]
    assert str(MARK) not in r.text and "0" * 20 not in r.text, r.text[:2000]
    good = requests.post(infer, json=_v2(), timeout=60)
    assert good.status_code == 200, good.text[:1000]
