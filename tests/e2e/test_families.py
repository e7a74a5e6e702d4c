"""The params trees JAX users hold: plain containers, Flax linen and NNX (RNG state included),
Equinox. Real Flax/Equinox models; each is saved, loaded and called, and its names checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest
import yaml

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import ArtifactError, UnsupportedModelError
from tests.conftest import REPO, sqlite_uri

X = np.asarray(jax.random.normal(jax.random.key(3), (5, 3)), np.float32)


def flavor_conf(path) -> dict:
    return yaml.safe_load((path / "MLmodel").read_text())["flavors"]["jaxexp"]


def save_and_load(tmp_path, name, fn, params, **kw):
    path = tmp_path / name
    mlflow.jaxexp.save_model(fn, path, params=params, input_example=X, **kw)
    return path, mlflow.jaxexp.load_model(str(path))


def nnx_model(seed: int = 0):
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)])

        def __call__(self, x):
            h = self.drop(jax.nn.relu(self.bn(self.l1(x))))
            return self.layers[1](jax.nn.relu(self.layers[0](h)))

    model = Net(nnx.Rngs(seed, dropout=1))
    model.eval()
    return nnx, model


def test_nnx_split_state_with_rng_logs_loads_and_serves(tracking_uri):
    nnx, model = nnx_model()
    graphdef, state = nnx.split(model)

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(jax.jit(apply), name="nnx", params=state, input_example=X)
    loaded = mlflow.jaxexp.load_model(info.model_uri)
    np.testing.assert_allclose(loaded(X), model(X), rtol=1e-5, atol=1e-6)
    assert list(loaded.params) == [
        "bn.bias", "bn.mean", "bn.scale", "bn.var", "drop.rngs.count", "drop.rngs.key",
        "l1.bias", "l1.kernel", "layers[0].bias", "layers[0].kernel", "layers[1].bias",
        "layers[1].kernel",
    ]  # fmt: skip
    key = loaded.params["drop.rngs.key"]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
        jax.random.key_data(key), jax.random.key_data(state["drop"]["rngs"]["key"][...])
    )
    np.testing.assert_array_equal(loaded.params["l1.kernel"], state["l1"]["kernel"][...])
    from jaxexp_mlflow.params.names import restore_tree

    _, fresh = nnx_model(seed=7)  # same structure, other weights: rebuilt from the loaded ones
    assert not np.allclose(fresh.l1.kernel[...], state["l1"]["kernel"][...])
    rebuilt = restore_tree(nnx.state(fresh), loaded.params)
    np.testing.assert_array_equal(rebuilt["l1"]["kernel"][...], state["l1"]["kernel"][...])
    np.testing.assert_allclose(nnx.merge(graphdef, rebuilt)(X), model(X), rtol=1e-6)
    pyfunc = mlflow.pyfunc.load_model(info.model_uri)
    np.testing.assert_allclose(pyfunc.predict(X), model(X), rtol=1e-5, atol=1e-6)
    # call_with_params takes model.params' own dict (typed keys included)
    np.testing.assert_allclose(loaded.call_with_params(loaded.params, X), loaded(X))

    local = mlflow.artifacts.download_artifacts(info.model_uri)
    conf = yaml.safe_load(open(f"{local}/MLmodel"))["flavors"]["jaxexp"]
    assert conf["param_keys"] == {"drop.rngs.key": "threefry2x32"}
    assert conf["pytree_node_types"] == []  # the blob holds a plain dict: no Flax to load it
    from tests.conftest import run_cli

    report = json.loads(run_cli("inspect", local, "--json").stdout)
    params_rows = [r["path"] for r in report["inputs"] if r["role"] == "param"]
    assert "params.layers[0].kernel" in params_rows and "params.drop.rngs.key" in params_rows
    assert not any("<" in p for p in params_rows)


def test_nnx_module_and_filtered_state(tmp_path):
    nnx, model = nnx_model()
    _, loaded = save_and_load(tmp_path, "module", jax.jit(lambda m, x: m(x)), model)
    np.testing.assert_allclose(loaded(X), model(X), rtol=1e-5, atol=1e-6)
    assert "layers[1].kernel" in loaded.params and "drop.rngs.key" in loaded.params

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    _, loaded = save_and_load(tmp_path, "filtered", apply, params)
    np.testing.assert_allclose(loaded(X), model(X), rtol=1e-5, atol=1e-6)
    assert sorted(loaded.params) == sorted(
        ["l1.bias", "l1.kernel", "bn.bias", "bn.scale"]
        + [f"layers[{i}].{p}" for i in (0, 1) for p in ("bias", "kernel")]
    )


def test_bare_export_of_nnx_state_with_rng_keys(tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    class Small(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.l1(x))

    model = Small(nnx.Rngs(0, dropout=1))
    model.eval()
    graphdef, state = nnx.split(model)
    exp = jax.export.export(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)))(
        state, jax.ShapeDtypeStruct(X.shape, X.dtype)
    )
    path, loaded = save_and_load(tmp_path, "bare", exp, state)
    np.testing.assert_allclose(loaded(X), model(X), rtol=1e-6)
    assert jax.dtypes.issubdtype(loaded.params["drop.rngs.key"].dtype, jax.dtypes.prng_key)
    assert flavor_conf(path)["param_names"] == [
        "drop.rngs.count", "drop.rngs.key", "l1.bias", "l1.kernel"
    ]  # fmt: skip
    from tests.conftest import run_cli

    # the bare blob, without MLmodel: dict-like Flax nodes read as dicts, variables transparent
    report = json.loads(run_cli("inspect", str(path / "exported.bin"), "--json").stdout)
    paths = [r["path"] for r in report["inputs"]]
    assert paths[:2] == ["args[0]['drop']['rngs']['count']", "args[0]['drop']['rngs']['key']"]


def test_linen_frozendict_with_batch_stats(tmp_path):
    nn = pytest.importorskip("flax.linen")
    from flax.core import FrozenDict

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3))(x[..., None].repeat(3, -1).reshape(x.shape[0], 3, 3, 1))
            x = nn.BatchNorm(use_running_average=True)(x)
            return nn.Dense(2)(x.reshape(x.shape[0], -1))

    cnn = CNN()
    variables = FrozenDict(cnn.init(jax.random.key(0), X))

    def apply(v, x):
        return cnn.apply(v, x)

    _, loaded = save_and_load(tmp_path, "linen", jax.jit(apply), variables)
    np.testing.assert_allclose(loaded(X), apply(variables, X), rtol=1e-5, atol=1e-6)
    assert "params.Conv_0.kernel" in loaded.params
    assert "batch_stats.BatchNorm_0.mean" in loaded.params


def test_equinox_partition_and_whole_module(tmp_path):
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)  # None leaves where the statics were

    def apply(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    _, loaded = save_and_load(tmp_path, "partition", apply, params)
    np.testing.assert_allclose(loaded(X), apply(params, X), rtol=1e-5, atol=1e-6)
    assert list(loaded.params) == [f"layers[{i}].{p}" for i in range(3) for p in ("bias", "weight")]
    # the whole module: its activation functions stay inside the exported function
    _, loaded = save_and_load(tmp_path, "whole", lambda m, x: jax.vmap(m)(x), mlp)
    np.testing.assert_allclose(loaded(X), apply(params, X), rtol=1e-5, atol=1e-6)
    # an Exported taking the Equinox module cannot be serialized: the error says what to do
    exp = jax.export.export(jax.jit(apply))(params, jax.ShapeDtypeStruct(X.shape, X.dtype))
    with pytest.raises(UnsupportedModelError, match="pass the function"):
        mlflow.jaxexp.save_model(exp, tmp_path / "bare", params=params)
    assert not (tmp_path / "bare" / "params").exists()


def test_keys_that_look_alike_round_trip(tmp_path):
    params = {"a.b": jnp.full((3,), 2.0), "a": {"b": jnp.full((3,), 5.0)}, "l": [jnp.ones(3)]}

    def f(p, x):
        return x * p["a.b"] + p["a"]["b"] + p["l"][0]

    path, loaded = save_and_load(tmp_path, "alike", f, params)
    np.testing.assert_array_equal(loaded.params["['a.b']"], params["a.b"])
    np.testing.assert_array_equal(loaded.params["a.b"], params["a"]["b"])
    assert list(loaded.params) == ["['a.b']", "a.b", "l[0]"]
    np.testing.assert_allclose(loaded(X), f(params, X))


class Twins:
    """A custom pytree whose two children share one key: their names collide."""

    def __init__(self, x, y):
        self.x, self.y = x, y


jax.tree_util.register_pytree_with_keys(
    Twins,
    lambda t: (((jax.tree_util.GetAttrKey("w"), t.x), (jax.tree_util.GetAttrKey("w"), t.y)), None),
    lambda _, c: Twins(*c),
)


def test_colliding_or_unsafe_names_are_refused_at_save(tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"same name \['w'\]"):
        mlflow.jaxexp.save_model(
            lambda p, x: x * p.x + p.y, tmp_path / "twins", params=Twins(jnp.ones(3), jnp.ones(3)),
            input_example=X,
        )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="cannot be stored"):
        mlflow.jaxexp.save_model(
            lambda p, x: x * p["a/../b"], tmp_path / "dots", params={"a/../b": jnp.ones(3)},
            input_example=X,
        )  # fmt: skip


def test_altered_names_or_key_impl_are_typed_errors(tmp_path):
    path, _ = save_and_load(tmp_path, "m", lambda p, x: x * p["w"], {"w": jnp.ones(3)})
    mlmodel = yaml.safe_load((path / "MLmodel").read_text())
    mlmodel["flavors"]["jaxexp"]["param_names"] = ["../../etc"]
    (path / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    with pytest.raises(ArtifactError, match="param_names"):
        mlflow.jaxexp.load_model(str(path))
    from jaxexp_mlflow.params.names import wrap_keys

    with pytest.raises(ArtifactError, match="PRNG implementation 'nope'"):
        wrap_keys({"k": jnp.zeros(2, jnp.uint32)}, {"k": "nope"})


def test_models_saved_before_named_params_still_load(tmp_path):
    """An MLmodel without param_names and a nested checkpoint: what earlier versions wrote."""
    from jaxexp_mlflow import params as P
    from tests.models import batch, mlp_apply, mlp_params

    flat = mlp_params()
    nested = {"layer1": {"w": flat["w1"], "b": flat["b1"]}, "out": (flat["w2"], flat["b2"])}

    def apply(p, x):
        return mlp_apply({"w1": p["layer1"]["w"], "b1": p["layer1"]["b"], "w2": p["out"][0],
                          "b2": p["out"][1]}, x)  # fmt: skip

    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nested)
    exp = jax.export.export(jax.jit(apply))(specs, jax.ShapeDtypeStruct((4, 8), jnp.float32))
    path = tmp_path / "old"
    mlflow.jaxexp.save_model(exp, path, params=nested)
    import shutil

    shutil.rmtree(path / "params")
    P.save_params(nested, path / "params")  # the nested layout
    mlmodel = yaml.safe_load((path / "MLmodel").read_text())
    for k in ("param_names", "params_layout", "param_keys"):
        mlmodel["flavors"]["jaxexp"].pop(k, None)
    (path / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    loaded = mlflow.jaxexp.load_model(str(path))
    np.testing.assert_allclose(loaded(batch(4)), apply(nested, batch(4)), rtol=1e-6)
    assert set(loaded.params) == {"layer1", "out"}  # the export's own tree, as before


@pytest.mark.parametrize(
    "script",
    [
        "flax_nnx.py",
        pytest.param("flax_linen_cnn.py", marks=pytest.mark.slow),
        pytest.param("equinox_mlp.py", marks=pytest.mark.slow),
    ],
)
def test_family_examples_train_log_and_reload_without_flax_or_equinox(script, tmp_path):
    """Each example trains a few steps, logs, and reloads in a fresh process where importing
    Flax/Equinox fails (load_model and pyfunc), comparing with the trained model."""
    pytest.importorskip("equinox" if script.startswith("equinox") else "flax")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_EXPERIMENT")}
    env["MLFLOW_TRACKING_URI"] = sqlite_uri(tmp_path / "mlruns.db")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), "--steps", "3"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "-> MATCH" in proc.stdout, proc.stdout
    assert "<" not in proc.stdout.split("params names:")[1].splitlines()[0]
