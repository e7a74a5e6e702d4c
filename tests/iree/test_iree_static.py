"""Symbolic-batch models on IREE compiled per batch size, params bound into the module.

IREE 3.13 cannot compile a flatten (``dynamic_reshape``) or an embedding lookup (``gather``) of a
symbolic batch; the flavor specializes ``main`` to static shapes for each batch size it is called
with (``iree/specialize.py``, no JAX), padding to powers of two where the rows are proven
independent, and binds the params into the module as IREE parameters (packed once at load).
Real Flax NNX models, saved and loaded through ``mlflow.jaxexp`` and pyfunc.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("iree.runtime")
pytest.importorskip("iree.compiler")
nnx = pytest.importorskip("flax.nnx")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import mlflow  # noqa: E402

import jaxexp_mlflow  # noqa: E402,F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import IncompatibleError  # noqa: E402
from jaxexp_mlflow.iree import specialize  # noqa: E402
from jaxexp_mlflow.iree.static import StaticIreeModel, padded_size  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5  # docs/longevity.md's float32 tolerance, with IREE's last-bit slack


class Cnn(nnx.Module):
    """Conv, average pool and a flatten ``x.reshape(x.shape[0], -1)``: a dynamic_reshape."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 4, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(jax.nn.relu(self.conv(x)), window_shape=(2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


class Encoder(nnx.Module):
    """An embedding lookup (a gather of the symbolic batch) and a head split."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(50, 16, rngs=rngs)
        self.qkv = nnx.Linear(16, 48, rngs=rngs)
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        heads = lambda a: a.reshape(b, t, 2, 8)  # noqa: E731
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)), axis=-1)
        a = jnp.einsum("bhqk,bkhd->bqhd", w, heads(v)).reshape(b, t, 16)
        return self.head(a.mean(axis=1))


def as_function(module: nnx.Module):
    graphdef, state = nnx.split(module)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(state))

    def f(params, x):
        s = jax.tree.map(lambda a: a, state)
        nnx.replace_by_pure_dict(s, params)
        return nnx.merge(graphdef, s)(x)

    return jax.jit(f), params


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8, 8, 1)).astype(np.float32)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50, (n, 6), dtype=np.int32)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    f, params = as_function(Cnn(nnx.Rngs(0)))
    path = tmp_path_factory.mktemp("static") / "cnn"
    mlflow.jaxexp.save_model(f, path, params=params, input_example=images(3))
    return f, params, path


@pytest.mark.parametrize("build, data", [(Cnn, images), (Encoder, tokens)], ids=["cnn", "encoder"])
def test_symbolic_batch_model_runs_per_padded_batch_size(build, data, tmp_path, request):
    if build is Cnn:  # the module's saved CNN: the same model, saved the same way
        f, params, path = request.getfixturevalue("cnn")
    else:
        f, params = as_function(build(nnx.Rngs(0)))
        path = tmp_path / "m"
        mlflow.jaxexp.save_model(f, path, params=params, input_example=data(3))
    model = mlflow.jaxexp.load_model(path, backend="iree")
    assert isinstance(model, StaticIreeModel) and model.pads
    reasons = model.verdict.reasons  # the gather and/or reshape: warnings, not refusals
    assert reasons and {(r.code, r.severity) for r in reasons} == {("iree_ops", "warn")}
    for n in (1, 3, 5, 8):
        x = data(n, seed=n)
        np.testing.assert_allclose(model(x), np.asarray(f(params, x)), rtol=RTOL, atol=ATOL)
    assert model.sizes() == [1, 4, 8]  # 3 rows padded to 4, 5 to 8; 8 reuses 8
    predicted = mlflow.pyfunc.load_model(str(path), model_config={"backend": "iree"}).predict(
        data(3)
    )
    np.testing.assert_allclose(predicted, np.asarray(f(params, data(3))), rtol=RTOL, atol=ATOL)


def test_params_are_bound_into_the_module_not_passed(cnn):
    """The compiled ``main`` takes the input alone; the params reach it as IREE parameters."""
    f, params, path = cnn
    model = mlflow.jaxexp.load_model(path, backend="iree")
    declaration = model._vm_function.reflection["iree.abi.declaration"]
    assert declaration.count("%input") == 1, declaration
    assert model._params == {} and model._bound


def test_rows_not_independent_run_at_their_own_size(tmp_path):
    """A model whose rows depend on each other (centred over the batch) is never padded: each
    batch size gets its own module, and the outputs are JAX's."""

    def centred(params, x):
        y = (x - x.mean(axis=0)).reshape(x.shape[0], -1)  # a flatten: dynamic_reshape
        return y @ params["w"]

    params = {"w": np.random.default_rng(1).standard_normal((8, 2)).astype(np.float32)}
    x3 = np.random.default_rng(0).standard_normal((3, 2, 4)).astype(np.float32)
    mlflow.jaxexp.save_model(jax.jit(centred), tmp_path / "m", params=params, input_example=x3)
    meta = mlflow.models.Model.load(str(tmp_path / "m")).flavors["jaxexp"]
    assert meta["padding"]["rows_independent"] is False
    model = mlflow.jaxexp.load_model(tmp_path / "m", backend="iree")
    assert isinstance(model, StaticIreeModel) and not model.pads
    for n in (3, 5):
        x = np.random.default_rng(n).standard_normal((n, 2, 4)).astype(np.float32)
        np.testing.assert_allclose(model(x), np.asarray(centred(params, x)), rtol=RTOL, atol=ATOL)
    assert model.sizes() == [1, 3, 5]


