"""Log to and load from a real remote tracking server (`mlflow server`, artifacts proxied)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import numpy as np
import pytest
import requests

import jaxexp_mlflow  # noqa: F401
from tests.models import batch, export_mlp, mlp_apply, mlp_params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite backend and proxied artifacts."""
    root = tmp_path_factory.mktemp("server")
    port = _free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{root / 'db.sqlite'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--workers",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "w"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                break
        except requests.RequestException:
            time.sleep(0.5)
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}")
    else:
        proc.kill()
        pytest.fail("mlflow server did not answer /health within 90 s")
    yield url, root / "artifacts"
    proc.terminate()
    proc.wait(timeout=20)


def test_log_and_load_through_a_remote_server(server, tmp_path, monkeypatch):
    server, artifacts = server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    mlflow.set_tracking_uri(server)
    try:
        mlflow.set_experiment("remote")
        params = mlp_params()
        x = batch(3)
        with mlflow.start_run():
            info = mlflow.jaxexp.log_model(
                export_mlp(params),
                name="model",
                params=params,
                input_example=x,
                registered_model_name="remote-mlp",
            )
        # the artifacts went through the server into its own artifact store
        assert len(list(artifacts.rglob("exported.bin"))) == 1
        for i, uri in enumerate((info.model_uri, "models:/remote-mlp/1")):
            (tmp_path / str(i)).mkdir()
            model = mlflow.jaxexp.load_model(uri, dst_path=str(tmp_path / str(i)))
            np.testing.assert_allclose(model(x), mlp_apply(params, x), rtol=1e-6)
        # a fresh process that only knows the server URI reproduces the result
        code = (
            "import sys, mlflow\n"
            "from jaxexp_mlflow.reproduce import verify_directory\n"
            "from mlflow.artifacts import download_artifacts\n"
            "d = download_artifacts(sys.argv[1])\n"
            "m = mlflow.jaxexp.load_model(d)\n"
            "print(all(c.passed for c in verify_directory(m, d)))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, "models:/remote-mlp/1"],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "MLFLOW_TRACKING_URI": server},
        )
        assert out.stdout.strip().splitlines()[-1] == "True"
    finally:
        mlflow.set_tracking_uri(None)
