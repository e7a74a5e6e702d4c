"""MLflow's own doors, unmodified: ``mlflow models serve`` and ``mlflow models
predict`` take every format MLflow documents and answer what in-process ``pyfunc.predict``
answers.

The stored MLflow signature declares no inputs (``serving/signature.served_signature``), so
MLflow's server parses each format the plain way and hands the result to ``predict`` unchanged,
where the input contract applies (docs/serving/pyfunc-rest.md, "Which MLflow behaviour each
door relies on"). A refusal raised by ``predict`` keeps its own short message: MLflow's prefix
quoting the whole request is not taken (``errors.JaxExpError.message``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import mlflow
import numpy as np
import pandas as pd
import pytest
import requests
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.pyfunc import scoring_server
from mlflow.types.schema import AnyType, ColSpec, Schema

import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.serving import signature as sig
from tests.models import batch, export_mlp, mlp_params, two_input_example, two_input_fn
from tests.servers import server_env, start_server, stop_server

MARK = 12345.678  # a value that must never come back in an error message
MAX_BODY = 2048  # every 4xx body is under 2 kB
JSON, CSV, PARQUET = "application/json", "text/csv", "application/vnd.apache.parquet"
N = 6
FEATURES = [f"f{i}" for i in range(8)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A one-input model (``x: float32[-1,8]`` -> array) and a two-input model (``ids``, ``x``
    -> ``{"logits", "score"}``), saved locally, with their in-process pyfunc models."""
    tmp = tmp_path_factory.mktemp("mlflow-serve")
    params = mlp_params()
    config = {"buckets": [1, 8]}
    one, two = tmp / "one", tmp / "two"
    mlflow.jaxexp.save_model(
        export_mlp(params), one, params=params, input_example=batch(2), serving_config=config
    )
    mlflow.jaxexp.save_model(
        jax.jit(two_input_fn),
        two,
        params=params,
        input_example=two_input_example(),
        serving_config=config,
    )
    local = {"one": mlflow.pyfunc.load_model(str(one)), "two": mlflow.pyfunc.load_model(str(two))}
    return {"one": one, "two": two, "local": local, "tmp": tmp}


@pytest.fixture(scope="module")
def servers(models):
    """Both models under the real ``mlflow models serve --env-manager local``."""
    env = server_env(models["tmp"])
    procs, urls = [], {}
    try:
        for name in ("one", "two"):
            proc, url = start_server(str(models[name]), "local", env, models["tmp"] / f"{name}.log")
            procs.append(proc)
            urls[name] = url
        yield urls, procs
    finally:
        for proc in procs:
            stop_server(proc)


def _parquet(frame: pd.DataFrame) -> bytes:
    buf = io.BytesIO()
    frame.to_parquet(buf)
    return buf.getvalue()


def one_input_bodies(x: np.ndarray) -> dict[str, tuple[str, bytes]]:
    """format -> (content type, body) for the one-input model, every MLflow format."""
    rows = x.tolist()
    features = pd.DataFrame(x.astype(np.float64), columns=FEATURES)
    records = features.to_dict(orient="records")
    return {
        "inputs": (JSON, json.dumps({"inputs": rows}).encode()),
        "inputs by name": (JSON, json.dumps({"inputs": {"x": rows}}).encode()),
        "instances": (JSON, json.dumps({"instances": rows}).encode()),
        "dataframe_split features": (
            JSON,
            json.dumps({"dataframe_split": {"columns": FEATURES, "data": rows}}).encode(),
        ),
        "dataframe_split list column": (
            JSON,
            json.dumps(
                {"dataframe_split": {"columns": ["x"], "data": [[r] for r in rows]}}
            ).encode(),
        ),
        "dataframe_records features": (JSON, json.dumps({"dataframe_records": records}).encode()),
        "dataframe_records list column": (
            JSON,
            json.dumps({"dataframe_records": [{"x": r} for r in rows]}).encode(),
        ),
        "csv features": (CSV, features.to_csv(index=False).encode()),
        "csv list column": (
            CSV,
            pd.DataFrame({"x": [json.dumps(r) for r in rows]}).to_csv(index=False).encode(),
        ),
        "parquet features": (PARQUET, _parquet(features)),
        "parquet list column": (PARQUET, _parquet(pd.DataFrame({"x": list(x)}))),
    }