def test_a_loop_over_a_symbolic_carry_is_refused_with_the_op(tmp_path):
    """What the specialization does not refine (a while loop carrying a symbolic shape) is an
    IncompatibleError at load naming what is left dynamic, never a half-specialized compile."""

    def looped(params, x):
        def body(_, c):
            return jnp.tanh(c.reshape(c.shape[0], -1) @ params["w"]).reshape(c.shape)

        return jax.lax.fori_loop(0, 3, body, x)

    params = {"w": np.eye(8, dtype=np.float32)}
    x = np.random.default_rng(0).standard_normal((2, 2, 4)).astype(np.float32)
    mlflow.jaxexp.save_model(jax.jit(looped), tmp_path / "m", params=params, input_example=x)
    with pytest.raises(IncompatibleError, match="dynamic type is left"):
        mlflow.jaxexp.load_model(tmp_path / "m", backend="iree")


def test_specialize_refuses_a_shape_main_does_not_take(cnn):
    _, _, path = cnn
    module = (path / "exported.bin").read_bytes()
    from jaxexp_mlflow.codec import reader

    text = specialize.stablehlo_text(reader.read_module(module))
    assert "func.func public @main" in text and "vhlo." not in text
    with pytest.raises(specialize.SpecializeError, match="not of shape"):
        specialize.specialize(text, ((4,), (3, 3, 1, 4), (3,), (64, 3), (2, 8, 8, 2)))


@pytest.mark.parametrize("n, size", [(1, 1), (2, 2), (3, 4), (5, 8), (1024, 1024), (1025, 2048)])
def test_padded_size_is_the_next_power_of_two(n, size):
    assert padded_size(n) == size


def test_single_channel_convolution_becomes_im2col(cnn):
    """The first convolution of a grey-image CNN (one input channel) is compiled as patches @
    kernel (``iree/rewrites.py``): no convolution is left in the specialized module, and the
    outputs above stay within the tolerance."""
    from jaxexp_mlflow.codec import blob, reader
    from jaxexp_mlflow.iree.model import sized_entry

    _, params, path = cnn
    data = (path / "exported.bin").read_bytes()
    entry = sized_entry(specialize.STATIC, blob.describe(data, source="t"), 4, 2)
    text = specialize.static_main(reader.read_module(data), entry.inputs, entry.outputs)
    assert "stablehlo.convolution" not in text and "stablehlo.dot_general" in text


