"""Real models (Flax NNX, Equinox, transformer-style, control flow) through the flavor and IREE.

Each builder of ``tests/models_real.py`` is saved the default way
(``batch_polymorphic=True``) and must come back through ``mlflow.jaxexp.load_model`` and
``mlflow.pyfunc`` with its own outputs; on the IREE backend each model reproduces within
docs/longevity.md's tolerances, either compiled once for every batch size or compiled
per batch size with ``main`` specialized to static shapes (the symbolic-batch gathers and
flatten reshapes IREE 3.13 cannot compile as they are), at the example's batch and at another.
``IREE_OUTCOME`` states per model which happens, so a change either way turns a test red.

The save-time export errors of functions with host callbacks (``jax.debug.callback``,
Equinox's ``eqx.error_if``) name that cause first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.archive.reproduce import DEFAULT_TOLERANCES
from jaxexp_mlflow.codec import reader
from jaxexp_mlflow.errors import UnsupportedModelError
from tests import models_real
from tests.conftest import REPO

pytest.importorskip("flax.nnx")
pytest.importorskip("equinox")

try:
    from jaxexp_mlflow.iree import verdict as iree_verdict

    HAVE_IREE = iree_verdict.iree_installed()
except ImportError:  # pragma: no cover - the oldest-jax environment has no [iree] extra
    HAVE_IREE = False

GATHER = "gather with a symbolic batch dimension"
RESHAPE = "reshape of a symbolic batch dimension"

#: What IREE 3.13 does with each model saved batch-polymorphic (the flavor's default):
#: "runs" (one module for every batch size) or the constructs it cannot compile with a symbolic
#: batch, for which the model runs compiled per batch size (iree/static.py).
IREE_OUTCOME = {
    "nnx_transformer": (GATHER, RESHAPE),  # nnx.Embed lookups; attention's head split
    "nnx_transformer_bf16": (GATHER, RESHAPE),  # the same; batch_polymorphic=False also needs the
    #                                  prepare-time drop of bf16 dot algorithms
    "nnx_batchnorm_dropout": "runs",
    "eqx_mlp": "runs",
    "eqx_attention": (GATHER, RESHAPE),  # vmap(eqx.nn.Embedding) lookups; head split
    "while_scatter": "runs",  # lax.while_loop + .at[].set scatter + scatter-add
    "list_params": "runs",  # params named layers[0].w, non_trainable[0] (a scalar)
    "linen_merged_batch": (RESHAPE,),  # [b, 8] -> [2b, 4]: dynamic_reshape
}


def tolerance(dtype: np.dtype) -> tuple[float, float]:
    """docs/longevity.md's tolerance for one output dtype (reproduce.DEFAULT_TOLERANCES):
    16-bit 2e-2, 32-bit rtol 1e-5/atol 1e-6 (IREE and XLA differ in the last bits)."""
    return DEFAULT_TOLERANCES.get(np.dtype(dtype).itemsize, (1e-5, 1e-6))


def assert_close(got, want, what: str, *, pyfunc: bool = False) -> None:
    """``got`` within the tolerance of ``want``'s dtype, of that dtype (pyfunc hands 16-bit
    floats out as float32, the dtype pandas holds: the values are the same)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    widened = pyfunc and want.dtype.itemsize == 2 and got.dtype == np.float32
    assert got.dtype == want.dtype or widened, (what, got.dtype, want.dtype)
    rtol, atol = tolerance(want.dtype)
    np.testing.assert_allclose(
        got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol, err_msg=what
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Build and save every model once (batch-polymorphic, as users save them)."""
    out = {}
    for name, build in models_real.BUILDERS.items():
        fn, params, example = build()
        want = np.asarray(fn(params, example))
        path = tmp_path_factory.mktemp("real") / name
        mlflow.jaxexp.save_model(fn, path, params=params, input_example=example)
        out[name] = (fn, params, example, want, path)
    return out


def test_every_builder_has_a_stated_iree_outcome():
    assert set(IREE_OUTCOME) == set(models_real.BUILDERS)


@pytest.mark.parametrize("name", list(models_real.BUILDERS))
def test_jax_and_pyfunc_reproduce(saved, name):
    _, _, example, want, path = saved[name]
    model = mlflow.jaxexp.load_model(path)
    np.testing.assert_array_equal(np.asarray(model(example)), want)  # the same XLA, same bits
    other = models_real.tokens(5, seed=7) if example.dtype.kind == "i" else None
    if other is None:
        other = models_real.features(5, seed=7)
    assert np.asarray(model(other)).shape == (5, *want.shape[1:])  # any batch size
    predicted = mlflow.pyfunc.load_model(str(path)).predict(example)
    assert_close(predicted, want, f"{name}: pyfunc predict", pyfunc=True)


needs_iree = pytest.mark.skipif(not HAVE_IREE, reason="the [iree] extra is not installed")


@needs_iree
@pytest.mark.parametrize("name", list(models_real.BUILDERS))
def test_iree_reproduces_at_every_batch_size(saved, name):
    fn, params, example, want, path = saved[name]
    outcome = IREE_OUTCOME[name]
    meta = mlflow.models.Model.load(str(path)).flavors["jaxexp"]
    recorded = meta["iree"].get("unsupported")
    blob = reader.read_blob((path / "exported.bin").read_bytes())
    # the save-time walk and the jax-free reading of the blob agree on the model
    assert recorded == ([] if outcome == "runs" else sorted(outcome))
    assert iree_verdict.unsupported_ops(blob, None) == recorded
    if outcome == "runs":
        model = mlflow.jaxexp.load_model(path, backend="iree")
        assert model.backend == "iree"
        assert_close(model(example), want, f"{name}: IREE")
        return

    from jaxexp_mlflow.iree.static import StaticIreeModel

    model = mlflow.jaxexp.load_model(path, backend="iree")
    assert isinstance(model, StaticIreeModel), type(model)
    warned = [r for r in model.verdict.reasons if r.code == "iree_ops"]
    assert warned and all(r.severity == "warn" for r in warned), model.verdict.reasons
    assert all(any(c in r.message for r in warned) for c in outcome), warned
    # bf16 outputs come back as bfloat16 within 2e-2 (measured: one bf16 ulp, 3.9e-3)
    assert_close(model(example), want, f"{name}: IREE per batch size")
    other = models_real.tokens(5, seed=7) if example.dtype.kind == "i" else None
    if other is None:
        other = models_real.features(5, seed=7)
    # 5 rows: padded to the 8-row module where the rows are proven independent, else its own;
    # the example's rows likewise (to the next power of two)
    assert_close(model(other), np.asarray(fn(params, other)), f"{name}: IREE, 5 rows")
    rows = len(example)
    padded = sorted({1, 1 << (rows - 1).bit_length(), 8})
    assert model.sizes() == (padded if model.pads else sorted({1, rows, 5})), model.sizes()
    assert_close(
        mlflow.pyfunc.load_model(str(path), model_config={"backend": "iree"}).predict(example),
        want,
        f"{name}: pyfunc on IREE per batch size",
        pyfunc=True,
    )


# -- export errors: the real cause first ----------------------------------------------------------


def _params():
    import jax.numpy as jnp

    return {f"layer{i}": jnp.ones((8, 8), jnp.float32) for i in range(40)}


def test_debug_callback_export_error_names_the_cause_first(tmp_path):
    import jax

    def apply(params, x):
        jax.debug.callback(lambda v: None, x)
        return x @ params["layer0"]

    with pytest.raises(UnsupportedModelError) as err:
        mlflow.jaxexp.save_model(
            jax.jit(apply),
            tmp_path / "m",
            params=_params(),
            input_example=models_real.features(),
        )
    text = str(err.value)
    assert text.startswith("jax.export cannot serialize 'apply': it calls back into the Python")
    assert "host callbacks cannot be serialized" in text
    assert "debug_callback" in text and "jax.debug.callback" in text
    assert "EQX_ON_ERROR" not in text  # not an Equinox callback
    assert "ShapeDtypeStruct" not in text and "40 params leaves" in text  # counted, not listed
    assert len(text) < 1500


_EQX_MODEL = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, equinox as eqx, numpy as np

    def apply(params, x):
        y = x @ params["w"]
        return eqx.error_if(y, jnp.any(jnp.isnan(y)), "NaN in the output")

    params = {"w": jnp.ones((8, 8), jnp.float32)}
    x = np.ones((3, 8), np.float32)
    """
)


