"""XLA:CPU compile options chosen per executable (``runtime/cpu_compile.py``).

A transformer encoder (LayerNorm, softmax attention, GELU MLP) at a big batch: XLA:CPU's
default offload of reductions to YNNPACK fills broadcasts in memory as fusion inputs; the
flavor compiles it again with reductions kept off YNNPACK. A CNN's pooling keeps the default.
A loop over bfloat16 weights (the small LLM's decode loop, a scan over stacked layers): XLA
hoists the weights' float32 copies out of the loop; the flavor compiles it again with
loop-invariant code left in the loop, unless that would move a dot into it. Through
``load_model(path)(x)`` and ``pyfunc.predict``, answers within the documented tolerance of the
jitted function (tokens exact).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.archive.reproduce import DEFAULT_TOLERANCES
from jaxexp_mlflow.runtime import cpu_compile

SEQ, D, HEADS, HIDDEN, VOCAB = 32, 64, 4, 256, 100
RTOL, ATOL = DEFAULT_TOLERANCES[4]


def _layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale + bias


def encoder(p, tokens):
    """Two pre-LayerNorm encoder blocks over token ids, mean-pooled to 10 logits."""
    b, t = tokens.shape
    x = p["embed"][tokens] + p["pos"]
    for blk in p["blocks"]:
        h = _layer_norm(x, blk["ln1_s"], blk["ln1_b"])
        q, k, v = jnp.split(h @ blk["qkv"], 3, axis=-1)
        heads = lambda a: a.reshape(b, t, HEADS, D // HEADS)  # noqa: E731
        w = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(D // HEADS)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, axis=-1), heads(v))
        x = x + a.reshape(b, t, D) @ blk["out"]
        h = _layer_norm(x, blk["ln2_s"], blk["ln2_b"])
        x = x + jax.nn.gelu(h @ blk["up"]) @ blk["down"]
    return x.mean(axis=1) @ p["head"]


def encoder_params(seed: int = 0):
    rng = np.random.default_rng(seed)
    n = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    block = lambda: {  # noqa: E731
        "ln1_s": np.ones(D, np.float32),
        "ln1_b": np.zeros(D, np.float32),
        "qkv": n(D, 3 * D),
        "out": n(D, D),
        "ln2_s": np.ones(D, np.float32),
        "ln2_b": np.zeros(D, np.float32),
        "up": n(D, HIDDEN),
        "down": n(HIDDEN, D),
    }
    return {"embed": n(VOCAB, D), "pos": n(SEQ, D), "blocks": [block(), block()], "head": n(D, 10)}


def cnn(p, x):
    """conv 3x3 -> ReLU -> 2x2 average pool, twice, then a dense layer (NHWC)."""
    for w in (p["c1"], p["c2"]):
        x = jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        x = jax.nn.relu(x)
        x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
    return x.reshape(x.shape[0], -1) @ p["head"]


def cnn_params(seed: int = 0):
    rng = np.random.default_rng(seed)
    n = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    return {"c1": n(3, 3, 1, 16), "c2": n(3, 3, 16, 32), "head": n(7 * 7 * 32, 10)}


def tokens(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).integers(0, VOCAB, (rows, SEQ), dtype=np.int32)


def images(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, 28, 28, 1)).astype(np.float32)


def _offloads_reductions(fn, params, x) -> bool:
    """Whether this jaxlib's defaults fill broadcasts for YNNPACK fusions here (jaxlib 0.10+)."""
    text = jax.jit(fn).lower(params, x).compile().as_text()
    return "__ynn_fusion" in text and "wrapped_broadcast" in text


