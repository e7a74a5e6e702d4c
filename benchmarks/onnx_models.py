"""The three models of the ONNX comparison, built the same way in both venvs.

``benchmarks/bench_onnx.py`` runs in the project's venv; jax2onnx pins an older Orbax than ours,
so the conversion to ONNX runs in a venv of its own (``python onnx_models.py convert OUTDIR``
there). Both sides build the models here, from the same seed with the same JAX and Flax
releases, so the weights are the same; the bench checks it by comparing outputs.

* ``mlp``: 784-512-512-10, ReLU, float32 ``[B, 784]``;
* ``transformer``: a Flax NNX encoder, int32 tokens ``[B, 128]`` (vocabulary 1000, d 256, 4
  heads, 2 layers, MLP 1024, pre-LayerNorm), mean-pooled to ``[B, 10]`` logits;
* ``cnn``: a Flax NNX CNN on ``[B, 28, 28, 1]``: conv 3x3 32, avg-pool 2, conv 3x3 64, avg-pool
  2, dense 10.

Each model is a function ``f(params, x)`` of an NNX state, so ``mlflow.jaxexp`` stores the params
apart from the StableHLO, and ``lambda x: f(params, x)`` for jax2onnx (weights as constants, as
the ONNX route stores them).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

NAMES = ("mlp", "transformer", "cnn")
SEQ, VOCAB, D, HEADS, LAYERS, HIDDEN = 128, 1000, 256, 4, 2, 1024


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(784, 512, rngs=rngs)
        self.l2 = nnx.Linear(512, 512, rngs=rngs)
        self.l3 = nnx.Linear(512, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        heads = lambda a: a.reshape(b, t, HEADS, D // HEADS)  # noqa: E731
        w = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(D // HEADS)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, axis=-1), heads(v))
        x = x + self.out(a.reshape(b, t, D))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Encoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (SEQ, D)) * 0.02)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, 10, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(axis=1))


class Cnn(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.c1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.c2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.head = nnx.Linear(7 * 7 * 64, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(jax.nn.relu(self.c1(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(jax.nn.relu(self.c2(x)), window_shape=(2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


def build(name: str, seed: int = 0) -> tuple[Callable[[Any, jax.Array], jax.Array], Any]:
    """The model ``name`` as ``(f, params)``: ``f(params, x)`` and its NNX state."""
    module = {"mlp": Mlp, "transformer": Encoder, "cnn": Cnn}[name](nnx.Rngs(seed))
    graphdef, state = nnx.split(module)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(state))

    def f(params: Any, x: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, _as_state(state, params))
        return m(x)

    return f, params


def _as_state(template: Any, params: Any) -> Any:
    state = jax.tree.map(lambda a: a, template)
    nnx.replace_by_pure_dict(state, params)
    return state


def example(name: str, batch: int, seed: int = 1) -> np.ndarray:
    """A deterministic input of ``batch`` rows for model ``name``."""
    rng = np.random.default_rng(seed)
    if name == "mlp":
        return rng.standard_normal((batch, 784), dtype=np.float32)
    if name == "transformer":
        return rng.integers(0, VOCAB, (batch, SEQ), dtype=np.int32)
    return rng.standard_normal((batch, 28, 28, 1), dtype=np.float32)


def spec(name: str) -> jax.ShapeDtypeStruct:
    """The input with a symbolic batch dimension ``B``, in jax2onnx's form."""
    x = example(name, 1)
    return jax.ShapeDtypeStruct(("B", *x.shape[1:]), x.dtype)


def convert(outdir: str) -> None:
    """Write ``NAME.onnx`` for every model with jax2onnx (run in jax2onnx's own venv)."""
    from jax2onnx import to_onnx

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        f, params = build(name)
        to_onnx(
            lambda x, f=f, params=params: f(params, x),
            [spec(name)],
            model_name=name,
            return_mode="file",
            output_path=str(out / f"{name}.onnx"),
        )
        print(f"wrote {out / name}.onnx", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "convert":
        convert(sys.argv[2])
    else:
        sys.exit("usage: python onnx_models.py convert OUTDIR")
