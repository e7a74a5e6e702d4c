"""Models on an S3-compatible store (moto's server, started here): proxied by a real
``mlflow server --artifacts-destination s3://...`` with MLflow's multipart upload on, and direct
``s3://`` artifact locations written by the client itself.
"""

from __future__ import annotations

import jax.numpy as jnp
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.params import restore as params_codec
from tests.conftest import sqlite_uri
from tests.models import log_registered
from tests.servers import S3_ENV, mlflow_server, s3_server

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

MiB = 2**20
PART = 5 * MiB  # S3's smallest multipart part


def apply(params, x):
    return x @ params["w"][:8] + params["b"]


def make_params(rows: int) -> dict:
    """A ``rows x 8`` float32 matrix (``rows * 32`` bytes) and a bias."""
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((rows, 8), np.float32)),
        "b": jnp.asarray(rng.standard_normal(8, np.float32)),
    }


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server; the client reaches it through MLflow's usual variables."""
    root = tmp_path_factory.mktemp("s3")
    with s3_server(root) as url, pytest.MonkeyPatch.context() as mp:
        for k, v in {**S3_ENV, "MLFLOW_S3_ENDPOINT_URL": url}.items():
            mp.setenv(k, v)
        yield url


@pytest.fixture(scope="module")
def s3_proxied(s3, tmp_path_factory):
    """A real ``mlflow server`` whose artifacts live in the S3 bucket (proxied)."""
    root = tmp_path_factory.mktemp("server")
    env = {**S3_ENV, "MLFLOW_S3_ENDPOINT_URL": s3}
    backend = sqlite_uri(root / "db.sqlite")
    with mlflow_server(
        root, backend=backend, artifacts_destination="s3://mlflow/proxied", env=env
    ) as (url, _):
        yield url


def _objects(s3_url: str, prefix: str) -> dict[str, dict]:
    client = boto3.client(
        "s3",
        endpoint_url=s3_url,
        aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=S3_ENV["AWS_DEFAULT_REGION"],
    )
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="mlflow", Prefix=prefix):
        out.update({o["Key"]: o for o in page.get("Contents", [])})
    return out


def _roundtrip(params: dict, registered: str) -> None:
    x = np.ones((3, 8), np.float32)
    log_registered(apply, params, x, registered)
    model = mlflow.jaxexp.load_model(f"models:/{registered}/1")
    for k in params:
        np.testing.assert_array_equal(np.asarray(model.params[k]), np.asarray(params[k]))
    np.testing.assert_allclose(model(x), apply(params, x), rtol=1e-6)
    assert params_codec.LAST_RESTORE_STATS["fast"] == 2  # read by the fast path, not Orbax


def test_proxied_s3_with_multipart_upload(s3, s3_proxied, monkeypatch):
    """Params bigger than MLflow's multipart threshold go up in parts straight to S3 (presigned
    URLs the server hands out), the rest through the server; the model loads back exactly."""
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)  # set_experiment sets it: undone
    monkeypatch.setenv("MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD", "true")
    monkeypatch.setenv("MLFLOW_MULTIPART_UPLOAD_MINIMUM_FILE_SIZE", str(2 * PART))
    monkeypatch.setenv("MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE", str(PART))
    mlflow.set_tracking_uri(s3_proxied)
    try:
        mlflow.set_experiment("s3-proxied")
        params = make_params(rows=(2 * PART + MiB) // 32)  # 11 MiB: 3 parts
        _roundtrip(params, "s3-proxied")
    finally:
        mlflow.set_tracking_uri(None)
    objects = _objects(s3, "proxied/")
    big = [o for k, o in objects.items() if "/params/w/" in k and o["Size"] >= 2 * PART]
    assert len(big) == 1, sorted(objects)
    assert big[0]["ETag"].strip('"').endswith("-3")  # S3's ETag of a 3-part multipart upload
    assert any(k.endswith("/MLmodel") for k in objects)


def test_direct_s3_artifact_location(s3, tmp_path, monkeypatch):
    """A client-side sqlite store whose experiment keeps artifacts at ``s3://`` directly."""
    uri = sqlite_uri(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)  # set_experiment sets it: undone
    mlflow.set_tracking_uri(uri)
    try:
        exp = mlflow.create_experiment("s3-direct", artifact_location="s3://mlflow/direct")
        mlflow.set_experiment(experiment_id=exp)
        _roundtrip(make_params(rows=4096), "s3-direct")
    finally:
        mlflow.end_run()
        mlflow.set_tracking_uri(None)
    keys = _objects(s3, "direct/")
    assert any(k.endswith("/params/jaxexp_manifest.json") for k in keys)
    assert not any("/code/" in k for k in keys)  # a model carries no Python by default