@pytest.fixture
def small_budget(monkeypatch):
    """The threshold scaled to these small models (the 1 MiB their big batches pass)."""
    monkeypatch.setattr(cpu_compile, "TEMP_BYTES", 1 << 20)
    monkeypatch.delenv("JAXEXP_CPU_YNN_CHOICE", raising=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu-compile")
    out = {}
    for name, fn, params, example in (
        ("encoder", encoder, encoder_params(), tokens(2)),
        ("cnn", cnn, cnn_params(), images(2)),
    ):
        path = root / name
        mlflow.jaxexp.save_model(jax.jit(fn), path, params=params, input_example=example)
        out[name] = (path, fn, params)
    return out


def test_big_temporaries_compile_without_ynnpack_reductions(saved, small_budget, caplog):
    path, fn, params = saved["encoder"]
    x = tokens(64)
    if not _offloads_reductions(fn, params, x):
        pytest.skip(f"jaxlib {jax.__version__} does not offload reductions to YNNPACK here")
    lowered = jax.jit(fn).lower(params, x)
    default = lowered.compile()
    chosen, options = cpu_compile.compile_lowered(lowered)
    assert options == cpu_compile.LEAN_OPTIONS
    before = default.memory_analysis().temp_size_in_bytes
    after = chosen.memory_analysis().temp_size_in_bytes
    assert 2 * after <= before, (before, after)
    assert "wrapped_broadcast" not in chosen.as_text()

    from jaxexp_mlflow.runtime import model as model_mod

    model = mlflow.jaxexp.load_model(str(path))
    got = np.asarray(model(x))
    route = model._routes[(x.shape, x.dtype)]
    assert isinstance(route, model_mod._ChosenRoute)
    # called as compiled: nothing is lowered or compiled again for the signature's next call
    caplog.clear()
    with jax.log_compiles(), caplog.at_level(logging.DEBUG):
        np.testing.assert_array_equal(np.asarray(model(x)), got)
    assert not [r for r in caplog.records if "ompil" in r.getMessage()], caplog.text[:500]
    want = np.asarray(jax.jit(fn)(params, x))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # a small batch stays below the threshold: XLA's defaults
    model(tokens(1))
    assert model._routes[((1, SEQ), np.dtype(np.int32))] is model._jit_call

    py = mlflow.pyfunc.load_model(str(path))
    np.testing.assert_allclose(py.predict(x), want, rtol=RTOL, atol=ATOL)


def test_pooling_keeps_the_default(saved, small_budget):
    path, fn, params = saved["cnn"]
    x = images(64)
    chosen, options = cpu_compile.compile_lowered(jax.jit(fn).lower(params, x))
    assert options == {}
    model = mlflow.jaxexp.load_model(str(path))
    np.testing.assert_allclose(
        np.asarray(model(x)), np.asarray(jax.jit(fn)(params, x)), rtol=RTOL, atol=ATOL
    )
    assert model._routes[(x.shape, x.dtype)] is model._jit_call


def test_off_by_environment_and_below_the_threshold(saved, monkeypatch):
    path, fn, params = saved["encoder"]
    x = tokens(64)
    lowered = jax.jit(fn).lower(params, x)
    assert cpu_compile.compile_lowered(lowered)[1] == {}  # 32 MiB: this batch is far below
    monkeypatch.setattr(cpu_compile, "TEMP_BYTES", 1 << 20)
    monkeypatch.setenv("JAXEXP_CPU_YNN_CHOICE", "0")
    assert cpu_compile.compile_lowered(lowered)[1] == {}
    model = mlflow.jaxexp.load_model(str(path))
    assert model._routes is None
    model(x)  # the default path, as before


def test_traced_inputs_take_the_default_path(saved, small_budget):
    path, fn, params = saved["encoder"]
    model = mlflow.jaxexp.load_model(str(path))
    x = tokens(64)
    got = jax.jit(lambda t: model(t))(x)  # a tracer: not routed, nothing remembered
    assert model._routes == {}
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(jax.jit(fn)(params, x)), rtol=RTOL, atol=ATOL
    )


def test_broadcast_bytes_read_from_the_module(saved):
    _, fn, params = saved["encoder"]
    x = tokens(64)
    exe = jax.jit(fn).lower(params, x).compile()
    text = exe.as_text()
    if "wrapped_broadcast" not in text:
        pytest.skip(f"jaxlib {jax.__version__} fills no broadcasts for YNNPACK here")
    # the sum of the shapes XLA states for its broadcast instructions, no more than the
    # temporaries they live in; most of them in this module
    got = cpu_compile.broadcast_bytes(text)
    temp = exe.memory_analysis().temp_size_in_bytes
    assert temp // 4 <= got <= temp
    assert cpu_compile.broadcast_bytes("%wrapped_broadcast.3 = bf16[2,3]{1,0} fusion(") == 12
    assert cpu_compile.broadcast_bytes("%wrapped_broadcast = pred[5]{0} fusion(") == 5


