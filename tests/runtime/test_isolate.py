"""The isolated deserialization probe: what its child imports."""

from __future__ import annotations

import pytest

from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.runtime.isolate import probe
from tests.models import export_mlp, mlp_params


@pytest.fixture
def no_mlflow_in_children(tmp_path, monkeypatch):
    """A PYTHONPATH entry whose ``mlflow`` fails on import, ahead of site-packages in every
    child: a child that imports MLflow exits with an error."""
    pkg = tmp_path / "shadow" / "mlflow"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the probe child imported mlflow')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "shadow"))


def test_the_child_imports_jax_alone_for_a_blob_of_plain_pytrees(no_mlflow_in_children):
    """A blob of dicts, lists and tuples is deserialized by a child that imports JAX and not
    MLflow (a second of the probe's start-up)."""
    blob = export_mlp(mlp_params()).serialize()
    probe(blob, source="mlp")


def test_the_child_still_registers_named_node_types(no_mlflow_in_children):
    """Custom node types are registered in the child through the package, which brings MLflow:
    the shadowed MLflow fails it, so the registration is not skipped."""
    blob = export_mlp(mlp_params()).serialize()
    with pytest.raises(ArtifactError, match="the probe child imported mlflow"):
        probe(blob, source="mlp", node_types=["flax.core.frozen_dict.FrozenDict"])
