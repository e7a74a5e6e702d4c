"""Small JAX models used across the tests."""

from __future__ import annotations

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