def test_a_decode_loop_keeps_its_weights_converts_in_the_loop(small_budget, monkeypatch):
    """The small LLM's generate (bfloat16 weights): XLA's defaults convert every weight to
    float32 before the decode loop; compiled once more with loop-invariant code left in the
    loop, its temporaries at least halve and its tokens are the same, through the compile and
    through ``load_model(path)(x)``."""
    import functools

    from tests.conftest import llm_example

    llm = llm_example()
    cfg = llm.CONFIGS["tiny"]
    params = llm.init_params(cfg, jax.random.key(0))
    ids = llm.prompt(cfg, batch=2, length=8)
    fn = jax.jit(functools.partial(llm.generate, max_new_tokens=4))
    lowered = fn.lower(params, ids)
    monkeypatch.setattr(cpu_compile, "TEMP_BYTES", 64 << 10)  # its 0.4-2.8 MiB pass it
    default = lowered.compile()
    text = default.as_text()
    temp = default.memory_analysis().temp_size_in_bytes
    _skip_unless_hoisted(default)  # mostly the weights' copies
    assert 4 * cpu_compile.broadcast_bytes(text) < temp  # not YNNPACK's broadcasts
    calls = []
    compile_ = type(lowered).compile
    monkeypatch.setattr(
        type(lowered), "compile", lambda self, **kw: calls.append(kw) or compile_(self, **kw)
    )
    exe, options = cpu_compile.compile_lowered(lowered)
    assert options == cpu_compile.LOOP_OPTIONS
    assert calls == [{}, {"compiler_options": cpu_compile.LOOP_OPTIONS}]
    assert 2 * exe.memory_analysis().temp_size_in_bytes <= temp
    assert cpu_compile.hoisted_convert_bytes(exe.as_text()) < cpu_compile.hoisted_convert_bytes(
        text
    )
    want = np.asarray(fn(params, ids))
    np.testing.assert_array_equal(np.asarray(exe(params, ids)), want)


def _skip_unless_hoisted(default) -> None:
    """Skip where this jaxlib's XLA keeps a loop's converts in it already (jaxlib 0.12: the
    1B decoder's temporaries are 0.22x its params with XLA's defaults, 2.09x with 0.10.2's)."""
    text, temp = default.as_text(), default.memory_analysis().temp_size_in_bytes
    if 4 * cpu_compile.hoisted_convert_bytes(text) < temp:
        pytest.skip(f"jaxlib {jax.__version__} hoists no converted copies out of loops here")


def _stacked(invariant_matmul: bool):
    """A scan over 4 stacked bfloat16 layers; with ``invariant_matmul`` each step also adds a
    float32 matmul of two params, the same every step (worth hoisting)."""

    def fn(p, x):
        def step(h, w):
            y = h @ w.astype(jnp.float32)
            if invariant_matmul:
                y = y + (p["a"] @ p["b"])[: h.shape[0]]
            return jnp.tanh(y), None

        return jax.lax.scan(step, x, p["w"])[0]

    rng = np.random.default_rng(3)
    params = {
        "w": (rng.standard_normal((4, 512, 512)) * 0.05).astype(jnp.bfloat16),
        "a": (rng.standard_normal((64, 256)) * 0.05).astype(np.float32),
        "b": (rng.standard_normal((256, 512)) * 0.05).astype(np.float32),
    }
    return fn, params, rng.standard_normal((4, 512)).astype(np.float32)


