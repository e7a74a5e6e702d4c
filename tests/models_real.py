"""Real models built from the libraries in the test environments (Flax NNX, Equinox).

Tiny sizes and random weights: what matters is the library's own lowering of its layers
(``nnx.Embed`` and ``eqx.nn.Embedding`` gathers, attention, LayerNorm, BatchNorm, dropout RNG
state, ``lax.while_loop``, scatters), not the numbers. Each builder returns
``(fn, params, example)``: log it with ``mlflow.jaxexp.log_model(fn, params=params,
input_example=example)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

VOCAB, SEQ, DIM, HEADS, CLASSES = 32, 8, 16, 2, 3


def tokens(n: int = 3, seed: int = 0) -> np.ndarray:
    """A batch of ``n`` token sequences (int32, length ``SEQ``)."""
    return np.random.default_rng(seed).integers(0, VOCAB, (n, SEQ), dtype=np.int32)


def features(n: int = 3, d: int = 8, seed: int = 0) -> np.ndarray:
    """A batch of ``n`` float32 feature vectors of width ``d``."""
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


# -- Flax NNX -------------------------------------------------------------------------------------


def nnx_transformer(param_dtype: Any = jnp.float32) -> tuple[Any, Any, np.ndarray]:
    """``nnx.Embed`` + position embedding + ``nnx.MultiHeadAttention`` + LayerNorm + MLP head,
    as ``(lambda state, tokens: logits, state, tokens)`` with ``graphdef, state = nnx.split``."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(VOCAB, DIM, param_dtype=param_dtype, rngs=rngs)
            self.pos = nnx.Embed(SEQ, DIM, param_dtype=param_dtype, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                HEADS, DIM, decode=False, param_dtype=param_dtype, rngs=rngs
            )
            self.norm = nnx.LayerNorm(DIM, param_dtype=param_dtype, rngs=rngs)
            self.mlp = nnx.Linear(DIM, 2 * DIM, param_dtype=param_dtype, rngs=rngs)
            self.head = nnx.Linear(2 * DIM, CLASSES, param_dtype=param_dtype, rngs=rngs)

        def __call__(self, ids: jax.Array) -> jax.Array:
            x = self.embed(ids) + self.pos(jnp.arange(ids.shape[1]))
            mask = nnx.make_causal_mask(ids)
            x = self.norm(x + self.attn(x, mask=mask))
            return self.head(jax.nn.gelu(self.mlp(x.mean(axis=1))))

    graphdef, state = nnx.split(Block(nnx.Rngs(0)))

    def apply(state: Any, ids: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(ids)

    return jax.jit(apply), state, tokens()


def nnx_batchnorm_dropout() -> tuple[Any, Any, np.ndarray]:
    """Linear + ``nnx.BatchNorm`` + ``nnx.Dropout`` (eval mode), state with its RNG key/count."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.l2 = nnx.Linear(16, CLASSES, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))

    net = Net(nnx.Rngs(0))
    net.eval()
    graphdef, state = nnx.split(net)

    def apply(state: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(x)

    return jax.jit(apply), state, features()


# -- Equinox --------------------------------------------------------------------------------------


def eqx_mlp() -> tuple[Any, Any, np.ndarray]:
    """``eqx.nn.MLP`` vmapped over the batch, params from ``eqx.partition``."""
    import equinox as eqx

    mlp = eqx.nn.MLP(8, CLASSES, 16, 2, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)

    def apply(params: Any, x: jax.Array) -> jax.Array:
        return jax.vmap(eqx.combine(params, static))(x)

    return jax.jit(apply), params, features()


def eqx_attention() -> tuple[Any, Any, np.ndarray]:
    """``eqx.nn.Embedding`` + ``eqx.nn.MultiheadAttention`` + ``eqx.nn.LayerNorm`` + linear head."""
    import equinox as eqx

    class Net(eqx.Module):
        embed: eqx.nn.Embedding
        attn: eqx.nn.MultiheadAttention
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k1, k2, k3 = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k1)
            self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k2)
            self.norm = eqx.nn.LayerNorm(DIM)
            self.head = eqx.nn.Linear(DIM, CLASSES, key=k3)

        def __call__(self, ids: jax.Array) -> jax.Array:
            x = jax.vmap(self.embed)(ids)
            x = jax.vmap(self.norm)(x + self.attn(x, x, x))
            return self.head(x.mean(axis=0))

    params, static = eqx.partition(Net(jax.random.key(0)), eqx.is_array)

    def apply(params: Any, ids: jax.Array) -> jax.Array:
        return jax.vmap(eqx.combine(params, static))(ids)

    return jax.jit(apply), params, tokens()


# -- control flow and scatters (what ODE solvers and losses lower to) -----------------------------


def while_scatter() -> tuple[Any, Any, np.ndarray]:
    """An Euler integrator in ``lax.while_loop`` writing each step with ``.at[i].set`` (scatter),
    as diffrax's saved-steps buffer does; plus a scatter-add histogram of the tokens."""

    def apply(params: dict, x: jax.Array) -> jax.Array:
        steps = 4

        def body(carry: tuple) -> tuple:
            i, y, ys = carry
            y = y + 0.1 * jnp.tanh(y @ params["w"])
            return i + 1, y, ys.at[:, i].set(y)

        ys0 = jnp.zeros((x.shape[0], steps, x.shape[1]), x.dtype)
        _, y, ys = jax.lax.while_loop(lambda c: c[0] < steps, body, (0, x, ys0))
        return ys.sum(axis=1) + y

    params = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((8, 8)), jnp.float32)}
    return jax.jit(apply), params, features()


def list_params() -> tuple[Any, Any, np.ndarray]:
    """Params holding a list (``{"layers": [{"w"}, {"w"}], "non_trainable": [scale]}``), as
    keras-hub's ``trainable_variables``/``non_trainable_variables`` lists."""
    rng = np.random.default_rng(2)
    params = {
        "layers": [
            {"w": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)},
            {"w": jnp.asarray(rng.standard_normal((8, CLASSES)), jnp.float32)},
        ],
        "non_trainable": [jnp.float32(0.5)],
    }

    def apply(params: dict, x: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ params["layers"][0]["w"])
        return (h @ params["layers"][1]["w"]) * params["non_trainable"][0]

    return jax.jit(apply), params, features()


def linen_merged_batch() -> tuple[Any, Any, np.ndarray]:
    """A Flax linen ``Dense`` applied to the batch merged with a split of the features
    (``[b, 8] -> [2b, 4] -> [b, 12]``, the time-distributed layer pattern): a reshape of the
    symbolic batch dimension, as flax ``nn.scan``, haliax and numpyro's ``Predictive`` write."""
    import flax.linen as nn

    dense = nn.Dense(6)
    variables = dense.init(jax.random.key(0), jnp.zeros((1, 4)))

    def apply(variables: Any, x: jax.Array) -> jax.Array:
        b = x.shape[0]
        return dense.apply(variables, x.reshape(2 * b, 4)).reshape(b, 12)

    return jax.jit(apply), variables, features()


BUILDERS = {
    "nnx_transformer": nnx_transformer,
    "nnx_transformer_bf16": lambda: nnx_transformer(jnp.bfloat16),
    "nnx_batchnorm_dropout": nnx_batchnorm_dropout,
    "eqx_mlp": eqx_mlp,
    "eqx_attention": eqx_attention,
    "while_scatter": while_scatter,
    "list_params": list_params,
    "linen_merged_batch": linen_merged_batch,
}
