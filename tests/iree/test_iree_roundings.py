"""Narrowing float converts keep their rounding on IREE (``iree/roundings.py``): bit for bit
JAX's numbers for every handled pair, on ties, subnormals, overflow, infinities and NaN, and
through a round trip IREE would otherwise fold away.

Skipped where the ``iree`` extra is not installed.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("iree.runtime")
pytest.importorskip("iree.compiler")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxexp_mlflow.flavors.jaxexp as flavor  # noqa: E402
from jaxexp_mlflow.iree import loader, roundings  # noqa: E402

DTYPES = {
    "f64": np.dtype(np.float64),
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
}
UINT = {8: np.uint64, 4: np.uint32, 2: np.uint16}


def _hostile(src: np.dtype, dst: np.dtype, n: int = 4096) -> np.ndarray:
    """Values of ``src`` that test a rounding to ``dst``: random magnitudes over the whole
    range of both types, exact ties (both parities), the subnormals of both, the values around
    ``dst``'s largest finite number, signed zeros, infinities and NaN."""
    rng = np.random.default_rng(7)
    u = UINT[src.itemsize]
    info_s, info_d = ml_dtypes.finfo(src), ml_dtypes.finfo(dst)
    drop = info_s.nmant - info_d.nmant
    bits = rng.integers(0, np.iinfo(u).max, size=n, dtype=u, endpoint=True)
    ties = (bits & ~u((1 << drop) - 1)) | u(1 << (drop - 1))  # exactly half an ulp of dst
    values = [bits.view(src), ties.view(src)]
    lo, hi = np.log2(float(info_d.smallest_subnormal)) - 3, np.log2(float(info_d.max)) + 2
    mags = np.exp2(rng.uniform(lo, hi, size=n)) * rng.choice([-1, 1], size=n)
    with np.errstate(over="ignore"):
        values.append(mags.astype(src))
    for k in range(1, 40):  # multiples and half-multiples of dst's smallest subnormal
        q = float(info_d.smallest_subnormal)
        values.append(np.array([k * q, (k + 0.5) * q, -(k + 0.5) * q, k * q / 4], src))
    top = float(info_d.max)
    ulp = float(info_d.max) - float(np.nextafter(np.array(top, dst), np.array(0, dst)))
    near = [top, top + ulp / 2, top + ulp / 2 * 0.999, top + ulp, -top - ulp / 2]
    near += [float(info_s.smallest_subnormal), float(info_s.tiny), float(info_d.tiny)]
    near += [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1 + 2.0**-8, 1 + 3 * 2.0**-9]
    with np.errstate(over="ignore"):
        values.append(np.array(near, src))
    return np.concatenate(values)


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit for bit, NaN for NaN (a NaN's payload aside)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan_g, nan_w = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    np.testing.assert_array_equal(nan_g, nan_w)
    u = UINT[want.dtype.itemsize]
    g, w = got[~nan_w].view(u), want[~nan_w].view(u)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, (
        f"{bad.size} values differ, e.g. {want[~nan_w][bad[:5]]} vs {got[~nan_w][bad[:5]]}"
    )


@pytest.mark.parametrize("kind", ["convert", "round trip"])
@pytest.mark.parametrize("pair", sorted(roundings.PAIRS), ids="->".join)
def test_every_narrowing_convert_rounds_as_jax(pair, kind):
    """The convert alone, and the round trip back to the wider type (which IREE folds into
    nothing without the rewrite), bit for bit JAX's, over a symbolic-batch module."""
    src, dst = DTYPES[pair[0]], DTYPES[pair[1]]
    x = _hostile(src, dst)

    def f(x):
        narrow = x.astype(dst)
        return narrow if kind == "convert" else narrow.astype(src)

    with jax.enable_x64(True):
        spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b"), src)
        exp = jax.export.export(jax.jit(f))(spec)
        want = np.asarray(jax.jit(f)(x))
        data = exp.serialize()
    model = loader.build(data, {}, source="-".join(pair))
    _same_bits(np.asarray(model(x)), want)


@pytest.mark.parametrize("pair", sorted(roundings.PAIRS), ids="->".join)
def test_a_rounded_scale_is_jax(pair):
    """The pattern IREE folded: a scalar computed in the wider type, rounded to the narrower
    one and back, broadcast over the input (``x * sqrt(x[0])`` through bfloat16 was off by
    2e-2 before)."""
    src, dst = DTYPES[pair[0]], DTYPES[pair[1]]

    def f(x):
        return x * jnp.sqrt(x[0]).astype(dst).astype(src)

    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        exp = jax.export.export(jax.jit(f))(
            jax.ShapeDtypeStruct(jax.export.symbolic_shape("b"), src)
        )
        xs = [rng.uniform(0.5, 100.0, size=8).astype(src) for _ in range(16)]
        wants = [np.asarray(jax.jit(f)(x)) for x in xs]
        data = exp.serialize()
    model = loader.build(data, {}, source="-".join(pair))
    for x, want in zip(xs, wants, strict=True):
        _same_bits(np.asarray(model(x)), want)


def test_the_rewrite_is_in_the_compiled_module():
    """What reaches the compiler: the convert's operand is the rounding function's result."""
    from iree.compiler import ir

    text = """
    func.func @main(%a: tensor<?x3xf32>) -> tensor<?x3xf32> {
      %0 = stablehlo.convert %a : (tensor<?x3xf32>) -> tensor<?x3xbf16>
      %1 = stablehlo.convert %0 : (tensor<?x3xbf16>) -> tensor<?x3xf32>
      %2 = stablehlo.convert %1 : (tensor<?x3xf32>) -> tensor<?x3xbf16>
      %3 = stablehlo.convert %2 : (tensor<?x3xbf16>) -> tensor<?x3xf32>
      return %3 : tensor<?x3xf32>
    }"""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        assert roundings.keep_roundings(module, ir) == 2
        assert module.operation.verify()
        out = str(module)
    assert out.count("func.func private @jaxexp_round_f32_bf16_0") == 1  # one per type
    assert out.count("call @jaxexp_round_f32_bf16_0") == 2


def test_scaled_embedding_reproduces_jax_through_save_and_load(tmp_path):
    """recurrentgemma's embedder: ``x * sqrt(width).astype(bfloat16)``, cast back to float32.
    IREE folded the bfloat16 rounding away (5.656854 for JAX's 5.65625)."""
    width = 32

    def embed(params, tokens):
        x = params["table"][tokens]
        scale = jnp.sqrt(jnp.float32(width)).astype(jnp.bfloat16)
        return (x * scale.astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)

    rng = np.random.default_rng(0)
    params = {"table": rng.standard_normal((50, width)).astype(np.float32)}
    tokens = rng.integers(0, 50, size=(3, 7)).astype(np.int32)
    path = tmp_path / "embedder"
    flavor.save_model(jax.jit(embed), path, params=params, input_example=tokens)
    model = flavor.load_model(str(path), backend="iree")
    for n in (1, 3, 5):
        t = rng.integers(0, 50, size=(n, 7)).astype(np.int32)
        np.testing.assert_array_equal(model(t), np.asarray(jax.jit(embed)(params, t)))
