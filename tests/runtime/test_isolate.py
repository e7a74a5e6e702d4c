"""The isolated deserialization probe: what its child imports, and the records of its passes."""

from __future__ import annotations

import sys

import pytest

from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.runtime import probed
from jaxexp_mlflow.runtime.isolate import probe
from tests.models import export_mlp, mlp_params


@pytest.fixture(autouse=True)
def _own_records(tmp_path, monkeypatch):
    """A compilation cache of this test's own: no record of another test's probe is found."""
    monkeypatch.setenv("JAXEXP_COMPILATION_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / probed.SUBDIR


@pytest.fixture(scope="module")
def blob() -> bytes:
    return export_mlp(mlp_params()).serialize()


@pytest.fixture
def no_mlflow_in_children(tmp_path, monkeypatch):
    """A PYTHONPATH entry whose ``mlflow`` fails on import, ahead of site-packages in every
    child: a child that imports MLflow exits with an error."""
    pkg = tmp_path / "shadow" / "mlflow"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the probe child imported mlflow')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "shadow"))


def test_the_child_imports_jax_alone_for_a_blob_of_plain_pytrees(no_mlflow_in_children, blob):
    """A blob of dicts, lists and tuples is deserialized by a child that imports JAX and not
    MLflow (a second of the probe's start-up)."""
    probe(blob, source="mlp")


def test_the_child_still_registers_named_node_types(no_mlflow_in_children, blob):
    """Custom node types are registered in the child through the package, which brings MLflow:
    the shadowed MLflow fails it, so the registration is not skipped."""
    with pytest.raises(ArtifactError, match="the probe child imported mlflow"):
        probe(blob, source="mlp", node_types=["flax.core.frozen_dict.FrozenDict"])


def test_a_blob_that_passed_is_not_probed_again(blob, no_child_later):
    probe(blob, source="mlp")  # a child deserializes it, and the pass is recorded
    no_child_later()
    probe(blob, source="mlp")  # the record answers: no child
    other = export_mlp(mlp_params(d_in=4), d_in=4).serialize()
    with pytest.raises(ArtifactError, match="exited with status 1"):
        probe(other, source="other")  # another blob: a child, which fails here
    with pytest.raises(ArtifactError, match="exited with status 1"):
        probe(blob, source="mlp", memory_bytes=3 << 30)  # other limits: a child again


@pytest.fixture
def no_child_later(monkeypatch):
    """Call it to make every later child fail (the interpreter a probe starts exits 1)."""
    return lambda: monkeypatch.setattr(sys, "executable", "/bin/false")


def test_renamed_or_foreign_records_are_not_read(blob, _own_records, no_child_later, monkeypatch):
    """A record counts only under its own name and this user's secret."""
    other = export_mlp(mlp_params(d_in=4), d_in=4).serialize()
    probe(blob, source="mlp")
    (mine,) = _own_records.glob("probe-*.bin")
    probe(other, source="other")
    (theirs,) = set(_own_records.glob("probe-*.bin")) - {mine}
    mine.replace(theirs)  # the blob's record renamed to the other blob's name
    probe(blob, source="mlp")  # no record under its own name now: probed and recorded again
    no_child_later()
    probe(blob, source="mlp")  # its own record, intact: no child
    with pytest.raises(ArtifactError, match="exited with status 1"):
        probe(other, source="other")  # the renamed record does not verify under that name
    # another user's secret (their XDG_CONFIG_HOME): the blob's own record does not verify
    monkeypatch.setenv("XDG_CONFIG_HOME", str(_own_records.parent.parent / "other-user"))
    with pytest.raises(ArtifactError, match="exited with status 1"):
        probe(blob, source="mlp")


def test_refusals_are_never_recorded(_own_records):
    for _ in range(2):
        with pytest.raises(ArtifactError, match="JAX refused it"):
            probe(b"\x00" * 64, source="junk")
    assert not list(_own_records.glob("probe-*.bin"))


def test_no_records_when_the_compilation_cache_is_off(blob, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXEXP_COMPILATION_CACHE", "off")
    probe(blob, source="mlp")
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(ArtifactError, match="exited with status 1"):
        probe(blob, source="mlp")
