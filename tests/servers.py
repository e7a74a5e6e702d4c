"""Real servers the tests and benchmarks start on 127.0.0.1.

- `mlflow server` and moto's S3 (``mlflow_server``, ``s3_server``): context managers that start
  the process, wait until it answers (bounded in time), yield its URL and stop it on exit; used by
  tests/store/test_remote_*.py and benchmarks/bench_remote.py.
- A model's server, ``mlflow models serve`` (``start_server``) or ``jaxexp serve``
  (``start_jaxexp_server``), in its own process group; ``stop_server`` ends it and its workers.
- MLServer with either runtime (``start_mlserver``), from ``.venv-mlserver``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

#: Dummy credentials for moto's S3 (it accepts any); the region boto3 needs.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def wait_quiet(proc: subprocess.Popen, limit_s: float = 90.0) -> float:
    """Wait until ``proc`` and its children use less than 5 % of a core over a second; return
    the seconds waited. ``mlflow server`` answers ``/health`` while its job runner and huey
    consumers (MLflow 3's job execution, seven processes) are still importing, which takes both
    cores of a small machine for ~10 s: a benchmark starts timing after that."""
    import psutil

    def cpu(tree: psutil.Process) -> float:
        total = 0.0
        for p in [tree, *tree.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                total += times.user + times.system
        return total

    root, start = psutil.Process(proc.pid), time.monotonic()
    while time.monotonic() - start < limit_s:
        before = cpu(root)
        time.sleep(1.0)
        if cpu(root) - before < 0.05:
            break
    return time.monotonic() - start


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for servers the tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Exited(RuntimeError):
    """The server process exited before it answered."""


def _wait(
    url: str,
    proc: subprocess.Popen,
    log: Path,
    what: str,
    ready: Any,
    timeout: float = 90,
) -> None:
    """Wait until ``url`` answers as this server does (``ready(response)``) while ``proc`` is
    alive: another server that took the port (a test run beside this one) is not taken for it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if ready(requests.get(url, timeout=1)) and proc.poll() is None:
                return
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise _Exited(f"{what} exited: {log.read_text()[-2000:]}")
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")


def _port_taken(log: Path) -> bool:
    text = log.read_text(errors="replace").lower()
    return "address already in use" in text or "errno 98" in text


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra or {})
    return env


@contextlib.contextmanager
def s3_server(root: Path, bucket: str = "mlflow") -> Iterator[str]:
    """moto's S3-compatible server (``moto[server]``) with ``bucket`` created; yields its URL."""
    import boto3

    log = root / "moto.log"
    for attempt in range(3):  # a port another process took meanwhile: another free port
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=_env(S3_ENV),
            stdout=subprocess.DEVNULL,
            stderr=open(log, "w"),  # noqa: SIM115 - the child owns it
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait(f"{url}/moto-api/", proc, log, "moto server", lambda r: r.status_code == 200)
            break
        except _Exited:
            if attempt == 2 or not _port_taken(log):
                raise
    try:
        boto3.client("s3", endpoint_url=url, **_boto_kwargs()).create_bucket(Bucket=bucket)
        yield url
    finally:
        _stop(proc)


def _boto_kwargs() -> dict[str, str]:
    return {
        "aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": S3_ENV["AWS_DEFAULT_REGION"],
    }


