"""Real servers answering for a jaxexp model over HTTP on 127.0.0.1.

``jaxexp serve`` (MLflow's scoring protocol with the request limits: ``serving/server.py``) is
the guarded server; ``mlflow models serve`` runs as MLflow made it (nothing patched), with the
input contract applied by ``predict`` on the arrays MLflow hands over (every format of it:
tests/serving/test_mlflow_serve.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import numpy as np
import pytest
import requests

import jaxexp_mlflow  # noqa: F401
from tests.models import log_two_input_model, mlp_params, two_input_example
from tests.servers import (
    VENV_BIN,
    http_status,
    post,
    server_env,
    start_jaxexp_server,
    start_server,
    stop_server,
    tree_rss,
)

REPO = Path(__file__).resolve().parents[2]
MAX_BODY = 256 * 1024  # the model's max_request_bytes, to test the 413 cheaply
RSS_GROWTH_BOUND_MB = 64
SERVE_CONFIG = {"buckets": [1, 2, 4, 8, 16, 32, 64], "max_request_bytes": MAX_BODY}


@pytest.fixture(scope="module")
def logged_model(tmp_path_factory):
    """The two-input model logged to a sqlite store: (runs:/ URI, env, params, in-process)."""
    tmp = tmp_path_factory.mktemp("serve")
    uri, env, params = log_two_input_model(tmp, SERVE_CONFIG)
    local = mlflow.pyfunc.load_model(uri)
    mlflow.set_tracking_uri(None)
    return uri, env, params, local, tmp


@pytest.fixture(scope="module")
def served(logged_model):
    """The two-input model served by ``jaxexp serve`` from its runs:/ URI."""
    uri, env, params, local, tmp = logged_model
    proc, url = start_jaxexp_server(uri, env, tmp / "server.log")
    try:
        yield url, local, params, proc
    finally:
        stop_server(proc)


def _rows(inp):
    return [{"x": inp["x"][i].tolist(), "ids": int(inp["ids"][i])} for i in range(len(inp["ids"]))]


def test_all_four_formats_match_in_process(served):
    url, local, _, _ = served
    inp = two_input_example(6)
    want = local.predict(inp)
    bodies = {
        "inputs": {"inputs": {"x": inp["x"].tolist(), "ids": inp["ids"].tolist()}},
        "instances": {"instances": _rows(inp)},
        "dataframe_split": {
            "dataframe_split": {
                "columns": ["x", "ids"],
                "data": [[inp["x"][i].tolist(), int(inp["ids"][i])] for i in range(6)],
            }
        },
        "dataframe_records": {"dataframe_records": _rows(inp)},
    }
    for fmt, body in bodies.items():
        r = post(url, body)
        assert r.status_code == 200, (fmt, r.text)
        got = r.json()["predictions"]
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-6, err_msg=fmt)
        np.testing.assert_allclose(got["score"], want["score"], rtol=1e-6, err_msg=fmt)


MARK = 12345.678  # a value that must never come back in an error message


def _good(n=2):
    inp = two_input_example(n)
    return {"x": inp["x"].tolist(), "ids": inp["ids"].tolist()}


BAD_REQUESTS = {
    "wrong shape": ({"inputs": {"x": [[MARK] * 7] * 2, "ids": [1, 2]}}, "x: float32[-1,8]"),
    "wrong rank": ({"inputs": {"x": [MARK] * 8, "ids": [1]}}, "x: float32[-1,8]"),
    "float into int": ({"inputs": {**_good(), "ids": [MARK, 1.0]}}, "ids: int32[-1]"),
    "out of range": ({"inputs": {**_good(), "ids": [1, 2**40]}}, "ids: int32[-1]"),
    "string": ({"inputs": {**_good(), "ids": ["a", "b"]}}, "ids: int32[-1]"),
    "missing input": ({"inputs": {"x": [[MARK] * 8]}}, "ids: int32[-1]"),
    "batch of 0": ({"inputs": {"x": [], "ids": []}}, "a batch of 0"),
    "mismatched batch": ({"inputs": {"x": [[MARK] * 8] * 3, "ids": [1]}}, "'b'"),
    "unknown format": ({"rows": [[MARK]]}, "x: float32[-1,8]"),
    "split without columns": (
        {"dataframe_split": {"data": [[[MARK] * 8, 1]]}},
        "x: float32[-1,8]",
    ),
    "records not a list": ({"dataframe_records": {"x": [MARK]}}, "x: float32[-1,8]"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_short_4xx(served, case):
    url, _, _, _ = served
    body, must_name = BAD_REQUESTS[case]
    r = post(url, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    message = r.json()["message"]
    assert must_name in message, message
    assert len(message) < 700 and len(r.content) < 2048, message
    assert "expected" in message.lower() and "found" in message.lower(), message
    assert str(MARK) not in r.text  # the payload is not echoed


def test_nan_non_json_and_huge_body(served):
    url, _, _, proc = served
    nan_body = json.dumps({"inputs": {"x": [[float("nan")] * 8], "ids": [1]}})
    r = post(url, nan_body, raw=True)
    assert r.status_code == 400 and "NaN" in r.json()["message"]
    assert "x: float32[-1,8]" in r.json()["message"]

    garbage = "{not json " + "z" * 5000
    r = post(url, garbage, raw=True)
    assert r.status_code == 400, r.text[:300]
    assert "not valid JSON" in r.json()["message"] and "zzzz" not in r.text
    assert len(r.text) < 1000

    r = post(url, b"\xff\xfe\x00garbage", raw=True)
    assert r.status_code == 400 and "not UTF-8" in r.json()["message"]

    huge = json.dumps({"inputs": {"x": [[MARK] * 8] * 4000, "ids": list(range(4000))}})
    assert len(huge) > MAX_BODY
    r = post(url, huge, raw=True)
    assert r.status_code == 413 and "limit" in r.json()["message"]
    assert str(MARK) not in r.text
    # still serving
    assert proc.poll() is None
    assert requests.get(f"{url}/ping", timeout=5).status_code == 200
    assert post(url, {"inputs": _good()}).status_code == 200


def _load_round(url: str, n_threads: int, per_thread: int, failures: list) -> None:
    sizes = [1, 3, 8, 17, 33, 64]

    def worker(tid: int) -> None:
        session = requests.Session()
        rng = np.random.default_rng(tid)
        for i in range(per_thread):
            n = sizes[(tid + i) % len(sizes)]
            body = {
                "inputs": {
                    "x": rng.standard_normal((n, 8)).astype(np.float32).tolist(),
                    "ids": rng.integers(0, 10, n).tolist(),
                }
            }
            try:
                r = session.post(
                    f"{url}/invocations",
                    data=json.dumps(body),
                    headers={"Content-Type": "application/json"},
                    timeout=60,
                )
                if r.status_code != 200 or len(r.json()["predictions"]["score"]) != n:
                    failures.append((r.status_code, r.text[:200]))
            except Exception as err:  # a failure to count, not to crash the thread
                failures.append(repr(err))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_concurrent_load_no_failures_bounded_memory(served):
    url, _, _, proc = served
    failures: list = []
    _load_round(url, 8, 25, failures)  # warm-up: 200 requests
    before = tree_rss(proc.pid)
    _load_round(url, 8, 40, failures)  # measured: 320 requests
    after = tree_rss(proc.pid)
    assert failures == []
    growth_mb = (after - before) / 2**20
    assert growth_mb < RSS_GROWTH_BOUND_MB, f"server RSS grew by {growth_mb:.1f} MB"


def test_mlflow_models_serve_as_mlflow_made_it(logged_model):
    """``mlflow models serve`` is not patched: its ``inputs`` format reaches predict, which
    applies the contract on the arrays (lossless casts, NaN and infinities refused: 400)."""
    uri, env, _, local, tmp = logged_model
    inp = two_input_example(5)
    proc, url = start_server(uri, "local", env, tmp / "mlflow-serve.log")
    try:
        r = post(url, {"inputs": {"x": inp["x"].tolist(), "ids": inp["ids"].tolist()}})
        assert r.status_code == 200, r.text[:500]
        want = local.predict(inp)
        np.testing.assert_allclose(r.json()["predictions"]["logits"], want["logits"], rtol=1e-6)
        for bad, must in (
            ({**_good(), "ids": [1.5, 1.0]}, "ids: int32[-1]"),
            ({**_good(1), "x": [[float("nan")] * 8]}, "NaN"),
            ({**_good(1), "x": [[float("inf")] + [0.0] * 7]}, "infinite"),
        ):
            r = post(url, {"inputs": bad})
            assert r.status_code == 400 and must in r.json()["message"], r.text[:500]
        assert proc.poll() is None
    finally:
        stop_server(proc)


def test_loading_patches_neither_fastapi_nor_mlflow(logged_model):
    """Loading a jaxexp model where MLflow's scoring server is imported changes nothing there."""
    import fastapi
    from mlflow.pyfunc import scoring_server

    before = {
        name: getattr(scoring_server, name)
        for name in ("_parse_json_data", "invocations", "parse_csv_input", "init")
    }
    app_class = fastapi.FastAPI
    uri, env, *_ = logged_model
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    try:
        model = mlflow.pyfunc.load_model(uri)
    finally:
        mlflow.set_tracking_uri(None)
    assert fastapi.FastAPI is app_class
    assert {name: getattr(scoring_server, name) for name in before} == before
    app = scoring_server.init(model)  # MLflow's own app: no middleware of ours on it
    assert not any("BodyLimit" in repr(m) for m in app.user_middleware)


