"""Flax linen: train a small CNN with BatchNorm on synthetic images, log its variables
(``FrozenDict`` with ``params`` and ``batch_stats``), reload it in a fresh process, compare.

    python examples/flax_linen_cnn.py [--steps 50]     # uses ./mlruns.db and ./mlartifacts
"""

from __future__ import annotations

import argparse
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax
from _family_common import reload_and_compare, use_store
from flax.core import FrozenDict


class CNN(nn.Module):
    n_classes: int = 2

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
        return nn.Dense(self.n_classes)(x.reshape(x.shape[0], -1))


def synthetic_images(n: int = 256) -> tuple[jax.Array, jax.Array]:
    """8x8 one-channel images: class 1 has a bright upper half."""
    kx, ky = jax.random.split(jax.random.key(0))
    y = jax.random.randint(ky, (n,), 0, 2)
    x = jax.random.normal(kx, (n, 8, 8, 1))
    return x.at[:, :4].add(2.0 * y[:, None, None, None]), y


def train(cnn: CNN, steps: int) -> tuple[FrozenDict, float]:
    x, y = synthetic_images()
    variables = cnn.init(jax.random.key(1), x[:2])
    params, batch_stats = variables["params"], variables["batch_stats"]
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, batch_stats, opt_state, xb, yb):
        def loss_fn(params):
            logits, updates = cnn.apply(
                {"params": params, "batch_stats": batch_stats}, xb, train=True,
                mutable=["batch_stats"],
            )  # fmt: skip
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
            return loss, updates["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    loss = jnp.nan
    for i in range(steps):
        sl = slice((i * 32) % 256, (i * 32) % 256 + 32)
        params, batch_stats, opt_state, loss = step(params, batch_stats, opt_state, x[sl], y[sl])
        mlflow.log_metric("loss", float(loss), step=i)
    return FrozenDict({"params": params, "batch_stats": batch_stats}), float(loss)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    use_store()
    cnn = CNN()

    def apply(variables, x):
        return cnn.apply(variables, x)  # inference: running averages

    with mlflow.start_run():
        variables, loss = train(cnn, args.steps)
        probe = np.asarray(synthetic_images()[0][:32])
        info = mlflow.jaxexp.log_model(
            jax.jit(apply), name="model", params=variables, input_example=probe[:4]
        )
    print(f"trained {args.steps} steps (last loss {loss:.3f}); logged {info.model_uri}")
    return reload_and_compare(info.model_uri, probe, np.asarray(apply(variables, probe)))


if __name__ == "__main__":
    sys.exit(main())
