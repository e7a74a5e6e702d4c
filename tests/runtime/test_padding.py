"""Padding to buckets never changes an answer: rows proven independent at save.

Real models whose rows are not independent (a graph network with segment sums over edges,
attention across the batch, BatchNorm in training mode) are recorded ``rows_independent:
false`` and called at each batch's own size through every door; a per-row MLP is proven and
keeps its buckets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest
import yaml

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.flavors.jaxexp import _load_pyfunc
from jaxexp_mlflow.runtime import rows
from tests.models import batch, export_mlp, gnn, gnn_params, mlp_apply, mlp_params

FAST = {"buckets": [1, 2, 4, 8], "compilation_cache": False}
F = 4


@pytest.fixture(autouse=True)
def _no_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXEXP_COMPILATION_CACHE", str(tmp_path / "xla-cache"))


def padding_record(path) -> dict | None:
    return yaml.safe_load((path / "MLmodel").read_text())["flavors"]["jaxexp"].get("padding")


# -- a graph network: messages summed over edges into nodes ---------------------------------------


def graph(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` nodes and ``n`` edges (a ring plus random edges)."""
    rng = np.random.default_rng(seed)
    nodes = rng.standard_normal((n, F)).astype(np.float32)
    senders = np.arange(n, dtype=np.int32)
    receivers = rng.integers(0, n, n, dtype=np.int32)
    return nodes, senders, receivers


def test_graph_network_is_never_padded(tmp_path):
    params = gnn_params()
    path = tmp_path / "gnn"
    mlflow.jaxexp.save_model(jax.jit(gnn), path, params=params, input_example=graph(4))
    record = padding_record(path)
    assert record["rows_independent"] is False, record
    assert "filler" in record["proof"] or "changes" in record["proof"]

    impl = _load_pyfunc(str(path), FAST)
    assert not impl._bucketed
    model = mlflow.jaxexp.load_model(str(path))
    for n in (3, 5, 7):  # 5 and 7 would be padded to 8 by buckets; 3 to 4
        g = graph(n, seed=n)
        want = np.asarray(model(*g))
        got = impl.predict({"nodes": g[0], "senders": g[1], "receivers": g[2]})
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(want, gnn(params, *g), rtol=1e-5, atol=1e-5)
    via_mlflow = mlflow.pyfunc.load_model(str(path), model_config=FAST)
    g = graph(5, seed=5)
    out = via_mlflow.predict({"nodes": g[0], "senders": g[1], "receivers": g[2]})
    np.testing.assert_array_equal(out, np.asarray(model(*g)))


# -- rows mixed across the batch ------------------------------------------------------------------


def attention_over_batch():
    """Flax NNX self-attention whose sequence axis is the batch: every row attends to all."""
    from flax import nnx

    attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(attn)

    def apply(state, x):
        return nnx.merge(graphdef, state)(x[None])[0]

    return jax.jit(apply), state


def batchnorm_training():
    """Flax NNX BatchNorm normalising with the batch's own statistics (training mode)."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, use_running_average=False, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    return jax.jit(apply), state


@pytest.mark.parametrize("build", [attention_over_batch, batchnorm_training])
@pytest.mark.parametrize("example_rows", [1, 3])
def test_models_that_mix_rows_are_not_padded(build, example_rows, tmp_path):
    fn, state = build()
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(fn, path, params=state, input_example=batch(example_rows))
    assert padding_record(path)["rows_independent"] is False
    impl = _load_pyfunc(str(path), FAST)
    assert not impl._bucketed
    model = mlflow.jaxexp.load_model(str(path))
    for n in (3, 5):
        x = batch(n, seed=n)
        np.testing.assert_array_equal(impl.predict(x), np.asarray(model(x)))


# -- a per-row MLP keeps its buckets --------------------------------------------------------------


def test_per_row_mlp_is_proven_and_keeps_buckets(tmp_path):
    params = mlp_params()
    path = tmp_path / "mlp"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch(3))
    record = padding_record(path)
    assert record["rows_independent"] is True, record
    impl = _load_pyfunc(str(path), FAST)
    assert impl._bucketed
    model = mlflow.jaxexp.load_model(str(path))
    for n in (3, 5, 7):
        x = batch(n, seed=n)
        # padded to its bucket, each row as the unpadded call gives it, to XLA's rounding of
        # another batch size (jax 0.12's XLA:CPU differs by 1 ulp between sizes)
        np.testing.assert_allclose(impl.predict(x), np.asarray(model(x)), rtol=1e-6, atol=1e-7)
    assert impl._flat._cache_size() == 2  # buckets 4 and 8, not one compile per size


def test_without_example_the_proof_uses_a_probe(tmp_path):
    params = mlp_params()
    path = tmp_path / "mlp"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params)
    record = padding_record(path)
    assert record["rows_independent"] is True and "synthetic probe" in record["proof"]


def test_a_model_without_the_record_is_not_padded(tmp_path):
    """An MLmodel written before the record existed: called at each batch's own size."""
    params = mlp_params()
    path = tmp_path / "old"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch(2))
    meta = yaml.safe_load((path / "MLmodel").read_text())
    del meta["flavors"]["jaxexp"]["padding"]
    (path / "MLmodel").write_text(yaml.safe_dump(meta))
    impl = _load_pyfunc(str(path), FAST)
    assert not impl._bucketed
    x = batch(3)
    np.testing.assert_allclose(impl.predict(x), mlp_apply(params, x), rtol=1e-5, atol=1e-6)
    assert impl._flat._cache_size() == 1  # its own size, 3: no bucket of 4


