"""MLServer (V2 inference protocol) latency for a jaxexp model, against ``mlflow models serve``.

Serves the same model directory with ``mlserver start`` (runtime
``jaxexp_mlflow.serving.mlserver_runtime.JaxExpRuntime``, from ``.venv-mlserver``: see
scripts/mlserver_env.sh) and with ``mlflow models serve`` (the project's venv), both on
127.0.0.1, and reports the median request latency at batch 1 and 256 of each, requests of the two
servers interleaved. Skipped (exit 0, no rows) without ``.venv-mlserver``.

    python benchmarks/bench_mlserver.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pyfunc import apply, make_params  # noqa: E402
from bench_rest import free_port, start, stop  # noqa: E402

WIDTHS = (64, 256, 256, 10)
MLSERVER_BIN = Path(__file__).resolve().parents[1] / ".venv-mlserver" / "bin"
NAME = "jaxexp-model"
RUNTIME = "jaxexp_mlflow.serving.mlserver_runtime.JaxExpRuntime"


def start_mlserver(
    model_dir: Path, workdir: Path, env: dict, runtime: str = RUNTIME, workers: int = 0
) -> tuple[subprocess.Popen, str]:
    """``mlserver start`` with ``runtime`` on free ports of 127.0.0.1; (process, base url).
    ``workers``: MLServer's ``parallel_workers`` (0: the model runs in the server's process;
    MLServer's own default is 1, a spawned worker process)."""
    workdir.mkdir(parents=True, exist_ok=True)
    http = free_port()
    settings = {"host": "127.0.0.1", "http_port": http, "grpc_port": free_port()}
    settings.update(metrics_port=free_port(), parallel_workers=workers)
    (workdir / "settings.json").write_text(json.dumps(settings))
    model = {"name": NAME, "implementation": runtime}
    model["parameters"] = {"uri": str(model_dir)}
    (workdir / "model-settings.json").write_text(json.dumps(model))
    log = workdir / "mlserver.log"
    proc = subprocess.Popen(
        [str(MLSERVER_BIN / "mlserver"), "start", str(workdir)],
        env={**env, "PATH": f"{MLSERVER_BIN}{os.pathsep}{env['PATH']}"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{http}"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        try:
            if requests.get(f"{url}/v2/models/{NAME}/ready", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(log.read_text()[-3000:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not (MLSERVER_BIN / "mlserver").exists():
        print("skipped: no .venv-mlserver (bash scripts/mlserver_env.sh)")
        return 0
    import mlflow

    import jaxexp_mlflow  # noqa: F401

    tmp = Path(tempfile.mkdtemp(prefix="jaxexp-bench-mlserver-"))
    env = {**os.environ, "JAXEXP_COMPILATION_CACHE": str(tmp / "xla")}
    params = make_params(WIDTHS)
    model_dir = tmp / "model"
    example = np.zeros((2, WIDTHS[0]), "f4")
    mlflow.jaxexp.save_model(jax.jit(apply), model_dir, params=params, input_example=example)
    runs = 20 if args.quick else 200
    results: dict = {"jax": jax.__version__, "model": f"mlp-{'-'.join(map(str, WIDTHS))}"}
    rest, rest_url = start(model_dir, env, tmp / "rest.log")
    try:
        v2, v2_url = start_mlserver(model_dir, tmp / "mlserver", env)
        try:
            session = requests.Session()
            for n in (1, 256):
                x = np.random.default_rng(n).standard_normal((n, WIDTHS[0])).astype(np.float32)
                rest_body = json.dumps({"inputs": x.tolist()})
                v2_body = json.dumps(
                    {
                        "inputs": [
                            {"name": "x", "shape": list(x.shape), "datatype": "FP32"}
                            | {"data": x.reshape(-1).tolist()}
                        ]
                    }
                )
                calls = {
                    "rest": (f"{rest_url}/invocations", rest_body),
                    "mlserver": (f"{v2_url}/v2/models/{NAME}/infer", v2_body),
                }
                times: dict[str, list[float]] = {k: [] for k in calls}
                for i in range(runs + 5):
                    for key, (url, data) in calls.items():
                        t0 = time.perf_counter()
                        r = session.post(
                            url, data=data, headers={"Content-Type": "application/json"}
                        )
                        dt = time.perf_counter() - t0
                        if r.status_code != 200:
                            raise RuntimeError(f"{key} {r.status_code}: {r.text[:300]}")
                        if i >= 5:  # warm-up
                            times[key].append(dt)
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                results[f"batch_{n}"] = {
                    "rest_ms": round(med["rest"], 2),
                    "mlserver_ms": round(med["mlserver"], 2),
                    "ratio": round(med["mlserver"] / med["rest"], 2),
                }
        finally:
            stop(v2)
    finally:
        stop(rest)
    for n in (1, 256):
        r = results[f"batch_{n}"]
        print(
            f"batch {n:>3}: mlflow models serve {r['rest_ms']:.2f} ms, MLServer V2 "
            f"{r['mlserver_ms']:.2f} ms, ratio {r['ratio']}"
        )
    if args.json:
        results["rows"] = [
            {
                "figure": f"MLServer V2 median latency, batch {n} (ms)",
                "value": results[f"batch_{n}"]["mlserver_ms"],
                "baseline_name": "mlflow models serve (ms)",
                "baseline": results[f"batch_{n}"]["rest_ms"],
                "ratio": results[f"batch_{n}"]["ratio"],
                "goal": "reported",
            }
            for n in (1, 256)
        ]
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
