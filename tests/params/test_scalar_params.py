"""Plain Python numbers among the params: stored with the dtype the export gives them.

An Equinox module's ``float`` field and a Flax struct dataclass's ``std_eps: float`` (brax's
``RunningStatisticsState`` is one) are exported as float32/int32 while ``jax_enable_x64`` is off;
the params are stored as those dtypes, so the save's read-back and later loads agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import ParamsMismatchError


def x3(n: int = 2) -> np.ndarray:
    return np.arange(3 * n, dtype=np.float32).reshape(n, 3)


def test_equinox_module_with_float_and_int_fields(tmp_path):
    import equinox as eqx

    class Scaled(eqx.Module):
        w: jax.Array
        eps: float
        times: int

        def __call__(self, x):
            return x @ self.w * self.times / (self.eps + 1.0)

    module = Scaled(jnp.ones((3, 2)), 1e-3, 2)

    def apply(m, x):
        return jax.vmap(m)(x)

    path = tmp_path / "eqx"
    mlflow.jaxexp.save_model(jax.jit(apply), path, params=module, input_example=x3())
    model = mlflow.jaxexp.load_model(str(path))
    np.testing.assert_allclose(model(x3(4)), apply(module, x3(4)), rtol=1e-6)
    assert model.params["eps"].dtype == jnp.float32 and model.params["times"].dtype == jnp.int32
    assert float(model.params["eps"]) == np.float32(1e-3)


def test_flax_struct_running_statistics_std_eps(tmp_path):
    """The shape of brax's ``RunningStatisticsState``: arrays plus a ``std_eps: float``."""
    from flax import struct

    @struct.dataclass
    class RunningStatistics:
        mean: jax.Array
        std: jax.Array
        std_eps: float = 0.0

    stats = RunningStatistics(jnp.zeros(3), jnp.full(3, 2.0), std_eps=1e-6)

    def normalize(s, x):
        return (x - s.mean) / (s.std + s.std_eps)

    path = tmp_path / "norm"
    mlflow.jaxexp.save_model(jax.jit(normalize), path, params=stats, input_example=x3())
    model = mlflow.jaxexp.load_model(str(path))
    np.testing.assert_allclose(model(x3(3)), normalize(stats, x3(3)), rtol=1e-6)


def test_numbers_the_export_dtype_cannot_hold_are_refused_up_front(tmp_path):
    params = {"w": np.ones((3, 2), np.float32), "k": 2**40}
    with pytest.raises(ParamsMismatchError, match=r"params\['k'\].*int32"):
        mlflow.jaxexp.save_model(
            jax.jit(lambda p, x: x @ p["w"] * p["k"]),
            tmp_path / "m",
            params=params,
            input_example=x3(),
        )
    assert not (tmp_path / "m").exists()


def test_float64_arrays_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ParamsMismatchError, match=r"jax_enable_x64 is off.*astype\(np.float32\)"):
        mlflow.jaxexp.save_model(
            jax.jit(lambda p, x: x @ p["w"]),
            tmp_path / "m",
            params={"w": np.ones((3, 2))},
            input_example=x3(),
        )
