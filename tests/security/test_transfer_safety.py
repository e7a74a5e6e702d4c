"""The transfer path against hostile stores and cut re-logs.

A hostile artifact store is a real HTTP server on 127.0.0.1 imitating ``mlflow server``'s
artifact endpoints (the ``store`` fixture of tests/security/conftest.py:
``GET /api/2.0/mlflow-artifacts/artifacts?path=...`` lists a directory,
``GET /api/2.0/mlflow-artifacts/artifacts/<path>`` sends a file): a directory that lists itself,
one that nests without end, one that lists too much, a file bigger than listed. Re-logs into an
existing ``model_id`` are cut against a real ``mlflow server`` (tests/servers.py). Every wait is
bounded.
"""

from __future__ import annotations

import os
import tempfile
import threading

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.store import transfer
from jaxexp_mlflow.store.download import download_model


def _download(uri: str, timeout: float = 15.0) -> BaseException | None:
    """Run ``download.download_model(uri)`` with a time bound; returns what it raised."""
    out: list[BaseException | None] = []

    def run():
        try:
            download_model(uri)
            out.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out.append(err)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert out, f"download_model({uri}) still running after {timeout:.0f} s: it hangs"
    return out[0]


# --------------------------------------------------------------------------------------------
# defect 9: listings are bounded (cycle, depth, count)


def test_a_directory_listing_itself_is_refused(store):
    handler, uri, tmp = store
    handler.tree = {
        "model": [("MLmodel", False, 3), ("loop", True, 0)],
        "model/loop": [(".", True, 0)],
    }
    handler.files = {"model/MLmodel": b"a: 1"[:3]}
    err = _download(uri)
    assert isinstance(err, ArtifactError), err
    assert "twice" in str(err) and "model/loop" in str(err)
    assert handler.requests < 50
    assert not any(tmp.iterdir())  # nothing left behind


@pytest.mark.parametrize("size", ["12abc", -5])
def test_a_listing_with_a_garbage_size_is_a_typed_error(store, size):
    """Defect 15: ``file_size: "12abc"`` was a ValueError from deep inside the download."""
    handler, uri, tmp = store
    handler.tree = {"model": [("MLmodel", False, 3), ("exported.bin", False, size)]}
    handler.files = {"model/MLmodel": b"a: 1"[:3]}
    err = _download(uri)
    assert isinstance(err, ArtifactError), repr(err)
    assert "expected" in str(err)
    assert not any(tmp.iterdir())


def test_a_tree_without_end_is_refused_at_the_depth_limit(store, monkeypatch):
    # what `mlflow server` lists for a symlink `d -> .` in its artifact root: d, d/d, d/d/d...
    handler, uri, tmp = store
    handler.tree = staticmethod(lambda path: [("d", True, 0)])
    err = _download(uri)
    assert isinstance(err, ArtifactError), err
    assert "deep" in str(err) and "JAXEXP_MAX_LIST_DEPTH" in str(err)
    assert handler.requests <= transfer.DEFAULT_MAX_LIST_DEPTH + 2
    assert not any(tmp.iterdir())


def test_a_listing_too_long_is_refused(store, monkeypatch):
    monkeypatch.setenv("JAXEXP_MAX_LIST_ENTRIES", "1000")
    handler, uri, tmp = store
    handler.tree = staticmethod(lambda path: [(f"x{i}", True, 0) for i in range(600)])
    err = _download(uri)
    assert isinstance(err, ArtifactError), err
    assert "JAXEXP_MAX_LIST_ENTRIES" in str(err) and "1000" in str(err)
    # stopped early: the root and one level's first listings, plus what the transfer workers
    # had in flight or had picked up before the refusal reached them (a loaded machine let 23
    # through where the bound was 20), far from the 601 of listing everything
    assert handler.requests <= 2 + 3 * transfer.workers()
    assert not any(tmp.iterdir())


# --------------------------------------------------------------------------------------------
# defect 16: a file bigger than listed is cut off; a failed download leaves nothing behind


def test_a_file_bigger_than_listed_is_cut_off_and_refused(store):
    handler, uri, tmp = store
    handler.tree = {"model": [("MLmodel", False, 10), ("exported.bin", False, 4)]}
    handler.files = {"model/MLmodel": b"x" * (64 << 20), "model/exported.bin": b"abcd"}
    err = _download(uri)
    assert isinstance(err, ArtifactError), err
    assert "MLmodel" in str(err) and "10 bytes" in str(err)
    assert not any(tmp.iterdir())  # the private download directory is gone


def test_a_failed_download_removes_its_private_directory(store):
    handler, uri, tmp = store
    handler.tree = {"model": [("MLmodel", False, 4), ("params", True, 0)]}
    handler.tree["model/params"] = [("w", False, 5)]
    handler.files = {"model/MLmodel": b"a: 1"}  # params/w: the store fails (500)
    err = _download(uri)
    assert err is not None, "the download of a file the store fails to send succeeded"
    assert not any(tmp.iterdir())


# --------------------------------------------------------------------------------------------
# real `mlflow server`: a refused load, cut re-logs


@pytest.fixture(scope="module")
def server(tracking_server):
    """The session's ``mlflow server`` (tests/conftest.py): its URL and artifact directory."""
    return tracking_server