@pytest.mark.slow
def test_serve_in_fresh_virtualenv(tmp_path):
    """``--env-manager virtualenv``: a fresh venv from requirements.txt. The model carries no
    Python: its requirements name ``jaxexp-mlflow``, which the environment installs from the
    user's index, here a local wheelhouse of this checkout (``PIP_FIND_LINKS``), the way a
    private index works.

    Downloads jax, jaxlib, orbax-checkpoint and mlflow from PyPI (several minutes the first time;
    MLflow caches the environment under ~/.mlflow/envs afterwards).
    """
    from tests.models import batch, export_mlp, mlp_apply

    params = mlp_params()
    path = tmp_path / "model"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch(2))
    assert not (path / "code").exists()
    wheels = tmp_path / "wheelhouse"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    env = server_env(tmp_path)
    env["PATH"] = os.pathsep.join([VENV_BIN, "/root/.pyenv/bin", env["PATH"]])
    links = " ".join(p for p in (str(wheels), env.get("PIP_FIND_LINKS")) if p)
    env["PIP_FIND_LINKS"] = env["UV_FIND_LINKS"] = links
    env.pop("PYTHONPATH", None)
    proc, url = start_server(str(path), "virtualenv", env, tmp_path / "server.log", timeout=1800)
    try:
        x = batch(5, seed=7)
        r = post(url, {"inputs": x.tolist()})
        assert r.status_code == 200, r.text[:500]
        np.testing.assert_allclose(r.json()["predictions"], mlp_apply(params, x), rtol=1e-5)
        bad = post(url, {"inputs": [[1.0] * 7]})
        assert bad.status_code == 400 and "x: float32[-1,8]" in bad.json()["message"]
        # the server ran in a fresh env with jaxexp_mlflow installed from the wheelhouse
        import re

        log = (tmp_path / "server.log").read_text()
        env_dir = re.search(r"(/\S+/envs/mlflow-[0-9a-f]+)", log)
        assert env_dir, log[-2000:]
        found = subprocess.run(
            [
                f"{env_dir.group(1)}/bin/python",
                "-c",
                "import importlib.metadata as m, jaxexp_mlflow as j; "
                "print(m.version('jaxexp-mlflow'), j.__file__)",
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={k: v for k, v in env.items() if k != "PYTHONPATH"},
        )
        version, where = found.stdout.split()
        assert found.returncode == 0 and version == jaxexp_mlflow.__version__, found
        assert where.startswith(env_dir.group(1)), where  # the env's own copy, not the checkout
    finally:
        stop_server(proc)


# -- hostile requests ----------------------------------------------------------------------------

HOSTILE_JSON = {
    "5000-digit integer": '{"inputs": {"x": [[1,2,3,4,5,6,7,8]], "ids": [' + "9" * 5000 + "]}}",
    "1000-deep nesting": '{"inputs": {"x": ' + "[" * 1000 + "]" * 1000 + ', "ids": [1]}}',
    "Infinity": '{"inputs": {"x": [[Infinity,0,0,0,0,0,0,0]], "ids": [1]}}',
    "1e400": '{"inputs": {"x": [[1e400,0,0,0,0,0,0,0]], "ids": [1]}}',
}


@pytest.mark.parametrize("case", sorted(HOSTILE_JSON))
def test_hostile_json_gets_400(served, case):
    url, _, _, proc = served
    r = post(url, HOSTILE_JSON[case], raw=True)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert len(r.json()["message"]) < 700 and "9999999999" not in r.text
    message = r.json()["message"].lower()
    assert "expected" in message and "found" in message, message
    assert proc.poll() is None


def _raw_request(port: int, head_extra: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + head_extra
        + b"\r\n"
    )
    return s


def test_streamed_body_refused_while_it_streams(served):
    url, _, _, proc = served
    port = int(url.rsplit(":", 1)[1])
    before = tree_rss(proc.pid)
    s = _raw_request(port, b"Transfer-Encoding: chunked\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b"[" + b"1," * ((1 << 15) - 1) + b"1")
    sent = 0
    try:  # never finish the body: the answer must come while it streams (limit: 256 KiB)
        for _ in range(64):
            s.sendall(chunk)
            sent += 1 << 16
    except OSError:
        pass  # the server answered and closed while we were still sending
    assert http_status(s) == 413
    s.close()
    assert sent < 64 << 16 or tree_rss(proc.pid) - before < 32 << 20
    # in flight: bodies together may hold 4x the limit; beyond, 503 with Retry-After
    held = []
    for _ in range(4):
        h = _raw_request(port, b"Content-Length: %d\r\n" % (MAX_BODY - 10))
        h.sendall(b" " * (MAX_BODY - 100))  # nearly all of it, never the end
        held.append(h)
    time.sleep(1.0)
    extra = _raw_request(port, b"Content-Length: 200000\r\n")
    extra.sendall(b" " * 150_000)
    assert http_status(extra) == 503
    for h in [*held, extra]:
        h.close()
    time.sleep(0.5)
    assert post(url, {"inputs": _good()}).status_code == 200
