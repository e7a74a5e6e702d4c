"""pyfunc face of jaxexp models: signature, input forms, casting rules, buckets, cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import mlflow
import numpy as np
import pandas as pd
import pytest
import yaml

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import InputError, UnsupportedModelError
from jaxexp_mlflow.flavors.jaxexp import _load_pyfunc
from tests.models import (
    batch,
    export_mlp,
    input_specs,
    mlp_apply,
    mlp_params,
    two_input_example,
    two_input_fn,
)

# small bucket set: keeps load-time precompilation short in tests
FAST = {"buckets": [1, 2, 4, 8], "compilation_cache": False}


@pytest.fixture(autouse=True)
def _no_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXEXP_COMPILATION_CACHE", str(tmp_path / "xla-cache"))


@pytest.fixture(scope="module")
def two_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "two"
    params = mlp_params()
    mlflow.jaxexp.save_model(
        jax.jit(two_input_fn), path, params=params, input_example=two_input_example()
    )
    return path, params


def _mlmodel(path: Path) -> dict:
    return yaml.safe_load((path / "MLmodel").read_text())


# -- signature -------------------------------------------------------------------------------------


def test_signature_inferred_from_export(mlp_dir, two_dir):
    info = mlflow.models.get_model_info(str(mlp_dir[0]))
    sig = info.signature.to_dict()
    # MLflow's signature declares no inputs (MLflow then hands them over as they are);
    # the flavor section declares them, with the exact dtypes
    assert sig["inputs"] is None and info.signature.inputs is None
    assert input_specs(mlp_dir[0]) == [("x", "float32", [-1, 8])]
    assert json.loads(sig["outputs"]) == [  # per-row columns (spark_udf's default result_type)
        {"name": "output", "type": "array", "items": {"type": "float"}, "required": True}
    ]
    two = mlflow.models.get_model_info(str(two_dir[0])).signature
    # dict keys in pytree (sorted) order
    assert input_specs(two_dir[0]) == [("ids", "int32", [-1]), ("x", "float32", [-1, 8])]
    assert two.outputs.input_names() == ["logits", "score"]


def test_names_from_key_paths_and_overrides(tmp_path):
    def fn(params, a, b, *, mask):
        return (a["image"] * mask[:, None], b)

    ex = ({"image": batch(2)}, np.ones((2,), np.float32))
    kw_export = jax.export.export(jax.jit(fn))(
        mlp_params(),
        *jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), ex),
        mask=jax.ShapeDtypeStruct((2,), np.float32),
    )
    mlflow.jaxexp.save_model(kw_export, tmp_path / "a", params=mlp_params())
    sig = mlflow.models.get_model_info(str(tmp_path / "a")).signature
    assert [s[0] for s in input_specs(tmp_path / "a")] == ["0.image", "1", "mask"]
    assert sig.outputs.input_names() == ["0", "1"]
    mlflow.jaxexp.save_model(
        kw_export,
        tmp_path / "b",
        params=mlp_params(),
        input_names=["image", "scale", "mask"],
        output_names=["masked", "scale_out"],
    )
    sig = mlflow.models.get_model_info(str(tmp_path / "b")).signature
    assert [s[0] for s in input_specs(tmp_path / "b")] == ["image", "scale", "mask"]
    assert sig.outputs.input_names() == ["masked", "scale_out"]
    with pytest.raises(UnsupportedModelError, match="input_names= has 1 name"):
        mlflow.jaxexp.save_model(kw_export, tmp_path / "c", params=mlp_params(), input_names="x")


def test_user_signature_checked_against_export(tmp_path):
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    params = mlp_params()
    bad = ModelSignature(Schema([TensorSpec(np.dtype("float64"), (-1, 8), "features")]))
    with pytest.raises(UnsupportedModelError, match=r"export has x: float32\[-1,8\].*float64"):
        mlflow.jaxexp.save_model(export_mlp(params), tmp_path / "a", params=params, signature=bad)
    good = ModelSignature(Schema([TensorSpec(np.dtype("float32"), (-1, 8), "features")]))
    mlflow.jaxexp.save_model(export_mlp(params), tmp_path / "b", params=params, signature=good)
    model = mlflow.pyfunc.load_model(str(tmp_path / "b"), model_config=FAST)
    assert model.metadata.get_input_schema() is None  # the names live in jaxexp.io
    assert [s[0] for s in input_specs(tmp_path / "b")] == ["features"]
    x = batch(3)
    np.testing.assert_allclose(model.predict({"features": x}), mlp_apply(params, x), rtol=1e-6)


def test_bfloat16_declared_as_float32_and_cast(tmp_path):
    def f(x):
        return (x * 2).astype(jnp.bfloat16)

    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    mlflow.jaxexp.save_model(jax.jit(f), tmp_path / "bf", input_example=x)
    conf = _mlmodel(tmp_path / "bf")["flavors"]["jaxexp"]
    assert conf["io"]["inputs"][0]["dtype"] == "bfloat16"
    served = json.loads((tmp_path / "bf" / "serving_input_example.json").read_text())
    assert np.allclose(np.asarray(served["inputs"]["x"]), x.astype(np.float32))
    model = mlflow.pyfunc.load_model(str(tmp_path / "bf"), model_config=FAST)
    out = model.predict(x.astype(np.float32))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, x.astype(np.float32) * 2, rtol=1e-2)


# -- predict input forms ---------------------------------------------------------------------------


# pyfunc pads a batch up to its bucket (5 -> 8 rows): XLA may compile the padded shape with
# another summation order than jax.jit at 5 rows (jax 0.12's does, one float32 ulp of the
# intermediate sums; at the same shape they agree exactly): compare with an absolute floor too
TOL = {"rtol": 1e-6, "atol": 1e-6}


def test_predict_forms_single_input(mlp_dir):
    path, params = mlp_dir
    model = mlflow.pyfunc.load_model(str(path), model_config=FAST)
    x = batch(5)
    want = np.asarray(mlp_apply(params, x))
    np.testing.assert_allclose(model.predict(x), want, **TOL)
    np.testing.assert_allclose(model.predict({"x": x}), want, **TOL)
    np.testing.assert_allclose(model.predict(pd.DataFrame({"x": list(x)})), want, **TOL)
    # ... and it is exactly the model at the bucket's shape: padding alone explains the ulp
    padded = np.concatenate([x, np.zeros((3, 8), np.float32)])
    at_bucket = np.asarray(mlflow.jaxexp.load_model(str(path))(padded))[:5]
    np.testing.assert_array_equal(model.predict(x), at_bucket)
    impl = _load_pyfunc(str(path), FAST)
    # scalar feature columns: MLflow's signature check wants a column "x", our predict takes it
    cols = pd.DataFrame(x, columns=[f"f{i}" for i in range(8)])
    np.testing.assert_allclose(impl.predict(cols), want, **TOL)
    np.testing.assert_allclose(impl.predict(x.tolist()), want, **TOL)  # JSON-style lists
    np.testing.assert_allclose(impl.predict(x.astype(np.float64)), want, **TOL)


def test_predict_forms_two_inputs_and_dict_output(two_dir):
    path, params = two_dir
    model = mlflow.pyfunc.load_model(str(path), model_config=FAST)
    inp = two_input_example(5)
    want = jax.tree.map(np.asarray, two_input_fn(params, inp))
    for data in (inp, pd.DataFrame({"x": list(inp["x"]), "ids": inp["ids"]})):
        out = model.predict(data)
        assert set(out) == {"logits", "score"}
        np.testing.assert_allclose(out["logits"], want["logits"], **TOL)
        np.testing.assert_allclose(out["score"], want["score"], rtol=1e-5)
    impl = _load_pyfunc(str(path), FAST)
    records = [{"x": inp["x"][i].tolist(), "ids": int(inp["ids"][i])} for i in range(5)]
    np.testing.assert_allclose(impl.predict(records)["logits"], want["logits"], **TOL)


# -- casting and refusals --------------------------------------------------------------------------


def test_casting_rules(two_dir):
    impl = _load_pyfunc(str(two_dir[0]), FAST)
    x = batch(2).tolist()
    ok = impl.predict({"x": x, "ids": [1, 2]})
    assert ok["logits"].shape == (2, 4)
    cases = [
        ({"x": x, "ids": [1.5, 2.0]}, r"Input 'ids': expected ids: int32\[-1\].*Floats are not"),
        ({"x": x, "ids": [1, 2**40]}, r"Input 'ids'.*values in .*\[-2147483648, 2147483647\]"),
        ({"x": [r[:7] for r in x], "ids": [1, 2]}, r"Input 'x': expected x: float32\[-1,8\]"),
        ({"x": x[0], "ids": [1]}, r"Input 'x'.*found float32\[8\].*wrap it in a list"),
        ({"x": x}, r"missing 'ids'. Expected: ids: int32\[-1\]"),
        ({"x": x, "ids": [1, 2], "y": [0]}, r"unknown 'y'"),
        ({"x": [], "ids": []}, r"a batch of 0 rows"),
        ({"x": [[float("nan")] * 8] * 2, "ids": [1, 2]}, r"Input 'x'.*NaN"),
        ({"x": x, "ids": [1, 2, 3]}, r"sharing dimension 'b' with sizes 3 and 2"),
        ({"x": [["a"] * 8] * 2, "ids": [1, 2]}, r"Input 'x'.*Send numbers"),
        ({"x": [[1.0] * 8, [1.0]], "ids": [1, 2]}, r"Input 'x'.*ragged"),
        ({"x": [[1e39] * 8] * 2, "ids": [1, 2]}, r"Input 'x'.*out of the range of float32"),
    ]
    for data, pattern in cases:
        with pytest.raises(InputError, match=pattern):
            impl.predict(data)
    nan_ok = _load_pyfunc(str(two_dir[0]), {**FAST, "allow_nan": True})
    out = nan_ok.predict({"x": [[float("nan")] * 8] * 2, "ids": [1, 2]})
    assert np.isnan(out["logits"]).all()


def test_one_array_fast_path_refuses_what_convert_refuses(mlp_dir):
    """The single-array predict accepts only what ``convert`` passes unchanged and hands every
    other array to it: the same refusals, the same casts, the same outputs."""
    impl = _load_pyfunc(str(mlp_dir[0]), FAST)
    assert impl._one_array_path()
    x = batch(3)
    want = impl.run(impl.convert_inputs(x))[0]
    np.testing.assert_array_equal(impl.predict(x), want)
    np.testing.assert_array_equal(impl.predict(x.astype(np.float64)), want)  # lossless cast
    for bad, pattern in [
        (np.where(np.arange(24).reshape(3, 8) == 5, np.nan, x), r"NaN or infinite"),
        (np.full((2, 8), np.inf, np.float32), r"NaN or infinite"),
        # up to 32 values are checked by their sum: +inf and -inf sum to NaN, one NaN anywhere
        (np.array([[np.inf, -np.inf, 0, 0, 0, 0, 0, 0]], np.float32), r"NaN or infinite"),
        (np.array([[0, 0, 0, 0, 0, 0, 0, np.nan]], np.float32), r"NaN or infinite"),
        (np.where(np.arange(40).reshape(5, 8) == 39, np.nan, 0).astype(np.float32), r"NaN"),
        (x[:, :7], r"expected x: float32\[-1,8\]"),
        (x[:0], r"a batch of 0 rows"),
        (x.astype(np.int64) + 2**40, r"out of the range|lose|exactly"),
    ]:
        with pytest.raises(InputError, match=pattern):
            impl.predict(bad)
    huge = np.full((4, 8), np.finfo(np.float32).max, np.float32)  # finite; no float overflow
    np.testing.assert_array_equal(impl.predict(huge), impl.run(impl.convert_inputs(huge))[0])
    # above the direct finiteness pass (64 Ki values): max and min, each value of any sign
    for where, value in [((-1, -1), np.nan), ((0, 0), np.inf), ((4500, 3), -np.inf)]:
        for dtype in (np.float32, np.float64):
            big = np.ones((9000, 8), dtype)
            big[where] = value
            with pytest.raises(InputError, match=r"NaN or infinite"):
                impl.predict(big)
    extremes = np.full((9000, 8), np.finfo(np.float32).max, np.float32)
    extremes[::2] *= -1  # finite at both ends of the range
    np.testing.assert_array_equal(
        impl.predict(extremes), impl.run(impl.convert_inputs(extremes))[0]
    )
    ok = _load_pyfunc(str(mlp_dir[0]), {**FAST, "allow_nan": True})
    assert np.isnan(ok.predict(np.full((1, 8), np.nan, np.float32))).all()


def test_one_array_path_keys_executables_by_shape_not_bucket(tmp_path):
    """With a symbolic feature dimension, two inputs of one bucket have different shapes: each
    runs its own executable (the direct-call cache once held one per bucket and raised)."""

    def f(p, x):
        return jnp.tanh(x * p["s"]).sum(axis=1)

    b, n = jax.export.symbolic_shape("b, n")
    exp = jax.export.export(jax.jit(f))(
        {"s": jax.ShapeDtypeStruct((), jnp.float32)}, jax.ShapeDtypeStruct((b, n), jnp.float32)
    )
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(
        exp, path, params={"s": np.float32(0.5)}, input_example=np.ones((2, 3), np.float32)
    )
    impl = _load_pyfunc(str(path), {"buckets": [1, 2, 4], "compilation_cache": str(tmp_path / "c")})
    assert impl._one_array_path()
    for cols in (3, 5, 3, 5):
        x = np.ones((2, cols), np.float32)
        np.testing.assert_allclose(impl.predict(x), np.tanh(0.5) * cols * np.ones(2), rtol=1e-6)


# -- buckets ---------------------------------------------------------------------------------------


def test_buckets_bound_compilations_and_match(mlp_dir):
    path, params = mlp_dir
    impl = _load_pyfunc(str(path), {"buckets": [1, 4, 8], "compilation_cache": False})
    assert impl._flat._cache_size() == 0  # a bucket compiles on its first use, not at load
    impl.predict(batch(3))
    assert impl._flat._cache_size() == 1  # only the bucket the batch needed (4)
    for n in (1, 2, 3, 5, 7, 8, 9, 20):  # 9 and 20 run in chunks of 8
        x = batch(n, seed=n)
        np.testing.assert_allclose(impl.predict(x), mlp_apply(params, x), rtol=1e-5, atol=1e-6)
    assert impl._flat._cache_size() == 3  # one compilation per bucket, whatever the batch sizes

    eager = _load_pyfunc(
        str(path), {"buckets": [1, 4, 8], "precompile": True, "compilation_cache": False}
    )
    assert eager._flat._cache_size() == 3  # precompile: every bucket at load

    off = _load_pyfunc(str(path), {"buckets": "off", "compilation_cache": False})
    assert off._flat._cache_size() == 0
    for n in (2, 3):
        off.predict(batch(n))
    assert off._flat._cache_size() == 2


def test_bucket_settings_from_env_and_mlmodel(mlp_dir, tmp_path, monkeypatch):
    from jaxexp_mlflow.runtime import buckets

    path, params = mlp_dir
    monkeypatch.setenv("JAXEXP_BUCKETS", "2,16")
    monkeypatch.setenv("JAXEXP_PRECOMPILE", "1")
    impl = _load_pyfunc(str(path), {"compilation_cache": False})
    assert impl.policy.sizes == (2, 16) and impl._flat._cache_size() == 2
    monkeypatch.delenv("JAXEXP_BUCKETS")
    monkeypatch.delenv("JAXEXP_PRECOMPILE")
    mlflow.jaxexp.save_model(
        export_mlp(params), tmp_path / "s", params=params, serving_config={"max_batch": 4}
    )
    impl = _load_pyfunc(str(tmp_path / "s"), {"compilation_cache": False})
    assert impl.policy.sizes == (1, 2, 4) and impl._flat._cache_size() == 0
    # unset precompile: every bucket at load inside a scoring server, none elsewhere
    assert buckets.resolve({}, {"max_batch": 4}, serving=True).precompile == (1, 2, 4)
    assert buckets.resolve({}, {"max_batch": 4}).precompile == ()
    assert buckets.resolve({"precompile": False}, {}, serving=True).precompile == ()


def test_loaded_once_per_process_by_identity(mlp_dir, tmp_path, monkeypatch):
    """Loads of one model share one implementation; a rewritten directory loads again."""
    path, params = mlp_dir
    conf = {"buckets": [1, 4], "compilation_cache": False}
    first = _load_pyfunc(str(path), conf)
    assert _load_pyfunc(str(path / "MLmodel"), dict(conf)) is first  # path of the file: same
    pyfunc_model = mlflow.pyfunc.load_model(str(path), model_config=conf)
    assert pyfunc_model.get_raw_model() is first.model
    assert _load_pyfunc(str(path), {**conf, "buckets": [1, 8]}) is not first  # another config
    monkeypatch.setenv("JAXEXP_MAX_BATCH", "8")
    assert _load_pyfunc(str(path), conf) is not first  # another environment
    monkeypatch.delenv("JAXEXP_MAX_BATCH")

    # the same path rewritten with other params: another identity, never the stale model
    target = tmp_path / "m"
    mlflow.jaxexp.save_model(export_mlp(params), target, params=params)
    one = _load_pyfunc(str(target), conf)
    other = {k: v * 2 for k, v in params.items()}
    shutil.rmtree(target)
    mlflow.jaxexp.save_model(export_mlp(other), target, params=other)
    two = _load_pyfunc(str(target), conf)
    assert two is not one
    x = batch(3)
    np.testing.assert_allclose(two.predict(x), mlp_apply(other, x), rtol=1e-5, atol=1e-6)

    monkeypatch.setenv("JAXEXP_PYFUNC_CACHE", "0")
    assert _load_pyfunc(str(target), conf) is not _load_pyfunc(str(target), conf)


def test_array_cells_concatenated_and_checked(mlp_dir):
    """DataFrame cells of numpy arrays (Spark's Arrow lists) -> one array, ragged refused."""
    path, params = mlp_dir
    impl = _load_pyfunc(str(path), FAST)
    x = batch(5)
    frame = pd.DataFrame({"x": list(x)})  # object column of float32[8] arrays
    np.testing.assert_allclose(impl.predict(frame), mlp_apply(params, x), rtol=1e-5, atol=1e-6)
    ragged = pd.DataFrame({"x": [x[0], x[1][:7], np.concatenate([x[2], x[2][:1]])]})
    with pytest.raises(InputError, match=r"Input 'x'"):
        impl.predict(ragged)  # 8 + 7 + 9 values: not reshaped into 3 rows of 8
    short = pd.DataFrame({"x": [x[0][:7], x[1][:7]]})
    with pytest.raises(InputError, match=r"Input 'x': expected x: float32\[-1,8\]"):
        impl.predict(short)


# -- compilation cache and environment -------------------------------------------------------------


def _load_in_subprocess(model_dir: Path, env: dict) -> None:
    code = (
        "import sys, numpy as np, mlflow\n"
        "m = mlflow.pyfunc.load_model(sys.argv[1], model_config={'buckets': [1, 2]})\n"
        "print(m.predict(np.zeros((2, 8), np.float32)).shape)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "(2, 4)"


def test_persistent_compilation_cache(mlp_dir, tmp_path):
    cache = tmp_path / "xla"
    _load_in_subprocess(mlp_dir[0], {"JAXEXP_COMPILATION_CACHE": str(cache)})
    entries = sorted(p.name for p in cache.iterdir())
    # a bucket compiles as a function named after its executable-store entry
    assert any("jaxexp_bucket_" in name for name in entries), entries
    # a second process reads them: no new entries are written
    _load_in_subprocess(mlp_dir[0], {"JAXEXP_COMPILATION_CACHE": str(cache)})
    assert sorted(p.name for p in cache.iterdir()) == entries
    home = tmp_path / "home"
    _load_in_subprocess(mlp_dir[0], {"JAXEXP_COMPILATION_CACHE": "0", "XDG_CACHE_HOME": str(home)})
    assert not home.exists()
    _load_in_subprocess(mlp_dir[0], {"XDG_CACHE_HOME": str(home)} | _unset_cache_env())
    assert any((home / "jaxexp-mlflow" / "xla").iterdir())


def _unset_cache_env() -> dict:
    return {"JAXEXP_COMPILATION_CACHE": "1"}


def test_environment_files_and_carried_package(mlp_dir, tmp_path):
    # by default a model carries no Python: its requirements name the loader, jaxexp-mlflow
    default, params = mlp_dir
    assert not (default / "code").exists()
    assert "code" not in _mlmodel(default)["flavors"]["python_function"]
    assert any(
        r.startswith("jaxexp-mlflow>=")
        for r in (default / "requirements.txt").read_text().splitlines()
    )
    # include_package=True (air-gapped archives) carries the package in code/
    path = tmp_path / "carried"
    mlflow.jaxexp.save_model(
        export_mlp(params), path, params=params, input_example=batch(2), include_package=True
    )
    reqs = (path / "requirements.txt").read_text().splitlines()
    names = {r.split("==")[0] for r in reqs}
    assert {"jax", "jaxlib", "orbax-checkpoint", "numpy", "mlflow"} <= names
    conf = _mlmodel(path)["flavors"]["python_function"]
    assert conf["code"] == "code" and conf["loader_module"] == "jaxexp_mlflow.flavors.jaxexp"
    assert (path / "code" / "jaxexp_mlflow" / "flavors" / "jaxexp.py").is_file()
    assert not list((path / "code").rglob("__pycache__"))
    # the loader imports from code/ alone: a python without jaxexp_mlflow installed
    code = (
        "import mlflow, numpy as np\n"
        "m = mlflow.pyfunc.load_model(sys.argv[1], model_config={'buckets': [2]})\n"
        "import jaxexp_mlflow\n"
        "assert jaxexp_mlflow.__file__.startswith(sys.argv[1]), jaxexp_mlflow.__file__\n"
        "print(m.predict(np.zeros((2, 8), np.float32)).shape)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-S", "-c", _site_without_package() + code, str(path)],
        env=env,
        cwd=path.parent,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("(2, 4)")


def _site_without_package() -> str:
    """Prelude: enable site-packages but drop the editable install of jaxexp_mlflow."""
    return (
        "import site, sys\n"
        "site.main()\n"
        "sys.path = [p for p in sys.path if p and not p.endswith('/work/main')]\n"
        "sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()\n"
        "                 and 'jaxexp' not in repr(f).lower()]\n"
    )


# -- other MLflow consumers ---------------------------------------------------------------------


def test_mlflow_models_predict_cli_and_api(two_dir, tmp_path):
    path, params = two_dir
    ex = two_input_example(5)
    want = two_input_fn(params, ex)
    body = {"inputs": {"x": ex["x"].tolist(), "ids": ex["ids"].tolist()}}
    (tmp_path / "in.json").write_text(json.dumps(body))
    # MLflow's command line, in this process: with ``--env-manager local`` the command predicts
    # in the process that parsed it (no child), as it does from a shell
    from click.testing import CliRunner
    from mlflow.cli import cli as mlflow_cli

    args = ["models", "predict", "-m", str(path), "-i", str(tmp_path / "in.json")]
    args += ["-t", "json", "-o", str(tmp_path / "out.json"), "--env-manager", "local"]
    result = CliRunner().invoke(mlflow_cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    got = json.loads((tmp_path / "out.json").read_text())["predictions"]
    np.testing.assert_allclose(np.asarray(got["logits"]), want["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["score"]), want["score"], rtol=1e-5, atol=1e-5)

    # mlflow.models.predict: the programmatic form of the same command
    out_file = tmp_path / "api.json"
    mlflow.models.predict(
        model_uri=str(path), input_data=ex, env_manager="local", output_path=str(out_file)
    )
    got = json.loads(out_file.read_text())["predictions"]
    np.testing.assert_allclose(np.asarray(got["logits"]), want["logits"], rtol=1e-5, atol=1e-6)
