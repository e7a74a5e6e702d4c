"""Inputs with different leading sizes: one symbol per size, or the user's own names.

A graph network takes nodes ``[N, F]`` and edges ``[E]``: logged with an example where N != E
its inputs get separate symbols, with ``polymorphic_shapes`` the user names them (needed when
the example has N == E), and a shapes specification that does not fit is a typed error.
"""

from __future__ import annotations

import jax
import mlflow
import numpy as np
import pytest
import yaml

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import InputError, UnsupportedModelError
from jaxexp_mlflow.export import batch_symbols
from jaxexp_mlflow.flavors.jaxexp import _load_pyfunc
from tests.models import gnn, gnn_params

FAST = {"buckets": [1, 2, 4, 8], "compilation_cache": False}
F = 4


def graph(n_nodes: int, n_edges: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    nodes = rng.standard_normal((n_nodes, F)).astype(np.float32)
    senders = rng.integers(0, n_nodes, n_edges, dtype=np.int32)
    receivers = rng.integers(0, n_nodes, n_edges, dtype=np.int32)
    return nodes, senders, receivers


def io_symbols(path) -> list:
    conf = yaml.safe_load((path / "MLmodel").read_text())["flavors"]["jaxexp"]
    return [e["symbols"] for e in conf["io"]["inputs"]]


def check_graphs(path, params) -> None:
    """load_model and pyfunc agree with the function on graphs of many node/edge counts."""
    model = mlflow.jaxexp.load_model(str(path))
    impl = _load_pyfunc(str(path), FAST)
    for n, e in ((3, 7), (6, 2), (5, 5)):
        g = graph(n, e, seed=n + e)
        want = np.asarray(model(*g))
        np.testing.assert_allclose(want, gnn(params, *g), rtol=1e-5, atol=1e-5)
        got = impl.predict({"nodes": g[0], "senders": g[1], "receivers": g[2]})
        np.testing.assert_array_equal(got, want)


def test_different_leading_sizes_get_separate_symbols(tmp_path):
    params = gnn_params()
    path = tmp_path / "gnn"
    mlflow.jaxexp.save_model(jax.jit(gnn), path, params=params, input_example=graph(5, 7))
    assert io_symbols(path) == [["b", None], ["b1"], ["b1"]]
    check_graphs(path, params)


def test_user_names_the_dimensions(tmp_path):
    params = gnn_params()
    path = tmp_path / "gnn"
    mlflow.jaxexp.save_model(
        jax.jit(gnn),
        path,
        params=params,
        input_example=graph(4, 4),  # N == E: only the user can say they differ
        polymorphic_shapes=("n, ...", "e", "e"),
    )
    assert io_symbols(path) == [["n", None], ["e"], ["e"]]
    check_graphs(path, params)


def test_equal_sizes_keep_one_shared_symbol():
    x = np.zeros((3, 2))
    assert batch_symbols((x, x[:, 0], np.float32(1))) == ["b", "b", None]
    assert batch_symbols((x, np.zeros(5), np.zeros((5, 1)), np.zeros(3))) == ["b", "b1", "b1", "b"]


def test_a_shapes_specification_that_does_not_fit_is_a_typed_error(tmp_path):
    params = gnn_params()
    # one symbol for nodes and edges while the example has 5 and 7
    with pytest.raises(InputError, match=r"(?s)input \[1\].*'n'.*input \[0\].*7 and 5"):
        mlflow.jaxexp.save_model(
            jax.jit(gnn),
            tmp_path / "a",
            params=params,
            input_example=graph(5, 7),
            polymorphic_shapes=("n, ...", "n", "n"),
        )
    # a fixed dimension the example does not have
    fixed = r"input \[0\] \(float32\[5, 4\] against .n, 3.\).*dimension 1"
    with pytest.raises(InputError, match=fixed):
        mlflow.jaxexp.save_model(
            jax.jit(gnn),
            tmp_path / "b",
            params=params,
            input_example=graph(5, 7),
            polymorphic_shapes=("n, 3", "e", "e"),
        )
    # a rank that does not fit: JAX's own ValueError, typed
    with pytest.raises(InputError, match=r"input \[0\] 3 dimensions \(n, f, g\).*has 2"):
        mlflow.jaxexp.save_model(
            jax.jit(gnn),
            tmp_path / "c",
            params=params,
            input_example=graph(5, 7),
            polymorphic_shapes=("n, f, g", "e", "e"),
        )
    assert not any((tmp_path / d).exists() for d in "abc")


def test_a_function_needing_equal_sizes_says_how_to_name_them(tmp_path):
    def add(x, y):
        return x + y

    with pytest.raises(UnsupportedModelError, match="polymorphic_shapes"):
        mlflow.jaxexp.save_model(
            jax.jit(add),
            tmp_path / "m",
            input_example=(np.ones(3, np.float32), np.ones(4, np.float32)),
        )


def test_training_hook_exports_with_the_named_dimensions():
    from jaxexp_mlflow.hooks import TrainingHook

    hook = TrainingHook(gnn, graph(4, 4), log_every=1, polymorphic_shapes=("n, ...", "e", "e"))
    exported = hook._export(gnn_params())
    shapes = [str(a.shape) for a in exported.in_avals[2:]]  # after the two params leaves
    assert shapes == ["(n, 4)", "(e,)", "(e,)"]