def two_input_bodies(inp: dict) -> dict[str, tuple[str, bytes]]:
    """format -> (content type, body) for the two-input model, every MLflow format."""
    xs, ids = inp["x"].tolist(), inp["ids"].tolist()
    rows = [{"x": r, "ids": i} for r, i in zip(xs, ids, strict=True)]
    return {
        "inputs": (JSON, json.dumps({"inputs": {"x": xs, "ids": ids}}).encode()),
        "instances": (JSON, json.dumps({"instances": rows}).encode()),
        "dataframe_split": (
            JSON,
            json.dumps(
                {
                    "dataframe_split": {
                        "columns": ["x", "ids"],
                        "data": [[r["x"], r["ids"]] for r in rows],
                    }
                }
            ).encode(),
        ),
        "dataframe_records": (JSON, json.dumps({"dataframe_records": rows}).encode()),
        "csv": (
            CSV,
            pd.DataFrame({"ids": ids, "x": [json.dumps(r) for r in xs]})
            .to_csv(index=False)
            .encode(),
        ),
        "parquet": (PARQUET, _parquet(pd.DataFrame({"ids": ids, "x": list(inp["x"])}))),
    }


def _post(url: str, content_type: str, body: bytes) -> requests.Response:
    headers = {"Content-Type": content_type}
    return requests.post(f"{url}/invocations", data=body, headers=headers, timeout=120)


def test_signature_declares_no_inputs_and_row_outputs(models):
    """What MLflow reads: no input schema (so nothing is enforced or cast before predict), the
    outputs as per-row columns (spark_udf's default result_type), no type-hint flag."""
    for name in ("one", "two"):
        meta = models["local"][name].metadata
        assert meta.get_input_schema() is None
        assert meta.get_output_schema() is not None
        assert not meta._is_signature_from_type_hint()  # what the server reads
        text = (models[name] / "MLmodel").read_text()
        assert "is_signature_from_type_hint: false" in text


def _declared(src: Path, dst: Path, kind: str) -> mlflow.pyfunc.PyFuncModel:
    """A copy of a saved model whose MLmodel signature declares its inputs, in one of the two
    forms MLflow offers (``kind``: named ``AnyType`` columns or the export's named tensor specs),
    written with MLflow's public ``Model.load`` / ``Model.save`` and loaded by ``pyfunc``."""
    shutil.copytree(src, dst)
    meta = Model.load(str(dst / "MLmodel"))
    in_specs, out_specs = sig.specs_from_conf(meta.flavors["jaxexp"])
    if kind == "any columns":
        inputs = Schema([ColSpec(AnyType(), s.name) for s in in_specs])
    else:
        inputs = sig.model_signature(in_specs, out_specs).inputs
    meta.signature = ModelSignature(inputs=inputs, outputs=meta.signature.outputs)
    meta.save(str(dst / "MLmodel"))
    return mlflow.pyfunc.load_model(str(dst))


def _mlflow_answer(model, content_type: str, body: bytes) -> tuple[int, str]:
    """What ``mlflow models serve`` answers: its per-request ``invocations`` with the error
    mapping of its app (``_async_catch_mlflow_exception``), MLflow's code as it is."""
    try:
        done = scoring_server.invocations(
            body, content_type, model, model.metadata.get_input_schema()
        )
        return done.status, done.response
    except MlflowException as e:
        return e.get_http_status_code(), e.message


@pytest.mark.parametrize("kind", ["any columns", "tensors"])
def test_declaring_inputs_would_break_mlflow_doors(models, tmp_path, kind):
    """Why the stored signature declares no inputs (docs/serving/pyfunc-rest.md, "Signature"):
    declared in either form, MLflow itself (3.17.2) refuses CSV at ``mlflow models serve`` (its CSV
    parser asks the schema for pandas dtypes, which tensor specs and non-scalar columns have none
    of), enforces the schema in-process before the model sees the input, and quotes the input in its
    refusals. A sentinel: when MLflow stops doing any of this, this test fails and the choice in
    ``serving/signature.served_signature`` is to be revisited."""
    one = _declared(models["one"], tmp_path / "one", kind)
    two = _declared(models["two"], tmp_path / "two", kind)
    assert two.metadata.get_input_schema().input_names() == ["ids", "x"]  # what the UI would show
    inp = two_input_example(N)
    status, text = _mlflow_answer(two, *two_input_bodies(inp)["csv"])
    assert status == 400 and "Failed to parse input as a Pandas DataFrame" in text, text[:300]
    with pytest.raises(MlflowException, match="Failed to enforce schema of data") as info:
        two.predict([inp["ids"], inp["x"]])  # inputs by position: the contract takes them
    assert "array(" in info.value.message  # MLflow quotes the input
    x = batch(N, seed=3)
    if kind == "any columns":
        with pytest.raises(MlflowException, match="missing inputs"):
            one.predict(x)  # MLflow turns the array into 8 columns named 0..7
    else:
        with pytest.raises(MlflowException, match="does not match expected dtype"):
            one.predict(x.astype(np.float64))
        xs = inp["x"][:2].tolist()
        body = json.dumps({"inputs": {"x": xs, "ids": [1.7, 1.0]}}).encode()
        status, text = _mlflow_answer(two, JSON, body)
        assert status == 200, text[:300]  # MLflow casts 1.7 to the int32 1 before predict
    # the model as stored (no input schema) takes all of these
    for name in ("one", "two"):
        assert models["local"][name].metadata.get_input_schema() is None
    status, _ = _mlflow_answer(models["local"]["two"], *two_input_bodies(inp)["csv"])
    assert status == 200
    models["local"]["two"].predict([inp["ids"], inp["x"]])
    models["local"]["one"].predict(x.astype(np.float64))