def test_equinox_error_if_export_error_says_set_eqx_on_error_nan(tmp_path):
    namespace: dict = {}
    exec(_EQX_MODEL, namespace)  # noqa: S102  (a fixed snippet, shared with the subprocess)
    import jax

    with pytest.raises(UnsupportedModelError) as err:
        mlflow.jaxexp.save_model(
            jax.jit(namespace["apply"]),
            tmp_path / "m",
            params=namespace["params"],
            input_example=namespace["x"],
        )
    text = str(err.value)
    assert text.startswith("jax.export cannot serialize 'apply': it calls back into the Python")
    assert "EQX_ON_ERROR=nan" in text and "eqx.error_if" in text
    assert text.index("EQX_ON_ERROR=nan") < text.index("jax said")

    assert "batch_polymorphic=False" in text and "EQX_ON_ERROR=off" in text

    # the way out works: EQX_ON_ERROR=nan before equinox is imported, a concrete batch (the NaN
    # fill of Equinox 0.13 calls numpy on the shape)
    script = _EQX_MODEL + textwrap.dedent(
        f"""
        import mlflow, jaxexp_mlflow
        mlflow.jaxexp.save_model(jax.jit(apply), {str(tmp_path / "nan")!r}, params=params,
                                 input_example=x, batch_polymorphic=False)
        y = mlflow.jaxexp.load_model({str(tmp_path / "nan")!r})(x)
        assert np.allclose(y, 8.0), y
        print("saved")
        """
    )
    env = {**os.environ, "EQX_ON_ERROR": "nan", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and "saved" in done.stdout, done.stderr[-3000:]
