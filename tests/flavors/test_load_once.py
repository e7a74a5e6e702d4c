"""A load reads MLmodel once, reads the blob once and parses it once, at every door.

Counted for real: file reads with a ``sys.addaudithook`` hook on CPython's ``open`` event
(``open()``, ``os.open``, ``pathlib``...), kept to the reads this package makes (the innermost
frame of ``jaxexp_mlflow`` or ``mlflow`` on the stack is ours), and blob parses by counting
calls through this package's own parser, ``codec.reader.read_blob``, and its JAX hand-over,
``codec.blob.deserialize_checked`` (wrapped in the test only, by ``monkeypatch`` of our module
attributes). MLflow's own reads (``mlflow.pyfunc.load_model`` reads MLmodel itself) are
counted apart and not held to the rule. The child process that ``jaxexp check`` and
``jaxexp verify`` start to deserialize the blob in isolation reads no file (its input comes
through a pipe) and is not counted.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter

import mlflow
import numpy as np
import pytest
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)
from jaxexp_mlflow.cli import main
from jaxexp_mlflow.codec import blob as blob_codec
from jaxexp_mlflow.codec import reader
from tests.conftest import active_store
from tests.models import batch, export_mlp, mlp_apply, mlp_params

WATCHED = ("MLmodel", "exported.bin")


class _Reads:
    """Counts reads of ``WATCHED`` files while ``active``, by who read them (ours / mlflow's)."""

    def __init__(self) -> None:
        self.active = False
        self.ours: Counter[str] = Counter()
        self.mlflow: Counter[str] = Counter()
        self.paths: Counter[str] = Counter()  # ours, by path (shown when a count is off)

    def hook(self, event: str, args: tuple) -> None:
        if not self.active or event != "open":
            return
        path, mode, flags = args
        if isinstance(path, int):
            return
        path = os.fsdecode(path)
        name = os.path.basename(path)
        if name not in WATCHED:
            return
        if mode is not None:
            if any(c in mode for c in "wax+"):
                return
        elif flags & os.O_ACCMODE != os.O_RDONLY:
            return
        frame = sys._getframe(1)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("jaxexp_mlflow"):
                self.ours[name] += 1
                self.paths[path] += 1
                return
            if module.startswith("mlflow"):
                self.mlflow[name] += 1
                return
            frame = frame.f_back


_READS = _Reads()
sys.addaudithook(_READS.hook)  # audit hooks cannot be removed: it counts only while active


class Door:
    """What one load did: our reads of MLmodel and the blob, MLflow's, and the blob parses."""

    def __init__(self) -> None:
        self.parses = 0
        self.deserializes = 0

    def __enter__(self) -> Door:
        _READS.ours.clear()
        _READS.mlflow.clear()
        _READS.paths.clear()
        _READS.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        _READS.active = False
        self.ours = dict(_READS.ours)
        self.mlflow = dict(_READS.mlflow)

    def summary(self) -> dict[str, int]:
        return {
            "MLmodel": self.ours.get("MLmodel", 0),
            "blob": self.ours.get("exported.bin", 0),
            "parses": self.parses,
            "deserializes": self.deserializes,
        }


@pytest.fixture
def counted(monkeypatch):
    """A factory of ``Door`` counters whose parses are counted through our own modules."""
    doors: list[Door] = []
    parse, deserialize = reader.read_blob, blob_codec.deserialize_checked

    def counting_parse(*args, **kwargs):
        for door in doors:
            door.parses += 1
        return parse(*args, **kwargs)

    def counting_deserialize(*args, **kwargs):
        for door in doors:
            door.deserializes += 1
        return deserialize(*args, **kwargs)

    monkeypatch.setattr(reader, "read_blob", counting_parse)
    monkeypatch.setattr(blob_codec, "deserialize_checked", counting_deserialize)

    def make() -> Door:
        doors.clear()
        door = Door()
        doors.append(door)
        return door

    return make


@pytest.fixture(scope="module")
def logged(registered_mlp):
    """An MLP logged and registered in a real sqlite store with file artifacts (the session's
    ``registered_mlp``), this module's store."""
    with active_store(registered_mlp["uri"], registered_mlp["experiment_id"]):
        yield {
            **registered_mlp,
            "runs": registered_mlp["runs_uri"],
            "models": registered_mlp["models_uri"],
        }


@pytest.fixture
def fresh(logged, tmp_path):
    """A copy of the logged model no load of this process has seen (the pyfunc cache misses)."""
    dst = tmp_path / "model"
    shutil.copytree(logged["local"], dst)
    return dst


def _once(door: Door, *, mlflow_reads: dict[str, int] | None = None) -> None:
    """Ours: MLmodel read once, the blob read once, parsed once and handed to JAX once.
    ``mlflow_reads``: what MLflow's own code read (None: not held to anything)."""
    assert door.summary() == {"MLmodel": 1, "blob": 1, "parses": 1, "deserializes": 1}, (
        door.summary(),
        dict(_READS.paths),
    )
    if mlflow_reads is not None:
        assert door.mlflow == mlflow_reads, door.mlflow


def test_flavor_load_of_a_local_directory(counted, fresh, logged):
    with counted() as door:
        model = mlflow.jaxexp.load_model(str(fresh))
    np.testing.assert_allclose(np.asarray(model(logged["x"])), logged["want"], rtol=1e-5)
    _once(door, mlflow_reads={})


@pytest.mark.parametrize("which", ["runs", "models"])
def test_flavor_load_of_a_store_uri(counted, logged, which):
    """Downloaded (runs:/) or read in place from the file store (models:/ here): MLflow's copy
    of the files is its own read, not held to the rule."""
    with counted() as door:
        model = mlflow.jaxexp.load_model(logged[which])
    np.testing.assert_allclose(np.asarray(model(logged["x"])), logged["want"], rtol=1e-5)
    _once(door)


def test_pyfunc_load(counted, fresh, logged):
    with counted() as door:
        model = mlflow.pyfunc.load_model(str(fresh))
    out = np.asarray(model.predict(logged["x"]))
    np.testing.assert_allclose(out, logged["want"], rtol=1e-5)
    _once(door, mlflow_reads={"MLmodel": 1})  # mlflow.pyfunc reads MLmodel itself, once


def test_serving_load(counted, fresh, logged):
    from jaxexp_mlflow.serving.pyfunc import load_pyfunc

    with counted() as door:
        impl = load_pyfunc(fresh)
    np.testing.assert_allclose(np.asarray(impl.predict(logged["x"])), logged["want"], rtol=1e-5)
    _once(door, mlflow_reads={})


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("command", ["check", "verify", "predict"])
def test_cli_commands_that_load(counted, fresh, logged, command, tmp_path):
    args = [command, str(fresh)]
    if command == "predict":
        np.save(tmp_path / "x.npy", logged["x"])
        args += ["--input", str(tmp_path / "x.npy"), "--json"]
    with counted() as door:
        result = _cli(*args)
    assert result.exit_code == 0, result.output
    if command == "check":  # judged, not loaded: JAX deserializes only in the isolated child
        assert door.summary() == {"MLmodel": 1, "blob": 1, "parses": 1, "deserializes": 0}, (
            door.summary()
        )
    else:
        _once(door, mlflow_reads={})


def test_cli_inspect_reads_and_parses_once_without_jax(counted, fresh):
    with counted() as door:
        result = _cli("inspect", str(fresh), "--json")
    assert result.exit_code == 0, result.output
    assert door.summary() == {"MLmodel": 1, "blob": 1, "parses": 1, "deserializes": 0}, (
        door.summary()
    )


@pytest.mark.parametrize("door", ["load_model", "pyfunc"])
def test_iree_backend_reads_once(counted, fresh, logged, door):
    """The IREE backend reads the blob through its own checked reader, once, and JAX never
    sees it; under pyfunc, the blob the model identity read is the one it compiles."""
    pytest.importorskip("iree.compiler")
    from jaxexp_mlflow.serving.pyfunc import load_pyfunc

    with counted() as counts:
        if door == "load_model":
            model = mlflow.jaxexp.load_model(str(fresh), backend="iree")
        else:
            model = load_pyfunc(fresh, {"backend": "iree"})
    np.testing.assert_allclose(
        np.asarray(model.predict(logged["x"]) if door == "pyfunc" else model(logged["x"])),
        logged["want"],
        rtol=1e-4,
        atol=1e-5,
    )
    assert counts.summary() == {"MLmodel": 1, "blob": 1, "parses": 1, "deserializes": 0}, (
        counts.summary(),
        dict(_READS.paths),
    )


@pytest.mark.slow
def test_flavor_load_through_a_tracking_server(counted, tmp_path, monkeypatch):
    """A private download through a real ``mlflow server`` (proxied artifacts) is checked
    before the load (``store.download.check_download``: the params against their manifest and
    MLmodel); the load parses the MLmodel bytes that check read, and reads nothing twice."""
    from tests.servers import mlflow_server

    params, x = mlp_params(), batch(3)
    with mlflow_server(tmp_path / "server") as (url, _):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        mlflow.set_tracking_uri(url)
        try:
            mlflow.set_experiment("once-remote")
            with mlflow.start_run() as run:
                mlflow.jaxexp.log_model(export_mlp(params), name="model", params=params)
            with counted() as door:
                model = mlflow.jaxexp.load_model(f"runs:/{run.info.run_id}/model")
        finally:
            mlflow.set_tracking_uri(None)
            os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(mlp_apply(params, x)), rtol=1e-5)
    _once(door)