def test_every_format_matches_in_process_one_input(models, servers):
    urls, _ = servers
    x = batch(N, seed=3)
    want = np.asarray(models["local"]["one"].predict(x))
    for fmt, (ctype, body) in one_input_bodies(x).items():
        r = _post(urls["one"], ctype, body)
        assert r.status_code == 200, (fmt, r.text[:500])
        got = np.asarray(r.json()["predictions"], np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=fmt)


def test_every_format_matches_in_process_two_inputs_dict_output(models, servers):
    urls, _ = servers
    inp = two_input_example(N)
    want = models["local"]["two"].predict(inp)
    for fmt, (ctype, body) in two_input_bodies(inp).items():
        r = _post(urls["two"], ctype, body)
        assert r.status_code == 200, (fmt, r.text[:500])
        got = r.json()["predictions"]
        for key in ("logits", "score"):
            np.testing.assert_allclose(
                np.asarray(got[key], np.float32), want[key], rtol=1e-6, atol=1e-6, err_msg=fmt
            )


def _bad_two() -> dict[str, tuple[str, bytes, str]]:
    """case -> (content type, body, text the message must hold) for the two-input model."""
    good = two_input_example(2)
    xs = good["x"].tolist()

    def js(obj: dict) -> bytes:
        return json.dumps(obj).encode()

    return {
        "500x15 of the wrong shape": (
            JSON,
            js({"inputs": {"x": [[MARK] * 15] * 500, "ids": [1] * 500}}),
            "found float32[500,15]",
        ),
        "float into int": (JSON, js({"inputs": {"x": xs, "ids": [MARK, 1.0]}}), "ids: int32[-1]"),
        "50-digit integer": (
            JSON,
            b'{"inputs": {"x": ' + json.dumps(xs).encode() + b', "ids": [1, ' + b"9" * 50 + b"]}}",
            "ids: int32[-1]",
        ),
        "50-digit integer, instances": (
            JSON,
            b'{"instances": [{"x": '
            + json.dumps(xs[0]).encode()
            + b', "ids": '
            + b"9" * 50
            + b"}]}",
            "ids: int32[-1]",
        ),
        "out of int32 range": (JSON, js({"inputs": {"x": xs, "ids": [1, 2**40]}}), "2147483647"),
        "NaN": (JSON, b'{"inputs": {"x": [[NaN, 1, 1, 1, 1, 1, 1, 1]], "ids": [1]}}', "NaN"),
        "missing input": (JSON, js({"inputs": {"x": [[MARK] * 8]}}), "missing 'ids'"),
        "strings": (JSON, js({"inputs": {"x": xs, "ids": ["a", "b"]}}), "ids: int32[-1]"),
        "records of other keys": (
            JSON,
            js({"dataframe_records": [{"x": xs[0], "y": MARK}]}),
            "x: float32[-1,8]",
        ),
        "split of the wrong width": (
            JSON,
            js({"dataframe_split": {"columns": ["x", "ids"], "data": [[[MARK] * 7, 1]]}}),
            "x: float32[-1,8]",
        ),
        "csv of the wrong width": (CSV, f'ids,x\n1,"[1, {MARK}]"\n'.encode(), "x: float32[-1,8]"),
        "csv cell nested 5000 deep": (
            CSV,
            ('ids,x\n1,"' + "[" * 5000 + "]" * 5000 + '"\n').encode(),
            "nests too deeply",
        ),
        "split repeating a column": (
            JSON,
            js({"dataframe_split": {"columns": ["x", "x"], "data": [[xs[0], xs[1]]]}}),
            "names each column once",
        ),
        "split repeating an input beside another": (
            JSON,
            js({"dataframe_split": {"columns": ["x", "ids", "ids"], "data": [[xs[0], 1, 2]]}}),
            "names each column once",
        ),
        "split of nested column names": (
            JSON,
            js({"dataframe_split": {"columns": [["x", "a"], ["ids", "b"]], "data": [[xs[0], 1]]}}),
            "one level of names",
        ),
        "split with a null column name": (
            JSON,
            js({"dataframe_split": {"columns": [None, "ids"], "data": [[xs[0], 1]]}}),
            "has a name",
        ),
        "split of 1 and '1'": (
            JSON,
            js({"dataframe_split": {"columns": [1, "1"], "data": [[xs[0], 1]]}}),
            "names each column once",
        ),
        "records of no keys": (JSON, js({"dataframe_records": [{}, {}]}), "missing 'ids'"),
        "parquet of the wrong dtype": (
            PARQUET,
            _parquet(pd.DataFrame({"ids": [1.5, MARK], "x": list(good["x"])})),
            "Floats are not cast",
        ),
    }


