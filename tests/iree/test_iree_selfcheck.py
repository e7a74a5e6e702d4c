"""No IREE model hands out numbers it has not checked (``iree/selfcheck.py``), every failure of
the IREE runtime is typed (``iree/failures.py``), and a refusal names every way out.

Skipped where the ``iree`` extra is not installed.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("iree.runtime")
pytest.importorskip("iree.compiler")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxexp_mlflow.flavors.jaxexp as flavor  # noqa: E402
from jaxexp_mlflow.errors import IncompatibleError  # noqa: E402
from jaxexp_mlflow.iree import loader, selfcheck, specialize  # noqa: E402
from jaxexp_mlflow.store.model_files import read_model_files  # noqa: E402


def scaled(params, x):
    """recurrentgemma's embedder scale: a bfloat16 rounding IREE folds away on its own."""
    return x * jnp.sqrt(params["w"]).astype(jnp.bfloat16).astype(jnp.float32)


PARAMS = {"w": np.float32(32.0)}
X = np.arange(1, 7, dtype=np.float32).reshape(2, 3)


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("selfcheck") / "scaled"
    flavor.save_model(jax.jit(scaled), path, params=PARAMS, input_example=X)
    return path


def test_other_numbers_than_the_reference_are_refused_at_load(scaled_dir, tmp_path, monkeypatch):
    """Compiled as IREE compiles it alone (the rounding folded: 5.656854 for 5.65625), the model
    is refused by load_model itself, naming the largest difference, never handed out."""
    monkeypatch.setattr(specialize, "rounded_text", lambda module, timeout=600.0: module)
    monkeypatch.setattr(loader, "static_wanted", lambda meta, description: False)
    with pytest.raises(IncompatibleError, match="does not reproduce its stored reference") as err:
        flavor.load_model(str(scaled_dir), backend="iree", iree_cache=str(tmp_path / "cache"))
    message = str(err.value.message)
    assert "largest difference in output 0 (float32[2, 3]): 0.00362" in message
    assert "rtol=1e-05, atol=1e-06" in message and "backend='jax'" in message


def test_the_model_reproducing_its_reference_loads(scaled_dir):
    model = flavor.load_model(str(scaled_dir), backend="iree")
    np.testing.assert_array_equal(model(X), np.asarray(scaled(PARAMS, X)))


def test_a_model_without_reference_is_loaded_with_one_warning(scaled_dir, caplog):
    """Models saved before references were stored: nothing to check, said once per model."""
    meta = dict(read_model_files(str(scaled_dir)).flavor)
    del meta["reference"]
    with caplog.at_level(logging.WARNING, logger=selfcheck.__name__):
        for _ in range(2):
            model = loader.load_directory(scaled_dir, meta)
    said = [r for r in caplog.records if "carries no reference" in r.getMessage()]
    assert len(said) == 1 and str(scaled_dir) in said[0].getMessage()
    assert model(X).shape == (2, 3)


def test_a_failure_of_the_iree_runtime_is_typed_with_the_module_and_the_way_out():
    """The runtime's own status (here: an input the compiled function does not take, past the
    model's shape checks) is an IncompatibleError naming the module, never a bare error."""
    spec = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    data = jax.export.export(jax.jit(lambda x: x * 2))(spec).serialize()
    model = loader.build(data, {}, source="doubling")
    with pytest.raises(IncompatibleError, match="The IREE runtime failed running") as err:
        model._invoke(model._runner, [np.ones((5, 7), np.float32)])
    message = str(err.value.message)
    assert "the blob's StableHLO module" in message and "shape dimension 0 mismatch" in message
    assert "backend='jax'" in message and "batch_polymorphic=False" in message


def carried(params, x):
    """A ``lax.scan`` whose carry is ``[b, 1, 1, 1]``: IREE cannot specialize its loop."""

    def body(c, _):
        return jnp.tanh(c * params["w"] + 0.5).reshape(c.shape[0], 1, 1, 1), None

    c, _ = jax.lax.scan(body, x[:, 0, 0, 0].reshape(x.shape[0], 1, 1, 1), None, length=3)
    return x * c


def test_a_refused_symbolic_batch_names_batch_polymorphic_false_which_runs(tmp_path):
    params = {"w": np.float32(0.7)}
    x = np.random.default_rng(0).standard_normal((2, 4, 4, 3)).astype(np.float32)
    flavor.save_model(jax.jit(carried), tmp_path / "poly", params=params, input_example=x)
    with pytest.raises(IncompatibleError, match="batch_polymorphic=False") as err:
        flavor.load_model(str(tmp_path / "poly"), backend="iree")
    assert "backend='jax'" in str(err.value.message)
    flavor.save_model(
        jax.jit(carried),
        tmp_path / "static",
        params=params,
        input_example=x,
        batch_polymorphic=False,
    )
    model = flavor.load_model(str(tmp_path / "static"), backend="iree")
    np.testing.assert_allclose(model(x), np.asarray(carried(params, x)), rtol=1e-6, atol=1e-6)


def test_nan_where_the_reference_has_nan_reproduces(tmp_path):
    """A model whose reference outputs hold NaN (log of a negative input) loads on IREE, and
    ``jaxexp verify``'s comparison takes NaN for NaN (it reported a mismatch)."""
    from jaxexp_mlflow.archive.reproduce import compare_outputs, verify_directory

    def logged(params, x):
        return jnp.log(x) * params["s"]

    x = np.array([[1.0, -1.0, 2.0], [0.5, -3.0, 4.0]], np.float32)
    flavor.save_model(jax.jit(logged), tmp_path / "m", params={"s": np.float32(2)}, input_example=x)
    model = flavor.load_model(str(tmp_path / "m"), backend="iree")
    assert np.isnan(model(x)).sum() == 2
    assert all(c.passed for c in verify_directory(model, tmp_path / "m"))
    (check,) = compare_outputs([np.float32([np.nan, 1.0])], [np.float32([np.nan, 1.0])])
    assert check.passed and check.max_abs_err == 0.0
    (check,) = compare_outputs([np.float32([1.0, 1.0])], [np.float32([np.nan, 1.0])])
    assert not check.passed
