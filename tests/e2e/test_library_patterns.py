"""Library models logged as users log them: samplers and tree searches, in plain JAX.

blackjax's NUTS returns ``num_integration_steps``, an int built from Python ints (a weak-typed
``int32``, a type ``jax.export`` does not serialize); mctx's search, and most samplers, take one
PRNG key ``uint32[2]`` for the whole batch beside batched inputs. The functions here reproduce
those patterns (blackjax and mctx are not dependencies); docs/model-families.md, "Samplers and
search".
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest
import requests
import yaml

import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.errors import ArtifactError, InputError, UnsupportedModelError
from jaxexp_mlflow.flavors import readback
from jaxexp_mlflow.store import section
from tests.conftest import run_cli
from tests.servers import server_env, start_server, stop_server

PARAMS = {"w": np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)}
KEY = jax.random.PRNGKey(0)  # uint32[2]


def nuts_info(params, position):
    """A NUTS-like step: the new position and, as blackjax's NUTSInfo, the number of
    integration steps, chosen between Python ints (a weak-typed int32)."""
    energy = jnp.sum((position @ params["w"]) ** 2, axis=-1)
    steps = jnp.where(energy > 1.0, 3, 7)
    return {"position": position * 0.5, "num_integration_steps": steps}


def search(params, key, x):
    """An mctx-like search ``apply(params, rng_key, root)``: Gumbel noise drawn from one key
    for the whole batch, an action and a value per row."""
    logits = x @ params["w"]
    noisy = logits + jax.random.gumbel(key, logits.shape)
    return {"action": jnp.argmax(noisy, axis=-1), "value": jnp.max(noisy, axis=-1)}


def _flavor(model_dir: Path) -> dict:
    return yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"]["jaxexp"]


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32)


# -- a weak-typed output -------------------------------------------------------------------------


def test_weak_typed_int_output_logs_and_reloads(tracking_uri):
    x = _rows(4)
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(nuts_info, name="nuts", params=PARAMS, input_example=x)
    local = Path(mlflow.artifacts.download_artifacts(info.model_uri))
    outputs = {o["name"]: o for o in _flavor(local)["io"]["outputs"]}
    assert outputs["num_integration_steps"]["dtype"] == "int32"
    got = mlflow.pyfunc.load_model(info.model_uri).predict(_rows(5, 1))
    want = jax.jit(nuts_info)(PARAMS, _rows(5, 1))
    assert got["num_integration_steps"].dtype == np.int32
    np.testing.assert_array_equal(got["num_integration_steps"], want["num_integration_steps"])


def test_weak_typed_output_of_a_given_exported(tmp_path):
    b = jax.export.symbolic_shape("b")[0]
    exp = jax.export.export(jax.jit(nuts_info))(PARAMS, jax.ShapeDtypeStruct((b, 3), jnp.float32))
    assert any(getattr(a, "weak_type", False) for a in exp.out_avals)
    mlflow.jaxexp.save_model(exp, tmp_path / "m", params=PARAMS, input_example=_rows(2))
    out = mlflow.pyfunc.load_model(str(tmp_path / "m")).predict(_rows(3))
    assert out["num_integration_steps"].dtype == np.int32


def test_read_back_advice_names_what_was_given():
    saved = jax.export.export(jax.jit(lambda x: x + 1))(jnp.zeros(3, jnp.float32))
    other = jax.export.export(jax.jit(lambda x: x + 1))(jnp.zeros(4, jnp.float32))
    texts = {}
    for given in (readback.GIVEN_FUNCTION, readback.GIVEN_EXPORTED, readback.GIVEN_BYTES):
        with pytest.raises(ArtifactError) as err:
            readback._same_export(saved, other, given)
        texts[given] = str(err.value)
    assert "not its bytes" in texts[readback.GIVEN_BYTES]
    assert "not its bytes" not in texts[readback.GIVEN_FUNCTION]
    assert "not its bytes" not in texts[readback.GIVEN_EXPORTED]
    assert "pass the function" in texts[readback.GIVEN_EXPORTED]


# -- one PRNG key for the whole batch ------------------------------------------------------------

FRESH_PROCESS = """
import json, sys
import numpy as np
import mlflow
import jaxexp_mlflow  # noqa: F401