def test_a_scan_over_bf16_layers_converts_each_layer_in_the_loop(tmp_path, small_budget):
    fn, params, x = _stacked(False)
    lowered = jax.jit(fn).lower(params, x)
    _skip_unless_hoisted(lowered.compile())
    exe, options = cpu_compile.compile_lowered(lowered)
    assert options == cpu_compile.LOOP_OPTIONS
    before = lowered.compile().memory_analysis().temp_size_in_bytes
    assert 2 * exe.memory_analysis().temp_size_in_bytes <= before
    want = np.asarray(jax.jit(fn)(params, x))
    np.testing.assert_allclose(np.asarray(exe(params, x)), want, rtol=RTOL, atol=ATOL)

    from jaxexp_mlflow.runtime import model as model_mod

    path = tmp_path / "scan"
    mlflow.jaxexp.save_model(jax.jit(fn), path, params=params, input_example=x)
    model = mlflow.jaxexp.load_model(str(path))
    np.testing.assert_allclose(np.asarray(model(x)), want, rtol=RTOL, atol=ATOL)
    assert isinstance(model._routes[(x.shape, x.dtype)], model_mod._ChosenRoute)
    py = mlflow.pyfunc.load_model(str(path))
    np.testing.assert_allclose(py.predict(x), want, rtol=RTOL, atol=ATOL)


def test_a_loop_with_an_invariant_matmul_keeps_the_default(small_budget):
    """Left in the loop, the invariant matmul would run once a step: the temporaries still
    halve, but a dot moves into the loop, so XLA's defaults are kept."""
    fn, params, x = _stacked(True)
    lowered = jax.jit(fn).lower(params, x)
    default = lowered.compile()
    _skip_unless_hoisted(default)
    assert cpu_compile.options_for(default) == cpu_compile.LOOP_OPTIONS  # asked, then refused
    candidate = lowered.compile(compiler_options=cpu_compile.LOOP_OPTIONS)
    assert 2 * candidate.memory_analysis().temp_size_in_bytes <= (
        default.memory_analysis().temp_size_in_bytes
    )
    assert cpu_compile.loop_heavy_ops(candidate.as_text()) > cpu_compile.loop_heavy_ops(
        default.as_text()
    )
    assert cpu_compile.compile_lowered(lowered)[1] == {}


def test_loop_facts_read_from_module_text():
    text = """HloModule m

%inner (p: f32[2]) -> f32[2] {
  ROOT %dot.1 = f32[2]{0} dot(%p, %p), lhs_contracting_dims={0}
}

%body (t: (s32[], f32[2])) -> (s32[], f32[2]) {
  %f = f32[2]{0} fusion(%x), kind=kCustom, calls=%inner
  %c.2 = f32[2]{0} convolution(%a, %b), window={size=1}
}

%cond (t: (s32[], f32[2])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outside (p: f32[2]) -> f32[2] {
  ROOT %dot.9 = f32[2]{0} dot(%p, %p), lhs_contracting_dims={0}
}

ENTRY %main (w: bf16[4,8], v: f32[3]) -> f32[2] {
  %w = bf16[4,8]{1,0} parameter(0), metadata={op_name="w"}
  %v = f32[3]{0} parameter(1)
  %wrapped_convert.3 = f32[4,8]{1,0} fusion(%w), kind=kLoop, calls=%outside
  %call.2 = f64[4,8]{1,0} call(%w), to_apply=%outside
  %slice.1 = f32[2,8]{1,0} fusion(%w), kind=kLoop, calls=%outside
  %copy.1 = f32[3]{0} copy(%v)
  %while.1 = (s32[], f32[2]) while(%t), condition=%cond, body=%body
}
"""
    assert cpu_compile.loop_heavy_ops(text) == 2  # %inner's dot (through the fusion), the conv
    # converted copies of a parameter, whatever XLA named them; not a slice, not a plain copy
    assert cpu_compile.hoisted_convert_bytes(text) == 4 * 8 * 4 + 4 * 8 * 8
    assert cpu_compile.hoisted_convert_bytes(text.replace("ENTRY ", "")) == 0  # not the entry


def test_signatures_past_the_limit_take_the_default_unjudged(saved, small_budget):
    from jaxexp_mlflow.runtime import model as model_mod

    path, fn, params = saved["encoder"]
    model = mlflow.jaxexp.load_model(str(path))
    for i in range(model_mod._MAX_ROUTES):  # a model called with as many shapes before
        model._routes[("earlier", i)] = model._jit_call
    x = tokens(64)
    np.testing.assert_allclose(
        np.asarray(model(x)), np.asarray(jax.jit(fn)(params, x)), rtol=RTOL, atol=ATOL
    )
    assert len(model._routes) == model_mod._MAX_ROUTES
    assert (x.shape, x.dtype) not in model._routes
