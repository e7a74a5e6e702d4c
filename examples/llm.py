"""A Gemma-like decoder-only language model in plain JAX, and its archiving through MLflow.

RMSNorm, rotary embeddings, grouped-query attention, a GeGLU MLP and tied embeddings, bfloat16
params with random weights (nothing downloaded). The layers are stacked (one array per weight
kind, leading axis = layer) and run with ``lax.scan``; ``generate`` runs the prefill and a
KV-cached greedy decode loop (``lax.fori_loop``) in one jitted function, ``sample`` the same with
a PRNG key (its ``uint32[2]`` key data) and a temperature. Every size is read from the params'
shapes, so ``jax.jit(generate)`` is all there is to export:

    python examples/llm.py [--size tiny|1b]      # uses ./mlruns.db and ./mlruns

Imported by tests/e2e/test_llm.py (``tiny``) and benchmarks/bench_llm.py (``1b``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROPE_BASE = 10_000.0


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's sizes; ``generate`` reads them back from the params' shapes."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int

    def n_params(self) -> int:
        """The number of parameters (embedding counted once: tied)."""
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        layer = attn + 3 * self.d_model * self.d_ff + 2 * self.d_model
        return self.vocab * self.d_model + self.n_layers * layer + self.d_model


CONFIGS = {
    # a few MB, compiles and runs in seconds: the tests
    "tiny": Config(
        vocab=1024, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384
    ),
    # ~1.03e9 params, 2.06 GB in bfloat16: the benchmark
    "1b": Config(
        vocab=32_000, d_model=2048, n_layers=20, n_heads=16, n_kv_heads=4, head_dim=128, d_ff=6144
    ),
}


def init_params(cfg: Config, key: jax.Array, dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """Random weights (scaled normal), one array per weight kind, layers stacked."""
    L, D, H, K, Dh, F = (
        cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    )  # fmt: skip
    shapes = {
        "embed": (cfg.vocab, D),
        "wq": (L, D, H, Dh),
        "wk": (L, D, K, Dh),
        "wv": (L, D, K, Dh),
        "wo": (L, H, Dh, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    keys = jax.random.split(key, len(shapes))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def normal(k: jax.Array, shape: tuple, fan_in: int) -> jax.Array:
        return (jax.random.normal(k, shape, jnp.float32) * fan_in**-0.5).astype(dtype)

    fan_in = {"embed": D * D, "wo": H * Dh, "w_down": F}  # small embed: else argmax = last token
    items = zip(shapes.items(), keys, strict=True)
    params = {n: normal(k, s, fan_in.get(n, D)) for (n, s), k in items}
    # RMSNorm scales, Gemma style: y * (1 + w), w starting at zero
    params |= {n: jnp.zeros((L, D), dtype) for n in ("attn_norm", "mlp_norm")}
    params["final_norm"] = jnp.zeros((D,), dtype)
    return params


def rms_norm(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def rope(x: jax.Array, pos: jax.Array) -> jax.Array:
    """Rotary embeddings on ``x[b, s, heads, dh]`` at positions ``pos[s]`` (halves rotated)."""
    half = x.shape[-1] // 2
    freq = ROPE_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = pos.astype(jnp.float32)[:, None] * freq  # [s, half]
    sin, cos = jnp.sin(ang)[None, :, None, :], jnp.cos(ang)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def layer(x: jax.Array, p: dict, kv: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One block on ``x[b, s, D]`` at positions ``start..start+s``; ``kv[2, b, T, K, dh]`` is
    this layer's cache, updated at those positions and attended over (causally)."""
    s, T = x.shape[1], kv.shape[2]
    pos = start + jnp.arange(s)
    h = rms_norm(x, p["attn_norm"])
    q = rope(jnp.einsum("bsd,dhk->bshk", h, p["wq"]), pos)
    k = rope(jnp.einsum("bsd,dhk->bshk", h, p["wk"]), pos)
    v = jnp.einsum("bsd,dhk->bshk", h, p["wv"])
    kv = lax.dynamic_update_slice_in_dim(kv, jnp.stack([k, v]), start, axis=2)
    n_kv, dh = kv.shape[3], kv.shape[4]
    q = q.reshape(*q.shape[:2], n_kv, -1, dh)  # grouped-query: [b, s, K, H/K, dh]
    scores = jnp.einsum("bskgd,btkd->bkgst", q, kv[0], preferred_element_type=jnp.float32)
    causal = jnp.arange(T)[None, :] <= pos[:, None]  # [s, T]: unwritten slots lie in the future
    scores = jnp.where(causal, scores * dh**-0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    att = jnp.einsum("bkgst,btkd->bskgd", probs, kv[1]).reshape(*x.shape[:2], -1, dh)
    x = x + jnp.einsum("bshk,hkd->bsd", att, p["wo"])
    h = rms_norm(x, p["mlp_norm"])
    gate = jax.nn.gelu(jnp.einsum("bsd,df->bsf", h, p["w_gate"]))  # GeGLU
    x = x + jnp.einsum("bsf,fd->bsd", gate * jnp.einsum("bsd,df->bsf", h, p["w_up"]), p["w_down"])
    return x, kv


LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def forward(
    params: dict, tokens: jax.Array, start: jax.Array, cache: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Logits (float32) of the last position of ``tokens[b, s]``, and the updated
    ``cache[L, 2, b, T, K, dh]``."""
    embed = params["embed"]
    x = embed[tokens] * jnp.asarray(embed.shape[1] ** 0.5, embed.dtype)

    def body(x: jax.Array, layer_in: tuple) -> tuple[jax.Array, jax.Array]:
        p, kv = layer_in
        return layer(x, p, kv, start)

    x, cache = lax.scan(body, x, ({k: params[k] for k in LAYER_KEYS}, cache))
    h = rms_norm(x[:, -1], params["final_norm"])
    return jnp.einsum("bd,vd->bv", h, embed, preferred_element_type=jnp.float32), cache


def _decode(params: dict, prompt_ids: jax.Array, max_new_tokens: int, pick) -> jax.Array:
    """Prefill, then ``max_new_tokens - 1`` cached steps; ``pick(step, logits) -> ids[b]``."""
    b, t = prompt_ids.shape
    L, _, K, dh = params["wk"].shape
    cache = jnp.zeros((L, 2, b, t + max_new_tokens, K, dh), params["embed"].dtype)
    logits, cache = forward(params, prompt_ids, jnp.int32(0), cache)
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(pick(0, logits))

    def step(i: jax.Array, carry: tuple) -> tuple:
        out, cache = carry
        last = lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
        logits, cache = forward(params, last, t + i - 1, cache)
        return out.at[:, i].set(pick(i, logits)), cache

    return lax.fori_loop(1, max_new_tokens, step, (out, cache))[0]


def generate(params: dict, prompt_ids: jax.Array, max_new_tokens: int = 16) -> jax.Array:
    """Greedy continuation ``int32[b, max_new_tokens]`` of ``prompt_ids: int32[b, t]``."""
    return _decode(params, prompt_ids, max_new_tokens, lambda _, lg: jnp.argmax(lg, -1))


def sample(
    params: dict,
    prompt_ids: jax.Array,
    key_data: jax.Array,
    temperature: float = 0.8,
    max_new_tokens: int = 16,
) -> jax.Array:
    """Sampled continuation; ``key_data: uint32[b, 2]`` holds one threefry key per row
    (``jax.random.key_data(jax.random.split(key, b))``): a row's tokens depend on its own key
    and prompt only, whatever else is in the batch. Step ``i`` draws with ``fold_in(key, i)``."""
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")

    def draw(key: jax.Array, i: jax.Array, logits: jax.Array) -> jax.Array:
        return jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)

    def pick(i: int, logits: jax.Array) -> jax.Array:
        return jax.vmap(draw, in_axes=(0, None, 0))(keys, i, logits)

    return _decode(params, prompt_ids, max_new_tokens, pick)


def keys(batch: int, seed: int = 0) -> np.ndarray:
    """``uint32[batch, 2]``: one key's data per row, for ``sample``."""
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), batch)))


def prompt(cfg: Config, batch: int = 2, length: int = 8, seed: int = 0) -> np.ndarray:
    """A random prompt ``int32[batch, length]``."""
    return np.random.default_rng(seed).integers(0, cfg.vocab, (batch, length), dtype=np.int32)


def main() -> int:
    import mlflow

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(CONFIGS), default="tiny")
    args = parser.parse_args()
    mlflow.set_tracking_uri("sqlite:///mlruns.db")
    cfg = CONFIGS[args.size]
    params = init_params(cfg, jax.random.key(0))
    ids = prompt(cfg)
    expected = np.asarray(jax.jit(generate)(params, ids))
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(
            jax.jit(generate), name="llm", params=params, input_example=ids
        )
    tokens = mlflow.jaxexp.load_model(info.model_uri)(ids)
    print(f"{cfg.n_params() / 1e6:.1f}M params; logged {info.model_uri}; tokens:\n{tokens}")
    return 0 if np.array_equal(np.asarray(tokens), expected) else 1


if __name__ == "__main__":
    sys.exit(main())
