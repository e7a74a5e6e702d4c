"""The README runs as pasted: its quickstart in a fresh interpreter, its ``curl`` against a real
``mlflow models serve``, and the way it documents serving before the package is on an index
(a local wheel given through ``PIP_FIND_LINKS`` to MLflow's default environment manager)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from scripts import readme_quickstart
from tests.conftest import free_port, sqlite_uri
from tests.servers import VENV_BIN, server_env, stop_server, wait_for_ping

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
URI_LINE = re.compile(r"^models:/m-[0-9a-f]+$", re.MULTILINE)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> tuple[Path, str]:
    """``(directory, model URI)``: the README's python blocks run in a fresh interpreter with a
    sqlite store in a new directory; the URI is the one the quickstart printed."""
    cwd = tmp_path_factory.mktemp("readme")
    done = readme_quickstart.run(REPO / "README.md", cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    uris = URI_LINE.findall(done.stdout)
    assert len(uris) == 1, done.stdout
    return cwd, uris[0]


def _curl() -> tuple[str, str, dict]:
    """The README's ``curl`` command: (URL path, content type, JSON body)."""
    (cmd,) = [
        b.replace("\\\n", " ")
        for b in readme_quickstart.blocks(README, "bash")
        if "curl " in b and "/invocations" in b
    ]
    words = shlex.split(cmd[cmd.index("curl ") :])
    url = next(w for w in words if w.startswith("http"))
    content_type = words[words.index("-H") + 1].split(":", 1)[1].strip()
    return url.split("5000", 1)[1], content_type, json.loads(words[words.index("-d") + 1])


def test_the_python_blocks_run_as_pasted_and_the_model_reloads_in_another_process(quickstart):
    cwd, uri = quickstart
    # the blocks define what they use: a fresh interpreter ran them; a second one reloads
    code = (
        "import sys, mlflow, numpy as np\n"
        "m = mlflow.pyfunc.load_model(sys.argv[1])\n"
        "x = np.ones((3, 4), np.float32)\n"
        "print(np.asarray(m.predict(x)).shape)\n"
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": sqlite_uri(cwd / "mlruns.db")}
    out = subprocess.run(
        [sys.executable, "-c", code, uri], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "(3, 3)"


def test_the_blocks_fail_when_the_model_disagrees(tmp_path):
    """The extractor runs what the README says: a README whose check fails is a failure."""
    broken = README.replace("model(x), apply(params, x)", "model(x), apply(params, 2 * x)")
    assert broken != README
    (tmp_path / "README.md").write_text(broken)
    done = readme_quickstart.run(tmp_path / "README.md", tmp_path)
    assert done.returncode != 0 and "AssertionError" in done.stderr


def test_the_curl_body_names_the_quickstart_input():
    path, content_type, body = _curl()
    assert path == "/invocations" and content_type == "application/json"
    assert list(body) == ["inputs"] and list(body["inputs"]) == ["x"]  # apply(params, x)
    assert np.asarray(body["inputs"]["x"]).shape[1:] == (4,)


def _answers_curl(uri: str, cwd: Path, env: dict, extra: list[str], timeout: float) -> None:
    """Serve ``uri`` with ``mlflow models serve`` (plus ``extra``) and post the README's curl
    body: the answer is what the model computes in process."""
    import mlflow

    path, content_type, body = _curl()
    port = free_port()
    cmd = [os.path.join(VENV_BIN, "mlflow"), "models", "serve", "-m", uri, *extra]
    cmd += ["-h", "127.0.0.1", "-p", str(port)]
    log = cwd / f"serve-{port}.log"
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_ping(url, proc, timeout)
        except Exception:
            raise AssertionError(log.read_text()[-4000:]) from None
        r = requests.post(
            url + path, data=json.dumps(body), headers={"Content-Type": content_type}, timeout=120
        )
        assert r.status_code == 200, r.text[:500]
        mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
        try:
            model = mlflow.jaxexp.load_model(uri)
        finally:
            mlflow.set_tracking_uri(None)
        x = np.asarray(body["inputs"]["x"], np.float32)
        np.testing.assert_allclose(r.json()["predictions"], np.asarray(model(x)), rtol=1e-5)
    finally:
        stop_server(proc)
    return log


def test_the_curl_body_is_answered_by_mlflow_models_serve(quickstart, tmp_path):
    cwd, uri = quickstart
    env = server_env(tmp_path)
    env["MLFLOW_TRACKING_URI"] = sqlite_uri(cwd / "mlruns.db")
    _answers_curl(uri, cwd, env, ["--env-manager", "local"], timeout=180)


def _pyenv_bin() -> str | None:
    found = shutil.which("pyenv")
    if found:
        return str(Path(found).parent)
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    return str(root / "bin") if (root / "bin" / "pyenv").exists() else None


@pytest.mark.slow  # builds a virtualenv from the model's requirements (jax, mlflow: minutes)
def test_default_env_manager_serves_from_a_local_wheel(quickstart, tmp_path):
    """``mlflow models serve -m URI`` with MLflow's default environment manager (virtualenv:
    pyenv's Python of the model's ``python_env.yaml``, then ``pip install -r`` of its
    requirements, ``jaxexp-mlflow>=X`` among them) serves the README's request once pip finds
    the built wheel through ``PIP_FIND_LINKS``, as docs/serving/pyfunc-rest.md documents."""
    pyenv = _pyenv_bin()
    if pyenv is None:
        pytest.skip("MLflow's virtualenv manager needs pyenv, which is not installed here")
    cwd, uri = quickstart
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("jaxexp_mlflow-*.whl")
    env = server_env(tmp_path)
    env.pop("PYTHONPATH", None)  # the environment's own jaxexp_mlflow, not the checkout
    env["MLFLOW_TRACKING_URI"] = sqlite_uri(cwd / "mlruns.db")
    env["MLFLOW_ENV_ROOT"] = str(tmp_path / "envs")  # a new environment, not a cached one
    env["PATH"] = os.pathsep.join([VENV_BIN, pyenv, env["PATH"]])
    links = " ".join(p for p in (str(wheels), os.environ.get("PIP_FIND_LINKS")) if p)
    env["PIP_FIND_LINKS"] = links
    env["UV_FIND_LINKS"] = ",".join(links.split())
    log = _answers_curl(uri, cwd, env, [], timeout=1800)
    envs = list((tmp_path / "envs").glob("mlflow-*/bin/python"))
    assert len(envs) == 1, log.read_text()[-3000:]
    found = subprocess.run(
        [str(envs[0]), "-c", "import importlib.metadata as m; print(m.version('jaxexp-mlflow'))"],
        capture_output=True,
        text=True,
        env={k: v for k, v in env.items() if k != "PYTHONPATH"},
        cwd=tmp_path,
    )
    assert found.stdout.strip() == wheel.name.split("-")[1], found
