"""The main job, end to end: train a small MLP with optax, log it as a jaxexp model, reload it in a
fresh process and check the outputs match.

    python examples/train_mlp.py              # uses ./mlruns.db and ./mlartifacts

The store is a local sqlite-backed MLflow store under the working directory unless
MLFLOW_TRACKING_URI says otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)


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


def synthetic_data(key: jax.Array, n: int = 2048, d_in: int = 16) -> tuple[jax.Array, jax.Array]:
    """Three Gaussian blobs: an easy, reproducible classification task."""
    kc, kx, ky = jax.random.split(key, 3)
    centers = jax.random.normal(kc, (3, d_in)) * 3
    y = jax.random.randint(ky, (n,), 0, 3)
    x = centers[y] + jax.random.normal(kx, (n, d_in))
    return x, y


def train(steps: int) -> tuple[dict, jax.Array, list[float]]:
    x, y = synthetic_data(jax.random.key(0))
    params = init(jax.random.key(1))
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state, xb, yb):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(apply(p, xb), yb).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(steps):
        sl = slice((i * 128) % 2048, (i * 128) % 2048 + 128)
        params, state, loss = step(params, state, x[sl], y[sl])
        losses.append(float(loss))
        mlflow.log_metric("loss", losses[-1], step=i)
    return params, x, losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if "MLFLOW_TRACKING_URI" not in os.environ:
        mlflow.set_tracking_uri(f"sqlite:///{Path('mlruns.db').resolve()}")
    if mlflow.get_experiment_by_name("jaxexp-example") is None:
        mlflow.create_experiment(
            "jaxexp-example", artifact_location=Path("mlartifacts").resolve().as_uri()
        )
    mlflow.set_experiment("jaxexp-example")

    with mlflow.start_run() as run:
        params, x, losses = train(args.steps)
        accuracy = float(
            (apply(params, x).argmax(-1) == synthetic_data(jax.random.key(0))[1]).mean()
        )
        mlflow.log_metric("train_accuracy", accuracy)
        info = mlflow.jaxexp.log_model(
            jax.jit(apply),
            name="model",
            params=params,
            input_example=np.asarray(x[:8]),
            vjp_order=1,
            registered_model_name="jaxexp-example-mlp",
        )
    print(
        f"run {run.info.run_id}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"train accuracy {accuracy:.3f}"
    )
    print(
        f"logged {info.model_uri} (registered as models:/jaxexp-example-mlp/"
        f"{info.registered_model_version})"
    )

    # Reload in a fresh process, as a consumer would, and compare with the trained function.
    probe = np.asarray(x[:100])
    np.save("probe.npy", probe)
    code = (
        "import sys, numpy as np, mlflow\n"
        "m = mlflow.jaxexp.load_model(sys.argv[1])\n"
        "np.save('reloaded.npy', np.asarray(m(np.load('probe.npy'))))\n"
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}
    subprocess.run([sys.executable, "-c", code, info.model_uri], check=True, env=env)
    reloaded = np.load("reloaded.npy")
    expected = np.asarray(apply(params, probe))
    err = float(np.max(np.abs(reloaded - expected)))
    os.remove("probe.npy")
    os.remove("reloaded.npy")
    ok = np.allclose(reloaded, expected, rtol=1e-5, atol=1e-5)
    print(
        f"fresh-process reload: max abs difference {err:.2e} over {probe.shape[0]} rows -> "
        f"{'MATCH' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