@pytest.fixture
def tracking(server, monkeypatch):
    url, artifacts = server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    mlflow.set_tracking_uri(url)
    mlflow.set_experiment("safety")
    try:
        yield artifacts
    finally:
        mlflow.set_tracking_uri(None)


def _affine(params, x):
    return x @ params["w"] + params["b"]


def _other(params, x):
    return jnp.tanh(x @ params["v"]) * 2.0 - params["c"]


X = np.arange(8, dtype=np.float32).reshape(2, 4) / 8


def _params(names, seed):
    rng = np.random.default_rng(seed)
    return {
        names[0]: rng.standard_normal((4, 3)).astype(np.float32),
        names[1]: rng.standard_normal((3,)).astype(np.float32),
    }


def _files(model_id: str) -> set[str]:
    """Every file the store holds for the logged model (listed through MLflow)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    location = mlflow.MlflowClient().get_logged_model(model_id).artifact_location
    repo = get_artifact_repository(location)
    out, todo = set(), [None]
    while todo:
        for info in repo.list_artifacts(todo.pop()):
            (todo.append if info.is_dir else out.add)(info.path)
    return out


def test_a_refused_load_removes_its_private_download(tracking, monkeypatch, tmp_path):
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(
            jax.jit(_affine), name="m", params=_params("wb", 0), input_example=X
        )
    # damage the params metadata in the server's own artifact store (same size, other bytes)
    (meta,) = [p for p in tracking.rglob("_METADATA") if info.model_id in str(p)]
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0xFF
    meta.write_bytes(bytes(data))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.raises(ArtifactError, match="checksum"):
        mlflow.jaxexp.load_model(info.model_uri)
    assert not list(tmp.iterdir()), "the refused load left its download behind"


def test_a_load_refused_after_the_download_removes_it_too(tracking, monkeypatch, tmp_path):
    """The blob's checksum is checked by the loader, after the download's own checks: that
    refusal also leaves nothing behind."""
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(
            jax.jit(_affine), name="m", params=_params("wb", 0), input_example=X
        )
    (blob,) = [p for p in tracking.rglob("exported.bin") if info.model_id in str(p)]
    data = bytearray(blob.read_bytes())
    data[-8] ^= 0xFF
    blob.write_bytes(bytes(data))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.raises(ArtifactError, match="sha256|checksum"):
        mlflow.jaxexp.load_model(info.model_uri)
    assert not list(tmp.iterdir()), "the refused load left its download behind"


def test_relog_cut_before_mlmodel_never_loads_a_mix(tracking, monkeypatch):
    """Same function, new weights; the re-log dies after our files went up, before MLmodel
    (kill -9 after the new manifest landed): the old MLmodel must not load the new weights."""
    old, new = _params("wb", 1), _params("wb", 2)
    blob = jax.export.export(jax.jit(_affine))(old, X).serialize()  # stored unchanged: same blob
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(blob, name="m", params=old, input_example=X)

    def cut(*args, **kwargs):
        raise OSError("killed before MLmodel went up")

    with monkeypatch.context() as m:
        m.setattr(mlflow.MlflowClient, "log_model_artifacts", cut)
        with mlflow.start_run(), pytest.raises(OSError, match="killed"):
            mlflow.jaxexp.log_model(
                blob, name="m", params=new, input_example=X, model_id=info.model_id
            )
    with pytest.raises(ArtifactError, match="mixes files of two saves"):
        model = mlflow.jaxexp.load_model(info.model_uri)
        np.testing.assert_allclose(model(X), _affine(old, X), rtol=1e-6)  # if it loaded


def test_relog_with_a_refused_put_keeps_the_previous_models_files(tracking, monkeypatch):
    """The server refuses the PUT of exported.bin during a re-log (another function, other
    params names); the failed re-log deletes only what it created, and what is left never
    loads the old function with new weights."""
    from mlflow.store.artifact.http_artifact_repo import HttpArtifactRepository

    old, new = _params("wb", 3), _params("vc", 4)
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(jax.jit(_affine), name="m", params=old, input_example=X)
    before = _files(info.model_id)
    real = HttpArtifactRepository.log_artifact

    def refuse(self, local_file, artifact_path=None):
        if os.path.basename(local_file) == "exported.bin":
            threading.Event().wait(1.0)  # what else is in flight lands meanwhile
            raise OSError("413 refused by the server")
        return real(self, local_file, artifact_path)

    with monkeypatch.context() as m:
        m.setattr(HttpArtifactRepository, "log_artifact", refuse)
        with mlflow.start_run(), pytest.raises(Exception, match="refused"):
            mlflow.jaxexp.log_model(
                jax.jit(_other), name="m", params=new, input_example=X, model_id=info.model_id
            )
    after = _files(info.model_id)
    assert before - after == set(), f"the failed re-log deleted {sorted(before - after)}"
    assert after - before == set(), f"the failed re-log left {sorted(after - before)}"
    try:
        model = mlflow.jaxexp.load_model(info.model_uri)
    except ArtifactError:
        return  # refused loudly (files it overwrote) is acceptable
    np.testing.assert_allclose(model(X), _affine(old, X), rtol=1e-6)  # else the old model whole