@pytest.mark.parametrize("case", sorted(_bad_two()))
def test_bad_requests_get_short_4xx_naming_expected_and_found(servers, case):
    urls, procs = servers
    ctype, body, must = _bad_two()[case]
    r = _post(urls["two"], ctype, body)
    assert 400 <= r.status_code < 500, (case, r.status_code, r.text[:1000])
    assert len(r.content) < MAX_BODY, (case, len(r.content), r.text[:3000])
    message = r.json()["message"]
    assert must in message, (case, message)
    lowered = message.lower()
    assert "expected" in lowered and "found" in lowered, (case, message)
    assert str(MARK) not in r.text and "9" * 20 not in r.text, (case, r.text[:1000])
    assert "Traceback" not in r.text and "site-packages" not in r.text, (case, r.text[:1000])
    assert "stack_trace" not in r.json(), case
    assert all(p.poll() is None for p in procs)
    ok_type, ok_body = two_input_bodies(two_input_example(2))["inputs"]
    assert _post(urls["two"], ok_type, ok_body).status_code == 200  # still serving


def test_repeated_columns_refused_by_the_contract_one_input(models, servers):
    """``{"columns": ["x", "x"]}``: MLflow's server builds a DataFrame with a repeated column,
    where ``frame["x"]`` is a DataFrame; the one-input model answers the contract's short 400
    (it raised an untyped AttributeError, answered with the server's traceback), and
    in-process ``pyfunc.predict`` raises the same ``InputError``."""
    from jaxexp_mlflow.errors import InputError

    xs = batch(2).tolist()
    split = {"columns": ["x", "x"], "data": [[xs[0], xs[1]]]}
    urls, procs = servers
    r = _post(urls["one"], JSON, json.dumps({"dataframe_split": split}).encode())
    assert r.status_code == 400, (r.status_code, r.text[:1000])
    assert len(r.content) < MAX_BODY, len(r.content)
    assert "names each column once" in r.json()["message"], r.text
    assert "Traceback" not in r.text and "site-packages" not in r.text, r.text[:1000]
    frame = scoring_server.infer_and_parse_data({"dataframe_split": split})
    assert list(frame.columns) == ["x", "x"]  # what MLflow hands to predict
    with pytest.raises(InputError, match="names each column once"):
        models["local"]["one"].predict(frame)
    assert all(p.poll() is None for p in procs)


@pytest.mark.slow  # five `mlflow models predict` processes (~15 s each here)
def test_mlflow_models_predict_every_format(models, tmp_path):
    """``mlflow models predict`` (MLflow's ``scoring_server._predict``): the four JSON formats
    and CSV give the in-process predictions."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    inp = two_input_example(N)
    want = models["local"]["two"].predict(inp)
    for fmt, (ctype, body) in two_input_bodies(inp).items():
        if ctype == PARQUET:
            continue  # mlflow models predict reads json and csv only
        src, out = tmp_path / f"{fmt}.in", tmp_path / f"{fmt}.json"
        src.write_bytes(body)
        kind = "csv" if ctype == CSV else "json"
        cmd = [sys.executable, "-m", "mlflow", "models", "predict", "-m", str(models["two"])]
        cmd += ["-i", str(src), "-t", kind, "-o", str(out), "--env-manager", "local"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, (fmt, done.stderr[-2000:])
        got = json.loads(out.read_text())["predictions"]
        for key in ("logits", "score"):
            np.testing.assert_allclose(
                np.asarray(got[key], np.float32), want[key], rtol=1e-6, atol=1e-6, err_msg=fmt
            )
