"""Small JAX models used across the tests."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.export  # jax < 0.8 does not import the submodule by itself
import jax.numpy as jnp
import numpy as np


def mlp_apply(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def mlp_params(d_in: int = 8, d_hidden: int = 16, d_out: int = 4, seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (d_in, d_hidden), jnp.float32) / np.sqrt(d_in),
        "b1": jnp.zeros((d_hidden,), jnp.float32),
        "w2": jax.random.normal(k2, (d_hidden, d_out), jnp.float32) / np.sqrt(d_hidden),
        "b2": jnp.full((d_out,), 0.1, jnp.float32),
    }


def batch(n: int = 5, d_in: int = 8, seed: int = 1) -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.key(seed), (n, d_in), jnp.float32))


def export_mlp(params: dict, d_in: int = 8):
    (b,) = jax.export.symbolic_shape("b")
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    return jax.export.export(jax.jit(mlp_apply))(
        specs, jax.ShapeDtypeStruct((b, d_in), jnp.float32)
    )


def log_registered(fn, params, x, registered: str, **options):
    """``mlflow.jaxexp.log_model`` of ``jax.jit(fn)`` in a new run, registered as ``registered``."""
    import jax
    import mlflow

    import jaxexp_mlflow  # noqa: F401

    with mlflow.start_run():
        return mlflow.jaxexp.log_model(
            jax.jit(fn),
            name="model",
            params=params,
            input_example=x,
            registered_model_name=registered,
            **options,
        )


# -- a model of two named inputs (a dict of arrays in, a dict out) --------------------------------


def two_input_fn(params, inputs):
    """inputs = {"x": float32[b,8], "ids": int32[b]} -> {"logits": f32[b,4], "score": f32[b]}."""
    logits = mlp_apply(params, inputs["x"]) + inputs["ids"][:, None].astype(jnp.float32)
    return {"logits": logits, "score": logits.sum(axis=1)}


def two_input_example(n=3):
    """An input of ``two_input_fn`` with ``n`` rows."""
    return {"x": batch(n), "ids": np.arange(n, dtype=np.int32)}


def input_specs(path: Path) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype, shape)`` of each input, as the MLmodel's ``jaxexp.io`` declares them."""
    import yaml

    mlmodel = yaml.safe_load((Path(path) / "MLmodel").read_text())
    io = mlmodel["flavors"]["jaxexp"]["io"]["inputs"]
    return [(e["name"], e["dtype"], e["shape"]) for e in io]


def log_two_input_model(tmp: Path, serving_config: dict) -> tuple[str, dict, dict]:
    """Log the two-input model (``ids``, ``x``) to a sqlite store under ``tmp``.

    Returns ``(runs:/ URI, server environment, params)``; the tracking URI is left set.
    """
    import mlflow

    import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
    from tests.servers import server_env

    env = server_env(tmp)
    params = mlp_params()
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    exp_id = mlflow.create_experiment(tmp.name, artifact_location=(tmp / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=exp_id) as run:
        mlflow.jaxexp.log_model(
            jax.jit(two_input_fn),
            name="model",
            params=params,
            input_example=two_input_example(),
            serving_config=serving_config,
        )
    return f"runs:/{run.info.run_id}/model", env, params


# -- a graph network: messages summed over edges into nodes ---------------------------------------


def gnn_params(seed: int = 0, features: int = 4) -> dict:
    """Weights of ``gnn`` for nodes of ``features`` features."""
    rng = np.random.default_rng(seed)
    return {
        "w_msg": rng.standard_normal((features, features)).astype(np.float32),
        "w_self": rng.standard_normal((features, features)).astype(np.float32),
    }


def gnn(params, nodes, senders, receivers):
    """One message-passing step: node i gets the sum over edges s->i of relu(nodes[s] @ w_msg)."""
    messages = jax.nn.relu(nodes[senders] @ params["w_msg"])
    summed = jax.ops.segment_sum(messages, receivers, num_segments=nodes.shape[0])
    return nodes @ params["w_self"] + summed
