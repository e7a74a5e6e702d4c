"""JAX transformations of a loaded model: what works, and honest errors for what cannot.

jax.export serializes reverse-mode derivatives only (up to ``vjp_order``) and its call_exported
primitive has no batching rule, so forward mode and vmap must say so, not "inputs do not match".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import InputError, UnsupportedTransformError
from tests.models import batch, export_mlp, mlp_apply, mlp_params


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    params = mlp_params()
    path = tmp_path_factory.mktemp("transforms") / "m"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, vjp_order=1)
    return mlflow.jaxexp.load_model(str(path)), params


def _scalar(model):
    return lambda x: jnp.sum(model(x))


@pytest.mark.parametrize(
    "transform",
    [
        lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),)),
        lambda f, x: jax.jacfwd(f)(x),
        lambda f, x: jax.hessian(f)(x),
    ],
    ids=["jvp", "jacfwd", "hessian"],
)
def test_forward_mode_names_the_limit_and_reverse_mode(model, transform):
    loaded, _ = model
    with pytest.raises(
        UnsupportedTransformError,
        match=r"(?s)reverse-mode.*jax\.grad or jax\.vjp.*1 time.*jax\.lax\.map",
    ):
        transform(_scalar(loaded), batch(3))


def test_vmap_names_the_limit_and_lax_map_works(model):
    loaded, params = model
    xs = batch(6).reshape(3, 2, 8)
    with pytest.raises(UnsupportedTransformError, match=r"jax\.lax\.map"):
        jax.vmap(loaded)(xs)
    # the ways out the message gives do work
    mapped = jax.lax.map(loaded, xs)
    np.testing.assert_allclose(mapped, jax.vmap(lambda x: mlp_apply(params, x))(xs), rtol=1e-5)
    np.testing.assert_allclose(loaded(xs.reshape(6, 8)), mlp_apply(params, batch(6)), rtol=1e-5)


def test_reverse_mode_within_vjp_order_works_and_mismatch_still_says_so(model):
    loaded, params = model
    x = batch(3)
    grad = jax.grad(_scalar(loaded))(x)
    want = jax.grad(lambda x: jnp.sum(mlp_apply(params, x)))(x)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)
    # the Jacobian recipe of the error message: the vjp pullback mapped over a basis
    out, pullback = jax.vjp(loaded, x)
    basis = jnp.eye(out.size, dtype=out.dtype).reshape(out.size, *out.shape)
    (rows,) = jax.lax.map(pullback, basis)
    jac = jax.jacrev(lambda x: mlp_apply(params, x))(x)
    np.testing.assert_allclose(rows.reshape(jac.shape), jac, rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="do not match"):
        loaded(np.zeros((3, 7), np.float32))


def test_forward_mode_wrt_params_is_explained_too(model):
    loaded, params = model
    with pytest.raises(UnsupportedTransformError, match="Forward-mode"):
        jax.jacfwd(lambda p: jnp.sum(loaded.call_with_params(p, batch(2))))(params)