@contextlib.contextmanager
def mlflow_server(
    root: Path,
    *,
    backend: str | None = None,
    artifacts_destination: str | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real ``mlflow server`` proxying artifacts (sqlite backend unless ``backend``); yields
    its URL and process. ``env`` adds variables (e.g. ``MLFLOW_S3_ENDPOINT_URL``).

    The server starts without MLflow's job execution (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION``:
    GenAI jobs, nothing a model's runs or artifacts use), which would otherwise start about ten
    huey consumer processes, each importing MLflow: ~20 s of CPU per server on two cores."""
    root.mkdir(parents=True, exist_ok=True)
    log = root / "server.log"
    given = port
    for attempt in range(3):  # a port another process took meanwhile: another free port
        port = given or free_port()
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            backend or f"sqlite:///{root / 'db.sqlite'}",
            "--artifacts-destination",
            artifacts_destination or str(root / "artifacts"),
            "--workers",
            "1",
        ]
        proc = subprocess.Popen(
            cmd,
            env=_env({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}),
            stdout=subprocess.DEVNULL,
            stderr=open(log, "a"),  # noqa: SIM115 - the child owns it
            start_new_session=True,  # killed with its workers as a group
        )
        url = f"http://127.0.0.1:{port}"
        try:  # MLflow's /health says OK; another server on the port would not
            _wait(f"{url}/health", proc, log, "mlflow server", _mlflow_ok)
            break
        except _Exited:
            kill_group(proc, signal.SIGTERM)
            if given or attempt == 2 or not _port_taken(log):
                raise
    try:
        yield url, proc
    finally:
        kill_group(proc, signal.SIGTERM)
        _stop(proc)


def _mlflow_ok(response: Any) -> bool:
    return response.status_code == 200 and response.text.strip() == "OK"


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal ``proc`` and the workers it started (its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def http_status(sock: socket.socket) -> int:
    """The status code of the HTTP answer read from ``sock`` (0: the peer closed first, or
    answered something that is not HTTP)."""
    head = b""
    while b"\r\n" not in head:
        part = sock.recv(4096)
        if not part:
            break
        head += part
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0


# -- a model's server: mlflow models serve, jaxexp serve, MLServer ---------------------------

VENV_BIN = str(Path(sys.executable).parent)


def wait_for_ping(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Wait until a model server answers ``/ping``; raise if it exits or the time runs out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if requests.get(f"{url}/ping", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server did not answer /ping within {timeout} s")


def start_server(model_uri: str, env_manager: str, env: dict, log: Path, timeout: float = 180):
    """Start ``mlflow models serve`` on a free port; return (process, base url)."""
    port = free_port()
    cmd = [os.path.join(VENV_BIN, "mlflow"), "models", "serve", "-m", model_uri]
    cmd += ["--env-manager", env_manager, "-h", "127.0.0.1", "-p", str(port)]
    return _launch(cmd, port, env, log, timeout)


def start_jaxexp_server(model_uri: str, env: dict, log: Path, *extra: str, timeout: float = 180):
    """Start ``jaxexp serve`` on a free port; return (process, base url)."""
    port = free_port()
    cmd = [os.path.join(VENV_BIN, "jaxexp"), "serve", "-m", model_uri, "--host", "127.0.0.1"]
    cmd += ["-p", str(port), *extra]
    return _launch(cmd, port, env, log, timeout)


def _launch(cmd: list[str], port: int, env: dict, log: Path, timeout: float):
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_ping(url, proc, timeout)
    except Exception:
        stop_server(proc)
        raise RuntimeError(f"server failed to start; log:\n{log.read_text()[-3000:]}") from None
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate the server and its workers (its own process group)."""
    try:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


def server_env(tmp: Path) -> dict:
    """The environment of a server (or CLI child) of a test: this venv first on PATH, its own
    compilation cache and a new sqlite store under ``tmp``."""
    from tests.conftest import sqlite_uri

    env = dict(os.environ)
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    env["JAXEXP_COMPILATION_CACHE"] = str(tmp / "xla-cache")
    env["MLFLOW_TRACKING_URI"] = sqlite_uri(tmp / "mlflow.db")
    return env


def post(url: str, body, *, raw: bool = False, timeout: float = 60) -> requests.Response:
    """POST ``body`` (JSON, or bytes as they are with ``raw``) to the server's ``/invocations``."""
    data = body if raw else json.dumps(body)
    return requests.post(
        f"{url}/invocations",
        data=data,
        headers={"Content-Type": "application/json"},
        timeout=timeout,
    )


def tree_rss(pid: int) -> int:
    """The resident memory of a process and all its children, in bytes."""
    import psutil

    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


#: The name MLServer serves the model under.
MODEL_NAME = "jaxexp-model"


#: MLServer's runtimes: MLflow's own (what KServe and Seldon run) and this package's.
STOCK = "mlserver_mlflow.MLflowRuntime"
OURS = "jaxexp_mlflow.serving.mlserver_runtime.JaxExpRuntime"


def start_mlserver(
    model_dir: Path, workdir: Path, runtime: str, workers: int = 0
) -> tuple[subprocess.Popen, str]:
    """``mlserver start`` (benchmarks/bench_mlserver.py) or skip without ``.venv-mlserver``."""
    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_mlserver

    if not (bench_mlserver.MLSERVER_BIN / "mlserver").exists():
        pytest.skip("no .venv-mlserver (bash scripts/mlserver_env.sh)")
    env = {**os.environ, "JAXEXP_COMPILATION_CACHE": str(workdir / "xla")}
    return bench_mlserver.start_mlserver(model_dir, workdir, env, runtime, workers)
