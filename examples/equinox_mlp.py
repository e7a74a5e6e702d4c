"""Equinox: train an ``eqx.nn.MLP``, log its arrays from ``eqx.partition(model, eqx.is_array)``
(None where the static parts were), reload it in a fresh process, compare.

    python examples/equinox_mlp.py [--steps 50]     # uses ./mlruns.db and ./mlartifacts
"""

from __future__ import annotations

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax
from _family_common import reload_and_compare, use_store


def synthetic_data(n: int = 512) -> tuple[jax.Array, jax.Array]:
    """A smooth regression target: y = sin(x0) + x1 * x2."""
    x = jax.random.normal(jax.random.key(0), (n, 3))
    return x, (jnp.sin(x[:, 0]) + x[:, 1] * x[:, 2])[:, None]


def train(model: eqx.nn.MLP, steps: int) -> tuple[eqx.nn.MLP, float]:
    x, y = synthetic_data()
    opt = optax.adam(1e-2)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, xb, yb):
        def loss_fn(model):
            return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    loss = jnp.nan
    for i in range(steps):
        sl = slice((i * 64) % 512, (i * 64) % 512 + 64)
        model, opt_state, loss = step(model, opt_state, x[sl], y[sl])
        mlflow.log_metric("loss", float(loss), step=i)
    return model, float(loss)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    use_store()
    model = eqx.nn.MLP(3, 1, 32, 2, key=jax.random.key(1))
    with mlflow.start_run():
        model, loss = train(model, args.steps)
        params, static = eqx.partition(model, eqx.is_array)

        def apply(params, x):
            return jax.vmap(eqx.combine(params, static))(x)

        probe = np.asarray(synthetic_data()[0][:64])
        info = mlflow.jaxexp.log_model(
            jax.jit(apply), name="model", params=params, input_example=probe[:8]
        )
    print(f"trained {args.steps} steps (last loss {loss:.4f}); logged {info.model_uri}")
    return reload_and_compare(info.model_uri, probe, np.asarray(apply(params, probe)))


if __name__ == "__main__":
    sys.exit(main())