def test_large_batches_run_on_the_task_driver(cnn):
    """Where no driver was asked for, a bucket of TASK_MIN_ROWS rows or more runs on IREE's
    thread pool (``local-task``, a device of its own), smaller ones on the calling thread; the
    outputs are JAX's either way. A driver asked for is kept for every size."""
    from jaxexp_mlflow.iree.static import TASK_DRIVER, TASK_MIN_ROWS

    f, params, path = cnn
    model = mlflow.jaxexp.load_model(path, backend="iree")
    assert model.splits_drivers
    assert model.driver_for(TASK_MIN_ROWS // 2) == "local-sync"
    assert model.driver_for(TASK_MIN_ROWS) == TASK_DRIVER
    for n in (1, TASK_MIN_ROWS + 8, 2):  # 40 rows: the 64-row bucket
        x = images(n, seed=n)
        np.testing.assert_allclose(model(x), np.asarray(f(params, x)), rtol=RTOL, atol=ATOL)
    small, large = model._functions[1], model._functions[2 * TASK_MIN_ROWS]
    assert small.device is not large.device and large.device is model._task[0].device
    chosen = mlflow.jaxexp.load_model(path, backend="iree", iree_driver="local-sync")
    assert not chosen.splits_drivers and chosen.driver_for(1024) == "local-sync"
    x = images(TASK_MIN_ROWS, seed=5)
    np.testing.assert_allclose(chosen(x), np.asarray(f(params, x)), rtol=RTOL, atol=ATOL)
    assert chosen._task is None


def test_a_small_size_is_timed_on_both_drivers_past_the_trial_time(cnn, monkeypatch):
    """A size under TASK_MIN_ROWS whose ``local-sync`` call takes at least the trial time is
    timed on both drivers at its first use and kept on the faster: the recorded driver is the
    one its function runs on, and every driver gives the same bytes. Under the trial time (this
    small CNN: ~0.05 ms a call, against 50 ms) or with the trial off, the size stays on
    ``local-sync`` and no thread pool is made."""
    from jaxexp_mlflow.iree.static import ENV_TRIAL, TASK_DRIVER, trial_ms

    f, params, path = cnn
    x = images(2, seed=11)
    want = {}
    for driver in ("local-sync", TASK_DRIVER):  # the same compiled code on either driver
        want[driver] = np.asarray(
            mlflow.jaxexp.load_model(path, backend="iree", iree_driver=driver)(x)
        )
    np.testing.assert_array_equal(want["local-sync"], want[TASK_DRIVER])
    np.testing.assert_allclose(want["local-sync"], np.asarray(f(params, x)), rtol=RTOL, atol=ATOL)

    monkeypatch.setenv(ENV_TRIAL, "0")  # every size is timed on both
    model = mlflow.jaxexp.load_model(path, backend="iree")
    asked, vmfb_for = [], model._vmfb_for
    model._vmfb_for = lambda size: asked.append(size) or vmfb_for(size)
    np.testing.assert_array_equal(model(x), want["local-sync"])
    assert asked == [2]  # both drivers load the size's one .vmfb: nothing compiled twice
    chosen = model.driver_for(2)
    assert model._task is not None  # the trial made the thread pool's function
    device = model._task[0].device if chosen == TASK_DRIVER else model._config.device
    assert model._functions[2].device is device
    np.testing.assert_array_equal(model(x), want["local-sync"])

    for setting in ("50", "off"):  # a trial time this CNN's ~0.05 ms call never reaches; none
        monkeypatch.setenv(ENV_TRIAL, setting)
        model = mlflow.jaxexp.load_model(path, backend="iree")
        np.testing.assert_array_equal(model(x), want["local-sync"])
        assert model.driver_for(2) == "local-sync" and model._task is None
    monkeypatch.setenv(ENV_TRIAL, "soon")
    with pytest.raises(ValueError, match="expected milliseconds"):
        trial_ms()


def test_branches_and_a_multi_platform_export_run_per_batch_size(tmp_path):
    """A ``lax.cond`` and an export for ``("cpu", "cuda")`` (which dispatches on a platform
    index, its first argument) both lower to ``stablehlo.case``, whose branches are specialized
    too; the task driver's modules get the platform index uploaded to their own device."""
    from jaxexp_mlflow.iree.static import TASK_MIN_ROWS

    def f(params, x):
        h = jax.lax.cond(params["v"][0, 0] > 0, jnp.tanh, jnp.sin, x @ params["w"])
        return h @ params["v"]

    rng = np.random.default_rng(1)
    params = {
        k: rng.standard_normal(s).astype(np.float32) for k, s in (("w", (6, 8)), ("v", (8, 2)))
    }
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    (b,) = jax.export.symbolic_shape("b")
    exp = jax.export.export(jax.jit(f), platforms=("cpu", "cuda"))(
        spec, jax.ShapeDtypeStruct((b, 6), np.float32)
    )
    rows = lambda n: rng.standard_normal((n, 6)).astype(np.float32)  # noqa: E731
    mlflow.jaxexp.save_model(exp, tmp_path / "m", params=params, input_example=rows(3))
    model = mlflow.jaxexp.load_model(tmp_path / "m", backend="iree")
    assert isinstance(model, StaticIreeModel) and model._platform_arg is not None
    for n in (3, TASK_MIN_ROWS):
        x = rows(n)
        np.testing.assert_allclose(model(x), np.asarray(f(params, x)), rtol=RTOL, atol=ATOL)
    assert model._task is not None and model._task[2] is not None


def test_big_batches_run_in_chunks(cnn, monkeypatch):
    """A padded model runs a batch of more than CHUNK_ROWS rows as chunks of that many (each
    padded as usual), with JAX's outputs; ``JAXEXP_IREE_CHUNK_ROWS=0`` runs it whole."""
    from jaxexp_mlflow.iree.static import CHUNK_ROWS, ENV_CHUNK

    f, params, path = cnn
    assert mlflow.jaxexp.load_model(path, backend="iree").chunk_rows == CHUNK_ROWS
    monkeypatch.setenv(ENV_CHUNK, "4")
    model = mlflow.jaxexp.load_model(path, backend="iree", iree_driver="local-sync")
    x = images(10, seed=3)
    np.testing.assert_allclose(model(x), np.asarray(f(params, x)), rtol=RTOL, atol=ATOL)
    assert model.sizes() == [1, 2, 4]  # chunks of 4, 4 and 2 rows; never a 16-row module
    monkeypatch.setenv(ENV_CHUNK, "0")
    whole = mlflow.jaxexp.load_model(path, backend="iree", iree_driver="local-sync")
    np.testing.assert_allclose(whole(x), np.asarray(f(params, x)), rtol=RTOL, atol=ATOL)
    assert whole.sizes() == [1, 4, 16]  # 4: the 3-row reference, run at load (selfcheck)
    monkeypatch.setenv(ENV_CHUNK, "many")
    with pytest.raises(ValueError, match="expected a number of rows"):
        mlflow.jaxexp.load_model(path, backend="iree")


def _child_calls(model, xs, path, queue):  # in a forked child
    outs = [np.asarray(model(x)) for x in xs]
    try:
        mlflow.jaxexp.load_model(path, backend="iree", iree_driver="local-task")
        refused = None
    except IncompatibleError as err:
        refused = str(err)
    queue.put((outs, refused))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork of a process with threads
def test_a_forked_child_runs_every_size_on_the_calling_thread(cnn):
    """IREE's task driver does not survive ``fork`` (its worker threads stay in the parent): a
    forked child of a process that ran it runs every size on ``local-sync``, with the same
    outputs, instead of waiting forever; asking for ``local-task`` there is refused."""
    import multiprocessing

    from jaxexp_mlflow.iree import model as iree_model
    from jaxexp_mlflow.iree.static import TASK_MIN_ROWS

    f, params, path = cnn
    model = mlflow.jaxexp.load_model(path, backend="iree")
    xs = [images(TASK_MIN_ROWS + 8, seed=7), images(1, seed=8)]
    want = [np.asarray(model(x)) for x in xs]  # the parent runs 64 rows on local-task
    assert model._task is not None and iree_model._TASK_OWNER[0] != 0
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_calls, args=(model, xs, path, queue))
    child.start()
    child.join(120)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0, "the forked child hung or failed"
    outs, refused = queue.get(timeout=10)
    for got, expected in zip(outs, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    assert refused and "local-sync" in refused, refused
    np.testing.assert_allclose(model(xs[0]), want[0], rtol=RTOL, atol=ATOL)  # parent unchanged
