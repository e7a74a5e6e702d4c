"""Train with ``jaxexp_mlflow.hooks.TrainingHook``: metrics every step, the model on improvement.

A plain-JAX MLP trained with optax on synthetic data. The hook logs the training loss every step,
the validation loss every ``--eval-every`` steps, and the model (one ``jax.export``, params through
an Orbax CheckpointManager) every ``--log-every`` steps and when the validation loss improves (at
most once per ``--log-every`` steps; a sooner improvement waits in a checkpoint). The models
logged on improvement are registered as ``jaxexp-hook-mlp`` and the alias ``@best`` follows the
best.
At the end the script loads ``models:/jaxexp-hook-mlp@best`` back and checks it computes what the
best params compute.

    python examples/train_with_hook.py              # ./mlruns.db and ./mlartifacts
    jaxexp verify models:/jaxexp-hook-mlp@best      # then reproduce it from the command line

The store is a local sqlite-backed MLflow store under the working directory unless
MLFLOW_TRACKING_URI says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax

from jaxexp_mlflow.hooks import TrainingHook

MODEL_NAME = "jaxexp-hook-mlp"


def apply(params: dict, x: jax.Array) -> jax.Array:
    """A two-layer MLP classifier: logits for 3 classes."""
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def init(key: jax.Array, d_in: int = 16, d_hidden: int = 64, d_out: int = 3) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (d_in, d_hidden)) * (2 / d_in) ** 0.5,
        "b1": jnp.zeros(d_hidden),
        "w2": jax.random.normal(k2, (d_hidden, d_out)) * (1 / d_hidden) ** 0.5,
        "b2": jnp.zeros(d_out),
    }


def synthetic_data(key: jax.Array, n: int, d_in: int = 16) -> tuple[jax.Array, jax.Array]:
    """Three overlapping Gaussian blobs (so that validation loss plateaus)."""
    kx, ky = jax.random.split(key)
    centers = jax.random.normal(jax.random.key(42), (3, d_in)) * 1.2  # same classes for all splits
    y = jax.random.randint(ky, (n,), 0, 3)
    return centers[y] + jax.random.normal(kx, (n, d_in)), y


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()


def train(steps: int, eval_every: int, log_every: int) -> tuple[TrainingHook, dict]:
    """The training loop; returns the hook and the params at every evaluated step."""
    x, y = synthetic_data(jax.random.key(0), 4096)
    x_val, y_val = synthetic_data(jax.random.key(1), 512)
    params = init(jax.random.key(2))
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = opt.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(loss_fn)
    snapshots = {}
    hook = TrainingHook(
        apply,
        np.asarray(x_val[:8]),  # the input example: exported against, stored as reference
        log_every=log_every,
        monitor="val_loss",
        mode="min",
        registered_model_name=MODEL_NAME,
        alias="best",
    )
    with hook:
        for step in range(steps):
            sl = slice((step * 128) % 4096, (step * 128) % 4096 + 128)
            params, opt_state, loss = train_step(params, opt_state, x[sl], y[sl])
            metrics = {"loss": loss}
            if step % eval_every == 0:
                metrics["val_loss"] = eval_loss(params, x_val, y_val)
                snapshots[step] = jax.tree.map(np.asarray, params)
            info = hook(step, params, metrics)
            if info is not None:
                entry = hook.logged[-1]
                value = "" if entry.value is None else f", val_loss {entry.value:.4f}"
                print(
                    f"step {step:4d}: logged {info.model_uri} "
                    f"({'+'.join(entry.reasons)}{value}, "
                    f"version {info.registered_model_version})"
                )
    return hook, snapshots


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args()
    if "MLFLOW_TRACKING_URI" not in os.environ:
        mlflow.set_tracking_uri(f"sqlite:///{Path('mlruns.db').resolve()}")
    if mlflow.get_experiment_by_name("jaxexp-hook-example") is None:
        mlflow.create_experiment(
            "jaxexp-hook-example", artifact_location=Path("mlartifacts").resolve().as_uri()
        )
    mlflow.set_experiment("jaxexp-hook-example")

    with mlflow.start_run() as run:
        hook, snapshots = train(args.steps, args.eval_every, args.log_every)
    best = hook.best_model_info
    print(
        f"run {run.info.run_id}: {len(hook.logged)} models logged, best val_loss "
        f"{hook.best:.4f} at step {hook.best_step} -> models:/{MODEL_NAME}@best "
        f"(version {best.registered_model_version})"
    )

    # The alias serves the best params: load it back and compare with them.
    model = mlflow.jaxexp.load_model(f"models:/{MODEL_NAME}@best")
    probe = np.asarray(synthetic_data(jax.random.key(3), 64)[0])
    got = np.asarray(model(probe))
    want = np.asarray(apply(snapshots[hook.best_step], probe))
    ok = np.allclose(got, want, rtol=1e-5, atol=1e-5)
    print(
        f"models:/{MODEL_NAME}@best vs the params of step {hook.best_step}: max abs difference "
        f"{float(np.max(np.abs(got - want))):.2e} -> {'MATCH' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