def test_a_damaged_record_is_refused(tmp_path):
    from jaxexp_mlflow.errors import ArtifactError
    from jaxexp_mlflow.store.section import FlavorSection

    with pytest.raises(ArtifactError, match="padding.rows_independent"):
        FlavorSection.from_dict({"exported_sha256": "0" * 64, "padding": {"rows_independent": 1}})


# -- the proof itself -----------------------------------------------------------------------------


def test_proof_on_plain_functions():
    x = batch(4)
    per_row = rows.prove(lambda ls: [np.asarray(jnp.tanh(ls[0]))], [x], source="t")
    assert per_row["rows_independent"] is True
    # the mean over the batch: every real row changes with the padding
    mean = rows.prove(lambda ls: [np.asarray(ls[0] - ls[0].mean(0))], [x], source="t")
    assert mean["rows_independent"] is False
    # a function of the batch size only: fillers agree with each other, not with the unpadded
    size = rows.prove(lambda ls: [ls[0] * ls[0].shape[0]], [x], source="t")
    assert size["rows_independent"] is False and "changes" in size["proof"]

    def fails(ls):
        raise RuntimeError("boom")

    assert rows.prove(fails, [x], source="t")["rows_independent"] is False
    assert rows.filler(np.arange(3), 4, "reversed").tolist() == [2, 1, 0, 2]


def test_proof_reuses_the_reference_run():
    """Given the unpadded outputs (the save's reference run), the proof runs only the padded
    batches, and judges against what it was given."""
    x = batch(4)
    seen = []

    def call(ls):
        seen.append(ls[0].shape[0])
        return [np.asarray(jnp.tanh(ls[0]))]

    exact = [np.asarray(jnp.tanh(x))]
    assert rows.prove(call, [x], source="t", exact=exact)["rows_independent"] is True
    assert seen == [4 + rows.fill_count(4)] * len(rows.FILLERS)  # no unpadded run
    wrong = rows.prove(call, [x], source="t", exact=[exact[0] + 1.0])
    assert wrong["rows_independent"] is False and "changes" in wrong["proof"]


# -- a scoring server compiles its buckets in the background --------------------------------------


def test_server_compiles_buckets_in_the_background(tmp_path):
    """Inside a server (``serving=True``) the load starts a thread for the buckets and returns:
    the first request runs meanwhile; ``precompile: true`` still compiles them during the load."""
    from jaxexp_mlflow.codec.mlmodel import read_mlmodel
    from jaxexp_mlflow.serving import signature as sig
    from jaxexp_mlflow.serving.pyfunc import JaxExpPyfunc
    from jaxexp_mlflow.store.section import flavor_section

    params = mlp_params()
    path = tmp_path / "mlp"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch(3))
    ins, outs = sig.specs_from_conf(flavor_section(read_mlmodel(path)))
    model = mlflow.jaxexp.load_model(str(path))

    def load(config):
        return JaxExpPyfunc(
            model, config, inputs=ins, outputs=outs, serving=True, rows_independent=True
        )

    impl = load(FAST)
    assert impl.policy.background and impl._precompiling is not None
    x = batch(3)
    np.testing.assert_allclose(impl.predict(x), mlp_apply(params, x), rtol=1e-5, atol=1e-6)
    impl._precompiling.join(timeout=300)
    assert not impl._precompiling.is_alive()
    assert impl._flat.compiles + impl._flat.loaded == 4  # every bucket, each once

    eager = load({**FAST, "precompile": True})
    assert eager._precompiling is None and eager._flat.compiles + eager._flat.loaded == 4


# -- through a real `mlflow models serve` ---------------------------------------------------------


@pytest.mark.slow
def test_mlflow_models_serve_answers_what_load_model_computes(tmp_path):
    """The graph network of the issue (N == E in the example, one shared symbol) served by
    ``mlflow models serve``: a 5-node, 5-edge graph is not padded to 8 (the last edge summed
    again was 4.04 off), and the answer is load_model's."""
    import os
    from pathlib import Path

    from tests.servers import post, start_server, stop_server

    params = gnn_params()
    path = tmp_path / "gnn"
    mlflow.jaxexp.save_model(jax.jit(gnn), path, params=params, input_example=graph(4))
    model = mlflow.jaxexp.load_model(str(path))
    repo = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
        "JAXEXP_COMPILATION_CACHE": str(tmp_path / "xla"),
    }
    proc, url = start_server(str(path), "local", env, tmp_path / "serve.log")
    try:
        for n in (5, 7):
            g = graph(n, seed=n)
            names = ("nodes", "senders", "receivers")
            body = {"inputs": {k: v.tolist() for k, v in zip(names, g, strict=True)}}
            r = post(url, body)
            assert r.status_code == 200, r.text[:500]
            got = np.asarray(r.json()["predictions"], np.float32)
            np.testing.assert_array_equal(got, np.asarray(model(*g)))
    finally:
        stop_server(proc)