uri, inputs, out = sys.argv[1], sys.argv[2], sys.argv[3]
model = mlflow.pyfunc.load_model(uri)
results = {}
with np.load(inputs) as data:
    for name in sorted({k.split("/")[0] for k in data.files}):
        got = model.predict({"key": data[name + "/key"], "x": data[name + "/x"]})
        for k, v in got.items():
            results[f"{name}/{k}"] = v
np.savez(out, **results)
"""


@pytest.fixture(scope="module")
def key_model(tmp_path_factory):
    """``search`` logged with nothing but the function, params and input example; its run's
    sqlite store and the server environment."""
    tmp = tmp_path_factory.mktemp("key-model")
    env = server_env(tmp)
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    try:
        exp_id = mlflow.create_experiment("keys", artifact_location=(tmp / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=exp_id):
            info = mlflow.jaxexp.log_model(
                search, name="search", params=PARAMS, input_example=(KEY, _rows(4))
            )
        local = Path(mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(tmp / "dl")))
    finally:
        mlflow.set_tracking_uri(None)
    return {"uri": info.model_uri, "local": local, "env": env, "tmp": tmp}


def test_key_recorded_unbatched(key_model):
    inputs = {e["name"]: e for e in _flavor(key_model["local"])["io"]["inputs"]}
    assert inputs["key"]["shape"] == [2] and inputs["key"]["batched"] is False
    assert inputs["x"]["shape"] == [-1, 3] and "batched" not in inputs["x"]


def test_key_model_in_a_fresh_process_predicts_as_jax(key_model, tmp_path):
    keys = {"a": KEY, "b": jax.random.PRNGKey(7)}
    arrays, want = {}, {}
    for i, n in enumerate((1, 3, 9)):
        name = f"n{n}"
        key = np.asarray(keys["a" if i % 2 else "b"])
        arrays[f"{name}/key"], arrays[f"{name}/x"] = key, _rows(n, i)
        for k, v in jax.jit(search)(PARAMS, key, arrays[f"{name}/x"]).items():
            want[f"{name}/{k}"] = np.asarray(v)
    np.savez(tmp_path / "in.npz", **arrays)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            FRESH_PROCESS,
            key_model["uri"],
            str(tmp_path / "in.npz"),
            str(tmp_path / "out.npz"),
        ],
        env=key_model["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as got:
        assert sorted(got.files) == sorted(want)
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_key_model_rows_forms_take_one_key(key_model):
    model = mlflow.pyfunc.load_model(str(key_model["local"]))
    x = _rows(3, 5)
    want = jax.jit(search)(PARAMS, KEY, x)
    key = np.asarray(KEY).tolist()
    records = [{"key": key, "x": row.tolist()} for row in x]
    got = model.predict({"dataframe_records": records})
    np.testing.assert_array_equal(got["action"], want["action"])
    one = model.predict({"key": key, "x": x[0].tolist()})  # one example, the key once
    np.testing.assert_array_equal(one["value"], jax.jit(search)(PARAMS, KEY, x[:1])["value"])
    records[1]["key"] = [1, 2]
    with pytest.raises(InputError, match="3 rows that differ"):
        model.predict({"dataframe_records": records})


def test_key_model_jaxexp_predict(key_model, tmp_path):
    x = _rows(6, 2)
    np.savez(tmp_path / "in.npz", key=np.asarray(KEY), x=x)
    result = run_cli(
        "predict",
        str(key_model["local"]),
        "--input",
        str(tmp_path / "in.npz"),
        "--output",
        str(tmp_path / "out.npz"),
    )
    assert result.exit_code == 0, result.stderr
    want = jax.jit(search)(PARAMS, KEY, x)
    with np.load(tmp_path / "out.npz") as got:
        leaves = [got[f"out_{i}"] for i in range(len(got.files))]
    for g, w in zip(leaves, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


def test_key_model_served_by_mlflow_with_the_key_once(key_model):
    tmp = key_model["tmp"]
    proc, url = start_server(key_model["uri"], "local", key_model["env"], tmp / "serve.log")
    try:
        for n, seed in ((2, 3), (5, 4)):
            x = _rows(n, seed)
            want = jax.jit(search)(PARAMS, KEY, x)
            key = np.asarray(KEY).tolist()
            bodies = [
                {"inputs": {"key": key, "x": x.tolist()}},
                {
                    "dataframe_split": {
                        "columns": ["key", "x"],
                        "data": [[key, row] for row in x.tolist()],
                    }
                },
            ]
            for body in bodies:
                r = requests.post(f"{url}/invocations", json=body, timeout=120)
                assert r.status_code == 200, r.text[:1000]
                preds = r.json()["predictions"]
                np.testing.assert_array_equal(np.asarray(preds["action"]), want["action"])
                np.testing.assert_array_equal(
                    np.asarray(preds["value"], np.float32), np.asarray(want["value"])
                )
        example = json.loads((key_model["local"] / "serving_input_example.json").read_text())
        r = requests.post(f"{url}/invocations", json=example, timeout=120)
        assert r.status_code == 200, r.text[:1000]
    finally:
        stop_server(proc)


def test_two_keys_of_the_batch_size_name_the_polymorphic_shapes(tmp_path):
    """Keys whose size equals the batch's: the example cannot tell them apart, and neither key
    alone kept static exports; the error names the spec that does, which then saves."""

    def two_keys(params, k1, k2, x):
        return search(params, k1, x)["value"] + search(params, k2, x)["value"]

    example = (KEY, jax.random.PRNGKey(1), _rows(2))
    with pytest.raises(UnsupportedModelError) as err:
        mlflow.jaxexp.save_model(two_keys, tmp_path / "m", params=PARAMS, input_example=example)
    assert "polymorphic_shapes=(None, None, 'b, ...')" in str(err.value)
    mlflow.jaxexp.save_model(
        two_keys,
        tmp_path / "m",
        params=PARAMS,
        input_example=example,
        polymorphic_shapes=(None, None, "b, ..."),
    )
    assert [e.get("batched", True) for e in _flavor(tmp_path / "m")["io"]["inputs"]] == [
        False,
        False,
        True,
    ]


def test_key_of_the_batch_size_found_by_tracing(tmp_path, caplog):
    """One key beside a batch of 2: the example cannot tell, tracing can (the key alone kept
    static exports); said once."""
    with caplog.at_level("WARNING", logger="jaxexp_mlflow.export"):
        mlflow.jaxexp.save_model(
            search, tmp_path / "m", params=PARAMS, input_example=(KEY, _rows(2))
        )
    said = [r for r in caplog.records if "one value for the whole batch" in r.getMessage()]
    assert len(said) == 1 and "(None, 'b, ...')" in said[0].getMessage()
    assert "input 'key' of 'search'" in said[0].getMessage()
    got = mlflow.pyfunc.load_model(str(tmp_path / "m")).predict({"key": KEY, "x": _rows(6)})
    np.testing.assert_array_equal(got["action"], jax.jit(search)(PARAMS, KEY, _rows(6))["action"])


def test_io_batched_field_is_checked():
    """``batched`` in MLmodel's io: absent, true, or false for an input of fixed leading
    dimension; anything else is a damaged file."""

    def io(**entry):
        return {
            "inputs": [{"name": "k", "dtype": "uint32", "symbols": None, **entry}],
            "outputs": [{"name": "o", "dtype": "float32", "shape": [-1], "symbols": ["b"]}],
        }

    section._io(io(shape=[2], batched=False))
    section._io(io(shape=[-1, 3], batched=True))
    for bad in (
        io(shape=[-1, 3], batched=False),
        io(shape=[2], batched="no"),
        io(shape=[], batched=False),
    ):
        with pytest.raises(ArtifactError, match=re.escape("io.inputs[0].batched")):
            section._io(bad)
