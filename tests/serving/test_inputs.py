"""One input contract at every door: the same table of cases through in-process
``pyfunc.predict``, ``jaxexp predict``, REST (``jaxexp serve``) and ``mlflow models
predict``; Spark and MLServer in their own (slow) tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pandas as pd
import pytest
import requests

import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.errors import InputError
from tests.conftest import run_cli
from tests.models import (
    batch,
    input_specs,
    log_two_input_model,
    mlp_apply,
    mlp_params,
    two_input_example,
    two_input_fn,
)
from tests.servers import start_jaxexp_server, stop_server

FAST = {"buckets": "off", "precompile": False}
MARK = 12345.678  # a value that must never come back in an error message
N = 3
MAX_MESSAGE = 400


def _inp(n: int = N) -> dict:
    return two_input_example(n)


def _lists(n: int = N) -> dict:
    inp = _inp(n)
    return {"ids": inp["ids"].tolist(), "x": inp["x"].tolist()}


#: name -> (data as a door receives it (JSON-able), rows of the reference batch it means)
ACCEPTED = {
    "by name, lists": (_lists(), N),
    "by name, int64 and float64 (numpy defaults)": (
        {"ids": np.arange(N).tolist(), "x": _inp()["x"].astype(np.float64).tolist()},
        N,
    ),
    "by position, in_0/in_1": ({"in_0": _lists()["ids"], "in_1": _lists()["x"]}, N),
    "by position, a list": ([_lists()["ids"], _lists()["x"]], N),
    "records": ([{"ids": i, "x": r} for i, r in zip(*_lists().values(), strict=True)], N),
    "one example without batch axis": ({"ids": 0, "x": _lists()["x"][0]}, 1),
    "serving_input_example.json as is": ({"inputs": _lists()}, N),
    "dataframe_split envelope": (
        {
            "dataframe_split": {
                "columns": ["ids", "x"],
                "data": [list(r) for r in zip(*_lists().values(), strict=True)],
            }
        },
        N,
    ),
}

#: name -> (data, text the refusal must contain: the rule / expected spec)
REFUSED = {
    "float into int": ({**_lists(), "ids": [1.7, MARK, 2.0]}, "Floats are not cast"),
    "out of int32 range": ({**_lists(), "ids": [1, 2, 2**40]}, "[-2147483648, 2147483647]"),
    "out of float32 range": ({**_lists(), "x": [[1e39] * 8] * N}, "out of the range of float32"),
    "missing input": ({"x": [[MARK] * 8] * N}, "missing 'ids'"),
    "unknown input": ({**_lists(), "y": [MARK]}, "unknown 'y'"),
    "wrong fixed dimension": ({**_lists(), "x": [[MARK] * 7] * N}, "x: float32[-1,8]"),
    "ragged": ({**_lists(), "x": [[MARK] * 8, [1.0]] + [[1.0] * 8]}, "ragged"),
    "strings": ({**_lists(), "ids": ["a", "b", "c"]}, "Send numbers"),
    "null": ({**_lists(), "ids": [None, 1, 2]}, "holding a null (a missing value)"),
    "a short row": (
        {
            "dataframe_split": {
                "columns": ["ids", "x"],
                "data": [[0, [MARK] * 8], [1, [1.0] * 3], [2, [1.0] * 8]],
            }
        },
        "ragged",
    ),
}


def _want(params: dict, rows: int) -> dict:
    out = two_input_fn(params, _inp(N))
    return {k: np.asarray(v)[:rows] for k, v in out.items()}


def _check(got: dict, want: dict, where: str) -> None:
    for key in ("logits", "score"):
        np.testing.assert_allclose(
            np.asarray(got[key]), want[key], rtol=1e-5, atol=1e-5, err_msg=where
        )


def _check_message(message: str, must: str, where: str) -> None:
    assert must in message, (where, message)
    assert len(message) < MAX_MESSAGE, (where, len(message), message)
    assert str(MARK) not in message, (where, message)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The two-input model (``ids``, ``x``) logged to a sqlite store; its local copy."""
    tmp = tmp_path_factory.mktemp("inputs")
    uri, env, params = log_two_input_model(tmp, FAST)
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp / "local")))
    mlflow.set_tracking_uri(None)
    return {"uri": uri, "local": local, "params": params, "env": env, "tmp": tmp}


@pytest.fixture(scope="module")
def served(logged):
    proc, url = start_jaxexp_server(logged["uri"], logged["env"], logged["tmp"] / "server.log")
    try:
        yield url
    finally:
        stop_server(proc)


