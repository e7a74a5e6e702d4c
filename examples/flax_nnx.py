"""Flax NNX, the way Flax documents it: train a small classifier with BatchNorm and Dropout, log
the full ``nnx.split`` state (RNG key and count included), reload it in a fresh process, compare.

    python examples/flax_nnx.py [--steps 50]     # uses ./mlruns.db and ./mlartifacts
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax
from _family_common import reload_and_compare, use_store
from flax import nnx


class Classifier(nnx.Module):
    def __init__(self, d_in: int, d_hidden: int, n_classes: int, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(d_in, d_hidden, rngs=rngs)
        self.bn = nnx.BatchNorm(d_hidden, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(d_hidden, n_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def synthetic_data(n: int = 512, d_in: int = 8) -> tuple[jax.Array, jax.Array]:
    kc, kx, ky = jax.random.split(jax.random.key(0), 3)
    centers = jax.random.normal(kc, (3, d_in)) * 3
    y = jax.random.randint(ky, (n,), 0, 3)
    return centers[y] + jax.random.normal(kx, (n, d_in)), y


def train(model: Classifier, steps: int) -> float:
    """The NNX training loop: nnx.jit, nnx.value_and_grad and an optax nnx.Optimizer."""
    x, y = synthetic_data()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, xb, yb):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(xb), yb).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    loss = jnp.nan
    for i in range(steps):
        sl = slice((i * 64) % 512, (i * 64) % 512 + 64)
        loss = step(model, optimizer, x[sl], y[sl])
        mlflow.log_metric("loss", float(loss), step=i)
    return float(loss)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    use_store()
    model = Classifier(8, 32, 3, nnx.Rngs(params=0, dropout=1))
    with mlflow.start_run():
        loss = train(model, args.steps)
        model.eval()  # BatchNorm uses its running averages, Dropout is off
        graphdef, state = nnx.split(model)  # everything: params, batch stats, RNG key and count

        def apply(state, x):
            return nnx.merge(graphdef, state)(x)

        probe = np.asarray(synthetic_data()[0][:64])
        info = mlflow.jaxexp.log_model(
            jax.jit(apply), name="model", params=state, input_example=probe[:8]
        )
    print(f"trained {args.steps} steps (last loss {loss:.3f}); logged {info.model_uri}")
    return reload_and_compare(info.model_uri, probe, np.asarray(model(probe)))


if __name__ == "__main__":
    sys.exit(main())
