"""Big batches in chunks where a bucket's temporaries pass the budget (``runtime/chunks.py``)."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.runtime import chunks
from tests.models import batch, export_mlp, mlp_apply, mlp_params

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def plan(temps: dict[int, int | None], limit: int = 100) -> tuple[chunks.ChunkPlan, list[int]]:
    asked: list[int] = []

    def temp_bytes(size: int) -> int | None:
        asked.append(size)
        return temps.get(size)

    return chunks.ChunkPlan(SIZES, temp_bytes, limit), asked


def test_small_temporaries_run_whole():
    p, asked = plan({1024: 100})
    assert p.rows(1024) == 1024 and asked == [1024]
    assert p.rows(1024) == 1024 and asked == [1024]  # chosen once


def test_linear_guess_first_then_smaller():
    # 1024 rows: 1000 bytes; the linear guess is 102 rows: bucket 64 tried first
    p, asked = plan({1024: 1000, 64: 150, 32: 90})
    assert p.rows(1024) == 32
    assert asked == [1024, 64, 32]


def test_guess_that_fits_is_taken():
    p, asked = plan({1024: 1000, 64: 60})
    assert p.rows(1024) == 64 and asked == [1024, 64]


@pytest.mark.parametrize(
    "temps",
    [
        {1024: 1000, 64: None},  # cannot tell the smaller bucket's
        {1024: None},  # cannot tell the bucket's own
        {s: 10_000 for s in SIZES},  # even one row exceeds it
    ],
)
def test_whole_when_nothing_says_cutting_helps(temps):
    p, _ = plan(temps)
    assert p.rows(1024) == 1024


def test_off_and_one_row():
    p, asked = plan({1024: 10_000}, limit=0)
    assert p.rows(1024) == 1024 and asked == []
    p, asked = plan({1: 10_000})
    assert p.rows(1) == 1 and asked == []


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv(chunks.ENV_CHUNK_TEMP_BYTES, raising=False)
    assert chunks.budget() == 32 << 20
    monkeypatch.setenv(chunks.ENV_CHUNK_TEMP_BYTES, "0")
    assert chunks.budget() == 0
    monkeypatch.setenv(chunks.ENV_CHUNK_TEMP_BYTES, "32MiB")
    with pytest.raises(ValueError, match="whole number of bytes"):
        chunks.budget()


@pytest.fixture(scope="module")
def wide_mlp(tmp_path_factory):
    """An MLP whose hidden layer (512 wide) makes temporaries grow with the rows."""
    params = mlp_params(d_hidden=512)
    path = tmp_path_factory.mktemp("m") / "wide"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch(2))
    return path, params


def test_pyfunc_runs_a_big_batch_in_chunks(wide_mlp, monkeypatch):
    path, params = wide_mlp
    limit = 64 << 10
    monkeypatch.setenv(chunks.ENV_CHUNK_TEMP_BYTES, str(limit))
    model = mlflow.pyfunc.load_model(str(path))
    impl = model._model_impl
    x = batch(300)
    want = np.asarray(mlp_apply(params, x))
    got = model.predict(x)  # bucket 512, cut into chunks of a bucket within the budget
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rows = impl._chunks.rows(512)
    assert rows < 512

    def temp(size: int) -> int:
        return impl._flat.temp_bytes(np.zeros((size, 8), np.float32))

    # XLA's own figures: the whole bucket past the budget, the chunk's bucket within it
    assert temp(512) > limit >= temp(rows)
    # the generic path (a list of rows) cuts the same way and agrees
    np.testing.assert_allclose(model.predict(x.tolist()), want, rtol=1e-5, atol=1e-5)
    # a batch past the largest bucket, cut at the largest, then into chunks
    big = batch(1100)
    np.testing.assert_allclose(
        model.predict(big), np.asarray(mlp_apply(params, big)), rtol=1e-5, atol=1e-5
    )


def test_pyfunc_whole_when_off(wide_mlp, monkeypatch):
    path, _ = wide_mlp
    monkeypatch.setenv(chunks.ENV_CHUNK_TEMP_BYTES, "0")
    model = mlflow.pyfunc.load_model(str(path))
    assert model._model_impl._chunks is None


def _temps(fn, *args) -> int:
    import jax

    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def test_load_model_call_runs_a_big_batch_in_chunks(wide_mlp, monkeypatch):
    import jax

    path, params = wide_mlp
    limit = 64 << 10
    monkeypatch.setenv(chunks.ENV_CHUNK_TEMP_BYTES, str(limit))
    model = mlflow.jaxexp.load_model(str(path))
    x = batch(300)
    want = np.asarray(mlp_apply(params, x))
    got = model(x)
    assert isinstance(got, jax.Array) and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    route = model._routes[(x.shape, x.dtype)]
    assert isinstance(route, chunks.RowChunks)
    rows = route.rows
    assert rows < 300 and rows & (rows - 1) == 0  # a power of two
    # the chunks run through the chunk size's own route, compiled for that size
    assert route.inner is model._routes[(x[:rows].shape, x.dtype)]
    # XLA's own figures: the whole batch past the budget, the chunk within it
    assert _temps(mlp_apply, params, x) > limit >= _temps(mlp_apply, params, x[:rows])
    # a JAX array in, the same rows; under a transformation the call is never cut
    np.testing.assert_allclose(np.asarray(model(jax.numpy.asarray(x))), want, rtol=1e-5, atol=1e-5)
    traced = jax.jit(lambda v: model(v))(x)
    np.testing.assert_allclose(np.asarray(traced), want, rtol=1e-5, atol=1e-5)
    # a batch that is not a multiple of the chunk: its last chunk padded, the padding dropped
    odd = batch(rows * 3 + 1)
    np.testing.assert_allclose(
        np.asarray(model(odd)), np.asarray(mlp_apply(params, odd)), rtol=1e-5, atol=1e-5
    )
    # a bigger batch is cut alike, without compiling anything for its whole size
    from jaxexp_mlflow.runtime import cpu_compile

    compiled = []
    real = cpu_compile.compile_lowered
    monkeypatch.setattr(
        cpu_compile, "compile_lowered", lambda lowered: compiled.append(1) or real(lowered)
    )
    big = batch(700)
    np.testing.assert_allclose(
        np.asarray(model(big)), np.asarray(mlp_apply(params, big)), rtol=1e-5, atol=1e-5
    )
    cut = model._routes[(big.shape, big.dtype)]
    assert isinstance(cut, chunks.RowChunks) and cut.rows == rows and cut.inner is route.inner
    assert compiled == []


def test_load_model_call_whole_when_off_or_rows_unproven(wide_mlp, tmp_path, monkeypatch):
    path, params = wide_mlp
    x = batch(300)
    monkeypatch.setenv(chunks.ENV_CHUNK_TEMP_BYTES, "0")
    model = mlflow.jaxexp.load_model(str(path))
    model(x)
    assert not isinstance(model._routes[(x.shape, x.dtype)], chunks.RowChunks)
    # saved with buckets off: no padding proof, so no cutting either, whatever the budget
    monkeypatch.setenv(chunks.ENV_CHUNK_TEMP_BYTES, str(64 << 10))
    unproven = tmp_path / "unproven"
    mlflow.jaxexp.save_model(
        export_mlp(params),
        unproven,
        params=params,
        input_example=batch(2),
        serving_config={"buckets": "off"},
    )
    model = mlflow.jaxexp.load_model(str(unproven))
    assert model.metadata["padding"]["rows_independent"] is False
    np.testing.assert_allclose(
        np.asarray(model(x)), np.asarray(mlp_apply(params, x)), rtol=1e-5, atol=1e-5
    )
    assert not isinstance(model._routes[(x.shape, x.dtype)], chunks.RowChunks)


def test_load_model_call_never_cuts_a_loop(tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    w = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32) / 8

    def steps(p, x):  # four steps of one layer, rows independent
        return jax.lax.fori_loop(0, 4, lambda _, h: jnp.tanh(h @ p["w"]), x)

    path = tmp_path / "loop"
    mlflow.jaxexp.save_model(
        jax.jit(steps), path, params={"w": w}, input_example=np.ones((2, 64), np.float32)
    )
    x = np.random.default_rng(1).normal(size=(256, 64)).astype(np.float32)
    # a budget a 64-row chunk fits and the whole batch does not: a loop-free model is cut
    limit = _temps(steps, {"w": w}, x[:64])
    assert _temps(steps, {"w": w}, x) > limit
    monkeypatch.setenv(chunks.ENV_CHUNK_TEMP_BYTES, str(limit))
    model = mlflow.jaxexp.load_model(str(path))
    assert model.metadata["padding"]["rows_independent"] is True
    np.testing.assert_allclose(
        np.asarray(model(x)), np.asarray(jax.jit(steps)({"w": w}, x)), rtol=1e-5, atol=1e-5
    )
    assert not isinstance(model._routes[(x.shape, x.dtype)], chunks.RowChunks)
    # nor through pyfunc, whose buckets are padded all the same
    served = mlflow.pyfunc.load_model(str(path))
    assert served._model_impl._chunks is None
    np.testing.assert_allclose(
        served.predict(x), np.asarray(jax.jit(steps)({"w": w}, x)), rtol=1e-5, atol=1e-5
    )
