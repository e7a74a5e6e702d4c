"""REST latency of ``mlflow models serve`` for a jaxexp model, against the raw jitted call.

Starts a real server (``--env-manager local``) on 127.0.0.1 and measures, in the same run:

* batch 1 and batch 1024 request latency (median) as a ratio to ``jax.jit(f)(params, x)``;
* p50/p99 under a mix of batch sizes (uniform 1..128, every request a new random size) after a
  warm-up, with buckets on (the default) and, unless ``--quick``, with ``JAXEXP_BUCKETS=off``
  for comparison (each new batch size then compiles on the request path).

Goal: REST p99 under mixed batch sizes no more than 2x its p50.

    python benchmarks/bench_rest.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pyfunc import apply, make_params, timeit  # noqa: E402

WIDTHS = (64, 256, 256, 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir: Path, env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    venv_bin = str(Path(sys.executable).parent)
    env = {**env, "PATH": venv_bin + os.pathsep + env.get("PATH", "")}
    proc = subprocess.Popen(
        [os.path.join(venv_bin, "mlflow"), "models", "serve", "-m", str(model_dir)]
        + ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            if requests.get(f"{url}/ping", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    stop(proc)
    raise TimeoutError("server did not start")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def body(x: np.ndarray) -> str:
    return json.dumps({"inputs": x.tolist()})


def post(session: requests.Session, url: str, data: str) -> float:
    t0 = time.perf_counter()
    r = session.post(
        f"{url}/invocations", data=data, headers={"Content-Type": "application/json"}, timeout=120
    )
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
    return dt


def mixed(url: str, n_requests: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    session = requests.Session()
    bodies = [
        body(rng.standard_normal((int(rng.integers(1, 129)), WIDTHS[0])).astype(np.float32))
        for _ in range(n_requests)
    ]
    times = sorted(post(session, url, b) * 1e3 for b in bodies)
    p50 = times[len(times) // 2]
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    return {
        "requests": n_requests,
        "p50_ms": round(p50, 2),
        "p99_ms": round(p99, 2),
        "p99_over_p50": round(p99 / p50, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds of load")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    import mlflow

    import jaxexp_mlflow  # noqa: F401

    tmp = Path(tempfile.mkdtemp(prefix="jaxexp-bench-rest-"))
    env = dict(os.environ)
    env["JAXEXP_COMPILATION_CACHE"] = str(tmp / "xla")
    params = make_params(WIDTHS)
    model_dir = tmp / "model"
    mlflow.jaxexp.save_model(
        jax.jit(apply), model_dir, params=params, input_example=np.zeros((2, WIDTHS[0]), "f4")
    )
    jitted = jax.jit(apply)
    dev_params = jax.device_put(params)
    seconds = 0.5 if args.quick else 3.0
    n_mixed = 150 if args.quick else 600
    results: dict = {"jax": jax.__version__, "model": f"mlp-{'-'.join(map(str, WIDTHS))}"}

    proc, url = start(model_dir, env, tmp / "server.log")
    try:
        session = requests.Session()
        latency = {}
        for n in (1, 1024):
            x = np.random.default_rng(n).standard_normal((n, WIDTHS[0])).astype(np.float32)
            data = body(x)
            r = session.post(
                f"{url}/invocations", data=data, headers={"Content-Type": "application/json"}
            )
            np.testing.assert_allclose(
                r.json()["predictions"], jitted(dev_params, x), rtol=1e-4, atol=1e-4
            )
            base = timeit(lambda x=x: jitted(dev_params, x).block_until_ready(), seconds=seconds)
            rest = timeit(lambda d=data: post(session, url, d), seconds=seconds, min_runs=10)
            latency[n] = {
                "jit_us": round(base, 1),
                "rest_us": round(rest, 1),
                "ratio": round(rest / base, 1),
            }
        results["latency"] = latency
        mixed(url, 50, seed=0)  # warm-up
        results["mixed_buckets"] = mixed(url, n_mixed, seed=1)
    finally:
        stop(proc)
    if not args.quick:
        proc, url = start(model_dir, {**env, "JAXEXP_BUCKETS": "off"}, tmp / "server-off.log")
        try:
            mixed(url, 50, seed=0)
            results["mixed_no_buckets"] = mixed(url, n_mixed, seed=1)
        finally:
            stop(proc)

    print(f"model {results['model']}, jax {results['jax']}")
    for n, r in results["latency"].items():
        print(
            f"batch {n:>5}: jit {r['jit_us']:>9.1f} us  REST {r['rest_us']:>9.1f} us  "
            f"ratio {r['ratio']:>6.1f}x"
        )
    for key in ("mixed_buckets", "mixed_no_buckets"):
        if key in results:
            m = results[key]
            print(
                f"{key:<17}: {m['requests']} requests, batch 1..128: p50 {m['p50_ms']} ms, "
                f"p99 {m['p99_ms']} ms, p99/p50 {m['p99_over_p50']} (goal <= 2)"
            )
    if args.json:
        results["rows"] = summary_rows(results)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def summary_rows(results: dict) -> list[dict]:
    """The figure/baseline/ratio/goal rows the suite runner (run_all.py) prints."""
    rows = [
        {
            "figure": f"REST /invocations, batch {n} (µs)",
            "value": r["rest_us"],
            "baseline_name": "jax.jit(f)(params, x)",
            "baseline": r["jit_us"],
            "ratio": r["ratio"],
            "goal": "(JSON-bound; reference)",
        }
        for n, r in results["latency"].items()
    ]
    for key, label in (("mixed_buckets", "buckets on"), ("mixed_no_buckets", "buckets off")):
        if key in results:
            m = results[key]
            rows.append(
                {
                    "figure": f"REST p99, mixed batch 1..128, {label} (ms)",
                    "value": m["p99_ms"],
                    "baseline_name": "p50 of the same requests",
                    "baseline": m["p50_ms"],
                    "ratio": m["p99_over_p50"],
                    "goal": "<= 2" if key == "mixed_buckets" else "(reference)",
                }
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