def test_in_process_pyfunc_door(logged):
    model = mlflow.pyfunc.load_model(str(logged["local"]))
    for name, (data, rows) in ACCEPTED.items():
        _check(model.predict(data), _want(logged["params"], rows), name)
    inp = _inp()  # numpy arrays with numpy's default dtypes
    _check(
        model.predict({"ids": inp["ids"].astype(np.int64), "x": inp["x"]}),
        _want(logged["params"], N),
        "int64",
    )
    for name, fname in (
        ("input_example.json", "input_example.json"),
        ("serving", "serving_input_example.json"),
    ):
        data = json.loads((logged["local"] / fname).read_text())
        _check(model.predict(data), _want(logged["params"], N), name)
    for name, (data, must) in REFUSED.items():
        with pytest.raises(InputError) as err:
            model.predict(data)
        _check_message(err.value.message, must, name)
    big = {"ids": [MARK] * 5000, "x": [[MARK] * 8] * 5000}  # 5000 rows: the message stays short
    with pytest.raises(InputError) as err:
        model.predict(big)
    _check_message(err.value.message, "Floats are not cast", "big")


def test_jaxexp_predict_door(logged, tmp_path):
    local = str(logged["local"])
    for i, (name, (data, rows)) in enumerate(ACCEPTED.items()):
        src, dst = tmp_path / f"in{i}.json", tmp_path / f"out{i}.json"
        src.write_text(json.dumps(data))
        result = run_cli("predict", local, "--input", str(src), "--output", str(dst))
        assert result.exit_code == 0, (name, result.stderr)
        got = json.loads(dst.read_text())
        _check({"logits": got["out_0"], "score": got["out_1"]}, _want(logged["params"], rows), name)
    inp = _inp()
    np.savez(tmp_path / "named.npz", ids=inp["ids"].astype(np.int64), x=inp["x"])
    for src in ("named.npz", "input_example.json", "serving_input_example.json"):
        path = tmp_path / src if src.endswith(".npz") else logged["local"] / src
        result = run_cli("predict", local, "--input", str(path), "--json")
        assert result.exit_code == 0, (src, result.stderr)
        outs = {o["path"]: o["values"] for o in json.loads(result.stdout)["outputs"]}
        _check(outs, _want(logged["params"], N), src)  # outputs carry the signature's names
    for i, (name, (data, must)) in enumerate(REFUSED.items()):
        src = tmp_path / f"bad{i}.json"
        src.write_text(json.dumps(data))
        result = run_cli("predict", local, "--input", str(src))
        assert result.exit_code == 2, (name, result.stdout)
        _check_message(result.stderr.strip(), must, name)


def test_rest_door(served):
    for name, (data, rows) in ACCEPTED.items():
        body = data if name.endswith(("as is", "envelope")) else {"inputs": data}
        r = requests.post(f"{served}/invocations", json=body, timeout=60)
        assert r.status_code == 200, (name, r.text[:500])
        want = _want(mlp_params(), rows)
        _check(r.json()["predictions"], want, name)
    for name, (data, must) in REFUSED.items():
        r = requests.post(f"{served}/invocations", json={"inputs": data}, timeout=60)
        assert r.status_code == 400, (name, r.status_code, r.text[:500])
        assert "stack_trace" not in r.json(), (name, r.text[:500])
        _check_message(r.json()["message"], must, name)


def test_rest_csv_door(served):
    def post_csv(text: str) -> requests.Response:
        headers = {"Content-Type": "text/csv"}
        return requests.post(f"{served}/invocations", data=text, headers=headers, timeout=60)

    frame = pd.DataFrame({"ids": _lists()["ids"], "x": [json.dumps(r) for r in _lists()["x"]]})
    ok = post_csv(frame.to_csv(index=False))
    assert ok.status_code == 200, ok.text[:500]
    _check(ok.json()["predictions"], _want(mlp_params(), N), "csv")
    bad = post_csv(f'ids,x\n1,"[1, {MARK}]"\n')
    assert bad.status_code == 400, bad.text[:500]
    assert "Traceback" not in bad.text and "stack_trace" not in bad.json()
    _check_message(bad.json()["message"], "x: float32[-1,8]", "csv")


@pytest.mark.slow  # two `mlflow models predict` processes; test_pyfunc covers the door by default
def test_mlflow_models_predict_door(logged, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def run(body: dict, out: Path) -> subprocess.CompletedProcess:
        src = out.with_suffix(".in.json")
        src.write_text(json.dumps(body))
        cmd = [sys.executable, "-m", "mlflow", "models", "predict", "-m", str(logged["local"])]
        cmd += ["-i", str(src), "-t", "json", "-o", str(out), "--env-manager", "local"]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)

    ok = run({"inputs": ACCEPTED["by name, int64 and float64 (numpy defaults)"][0]}, tmp_path / "a")
    assert ok.returncode == 0, ok.stderr[-2000:]
    _check(
        json.loads((tmp_path / "a").read_text())["predictions"], _want(logged["params"], N), "ok"
    )
    bad = run({"inputs": REFUSED["float into int"][0]}, tmp_path / "b")
    assert bad.returncode != 0
    assert "Floats are not cast" in bad.stderr and str(MARK) not in bad.stderr


# -- names -----------------------------------------------------------------------------------------


def test_names_from_the_function_parameters(tmp_path):
    def apply(params, tokens, mask):
        return mlp_apply(params, tokens.astype(jnp.float32) * mask)

    ex = (np.ones((2, 8), np.int32), np.ones((2, 8), np.float32))
    mlflow.jaxexp.save_model(jax.jit(apply), tmp_path / "m", params=mlp_params(), input_example=ex)
    assert [s[0] for s in input_specs(tmp_path / "m")] == ["tokens", "mask"]

    def single(params, features):
        return mlp_apply(params, features)

    mlflow.jaxexp.save_model(single, tmp_path / "s", params=mlp_params(), input_example=batch(2))
    assert [s[0] for s in input_specs(tmp_path / "s")] == ["features"]
    model = mlflow.pyfunc.load_model(str(tmp_path / "m"), model_config=FAST)
    with pytest.raises(InputError, match="missing 'mask'"):
        model.predict({"tokens": ex[0]})
    got = model.predict({"tokens": ex[0].astype(np.int64), "mask": ex[1].astype(np.float64)})
    np.testing.assert_allclose(got, np.asarray(apply(mlp_params(), *ex)), rtol=1e-6)
    shown = run_cli("inspect", str(tmp_path / "m"), "--json")
    assert shown.exit_code == 0, shown.stderr
    rows = [r for r in json.loads(shown.stdout)["inputs"] if r["role"] != "param"]
    assert [r["name"] for r in rows] == ["tokens", "mask"]


def test_tabular_dataframe_of_feature_columns(logged):
    # a float32[b, n] input takes a DataFrame of n scalar feature columns (any names)
    params = mlp_params()
    model_dir = logged["tmp"] / "tab"
    mlflow.jaxexp.save_model(
        jax.jit(mlp_apply), model_dir, params=params, input_example=batch(2), serving_config=FAST
    )
    model = mlflow.pyfunc.load_model(str(model_dir))
    x = batch(4)
    frame = pd.DataFrame(x.astype(np.float64), columns=[f"f{i}" for i in range(8)])
    np.testing.assert_allclose(model.predict(frame), np.asarray(mlp_apply(params, x)), rtol=1e-5)
    with pytest.raises(InputError, match="float32"):
        model.predict(frame.iloc[:, :7])


# -- tabular: mlflow.models.evaluate on a DataFrame of feature columns ---------------------------


def _regress(params, features):
    return mlp_apply(params, features)[:, 0]


def test_evaluate_classifier_and_regressor_on_feature_columns(tracking_uri):
    params = mlp_params()
    x = batch(64, seed=3)
    logits = np.asarray(mlp_apply(params, x))
    names = ["ant", "bee", "cat", "dog"]
    frame = pd.DataFrame(x.astype(np.float64), columns=[f"f{i}" for i in range(8)])
    with mlflow.start_run():
        clf = mlflow.jaxexp.log_model(
            jax.jit(mlp_apply),
            name="clf",
            params=params,
            input_example=batch(2),
            classifier=names,
            serving_config=FAST,
        )
        reg = mlflow.jaxexp.log_model(
            jax.jit(_regress), name="reg", params=params, input_example=batch(2)
        )
        config = {"log_model_explainability": False}
        data = frame.assign(label=np.asarray(names)[logits.argmax(1)])
        res = mlflow.models.evaluate(
            clf.model_uri, data, targets="label", model_type="classifier", evaluator_config=config
        )
        assert res.metrics["accuracy_score"] == 1.0
        data = frame.assign(y=logits[:, 0].astype(np.float64) + 0.5)
        res = mlflow.models.evaluate(
            reg.model_uri, data, targets="y", model_type="regressor", evaluator_config=config
        )
        assert abs(res.metrics["mean_absolute_error"] - 0.5) < 1e-5
    _check_jax_facts(clf)
    model = mlflow.pyfunc.load_model(clf.model_uri)
    assert list(model.predict(frame[:3])) == [names[i] for i in logits[:3].argmax(1)]
    probs = model.predict(frame[:3], params={"predict_method": "predict_proba"})
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-6)
    assert (probs.argmax(1) == logits[:3].argmax(1)).all()
    raw = model.predict(frame[:3], params={"predict_method": "predict_logits"})
    np.testing.assert_allclose(raw, logits[:3], rtol=1e-5)
    with pytest.raises(mlflow.exceptions.MlflowException, match="predict_method"):
        model.predict(frame[:3], params={"predict_method": "nope"})


def _check_jax_facts(info) -> None:
    """The logged model carries the JAX facts as params (what the MLflow UI shows)."""
    logged = mlflow.get_logged_model(info.model_id)
    assert logged.params["jax.version"] == jax.__version__
    assert logged.params["jax.platforms"] == "cpu"
    assert logged.params["jax.nr_devices"] == "1"
    assert logged.params["jax.vjp_order"] == "0"
    assert logged.params["jax.in_avals"] == "x: float32[-1,8]"
    assert logged.params["jax.out_avals"] == "output: float32[-1,4]"
    blob = Path(mlflow.artifacts.download_artifacts(info.model_uri)) / "exported.bin"
    assert logged.params["jax.blob_bytes"] == str(blob.stat().st_size)
