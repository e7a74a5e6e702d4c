"""Big models through a real tracking server: jaxexp against MLflow's own transfer of the bytes.

A real ``mlflow server`` (sqlite backend, artifacts proxied, 127.0.0.1) is started here. Each
round, interleaved (raw first in odd rounds, jaxexp first in even ones: the shared VM drifts):

* log: ``mlflow.jaxexp.log_model`` of a function with ``--size-gib`` of params against MLflow's
  ``log_artifacts`` of the same arrays as ``.npy`` files (written beforehand, not timed);
* load: ``mlflow.jaxexp.load_model("models:/...")`` until the params are in memory against
  ``mlflow.artifacts.download_artifacts`` of those ``.npy`` files (the bytes on local disk, not
  even read).

One untimed round of each comes first (the server's first gigabyte is slow whoever sends it).
Ratios are time(raw) / time(jaxexp): 1.0 is MLflow's own speed. Medians over the rounds.
``--scale 4,8`` also logs and loads models of 4 and 8 GiB, each step in a fresh process, and
reports the peak RSS above the interpreter (VmHWM) against the params size (goal < 1.25x).
``--artifacts s3`` puts the server's artifacts in moto's S3 server (multipart upload on).

    python benchmarks/bench_remote.py                     # 1 GiB, 3 rounds
    python benchmarks/bench_remote.py --quick             # 64 MiB, 1 round: seconds
    python benchmarks/bench_remote.py --scale 4,8 --rounds 1
    python benchmarks/bench_remote.py --size-gib 2 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from bench_params import make_params  # noqa: E402
from report import print_rows, write_json  # noqa: E402

from tests.models import log_registered  # noqa: E402
from tests.servers import S3_ENV, mlflow_server, s3_server, wait_quiet  # noqa: E402

GiB = 2**30


def apply(params: dict, x):
    """A cheap function of every params array (the reference run reads a row of each)."""
    import jax.numpy as jnp

    return x * sum(jnp.sum(layer["w"][:1]) for layer in params.values())


def log_ours(params: dict, name: str):
    return log_registered(apply, params, np.ones(4, np.float32), name)


def load_ours(uri: str):
    import jax
    import mlflow

    model = mlflow.jaxexp.load_model(uri)
    jax.block_until_ready(model.params)
    return model


def _peak() -> int:
    """VmHWM: the peak RSS of this process image."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(mode: str, url: str, size: int, name: str) -> None:
    """One step in a fresh process (``--child``): print the peak RSS it needed."""
    import jax
    import mlflow

    import jaxexp_mlflow  # noqa: F401

    mlflow.set_tracking_uri(url)
    mlflow.set_experiment("bench-remote")
    base = _peak()
    t = time.perf_counter()
    if mode == "log":
        params = make_params(size)
        t = time.perf_counter()
        log_ours(params, name)
    else:
        model = load_ours(f"models:/{name}/latest")
        # touch every byte: the params must really be in memory, not only mapped
        total = sum(float(np.asarray(a).sum()) for a in jax.tree.leaves(model.params))
        assert np.isfinite(total)
    print(json.dumps({"base": base, "peak": _peak(), "seconds": time.perf_counter() - t}))


def bench_scale(url: str, sizes: list[float]) -> list[dict]:
    rows = []
    for gib in sizes:
        size = int(gib * GiB)
        res = {}
        for mode in ("log", "load"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, url, str(size), f"scale{gib:g}"],
                check=True,
                capture_output=True,
                text=True,
            )
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        for mode, r in res.items():
            peak = r["peak"] - r["base"]
            rows.append(
                {
                    "figure": f"{mode} peak RSS above interpreter ({gib:g} GiB params) GiB",
                    "value": round(peak / GiB, 3),
                    "baseline_name": "params size",
                    "baseline": round(size / GiB, 3),
                    "ratio": round(peak / size, 3),
                    "goal": "< 1.25",
                    "seconds": round(r["seconds"], 1),
                    "GB/s": round(size / r["seconds"] / 1e9, 3),
                }
            )
    return rows


def bench_transfer(size_gib: float, rounds: int, workdir: Path) -> list[dict]:
    import jax
    import mlflow

    params = make_params(int(size_gib * GiB))
    npy = workdir / "npy"
    npy.mkdir()
    for i, a in enumerate(jax.tree.leaves(params)):
        np.save(npy / f"{i:02d}.npy", np.asarray(a))
    times: dict[str, list[float]] = {k: [] for k in ("raw_log", "log", "raw_load", "load")}
    loads: list[float] = []  # load average (1 min) after each round: the VM is shared

    def timed(key: str, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        times[key].append(time.perf_counter() - t)
        return out

    def raw_log() -> str:
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(npy), "raw")
        return run.info.run_id

    # one untimed round of each first: the server's first gigabyte is slow whoever sends it
    # (raw's first upload took 6-8 s against ~3 s after), and jaxexp's first log compiles
    shutil.rmtree(mlflow.artifacts.download_artifacts(f"runs:/{raw_log()}/raw"))
    log_ours(params, "bench")
    load_ours("models:/bench/1")  # the model is dropped at once; collected below
    gc.collect()
    for r in range(rounds):
        order = ("raw", "ours") if r % 2 == 0 else ("ours", "raw")
        for who in order:
            if who == "raw":
                run_id = timed("raw_log", raw_log)
                dl = timed("raw_load", mlflow.artifacts.download_artifacts, f"runs:/{run_id}/raw")
                shutil.rmtree(dl, ignore_errors=True)
            else:
                timed("log", log_ours, params, "bench")
                model = timed("load", load_ours, f"models:/bench/{r + 2}")
                del model
                # JAX frees host buffers it adopted without a copy (the mapped params) only at
                # a cyclic collection: without it the next contender writes into fresh pages
                gc.collect()
        loads.append(os.getloadavg()[0])
        print(
            f"round {r + 1}: "
            + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items())
            + f", loadavg {os.getloadavg()}",
            flush=True,
        )
    rows = []
    for step, label in (("log", "log_model"), ("load", 'load_model("models:/...")')):
        ours, raw = times[step], times[f"raw_{step}"]
        rows.append(
            {
                "figure": f"{label} {size_gib:g} GiB, time ratio raw/ours",
                "value": round(statistics.median(ours), 3),
                "baseline_name": "MLflow "
                + ("log_artifacts" if step == "log" else "download_artifacts")
                + " of the .npy files, s",
                "baseline": round(statistics.median(raw), 3),
                "ratio": round(statistics.median(raw) / statistics.median(ours), 3),
                "goal": ">= 0.9",
                "samples_s": [round(x, 3) for x in ours],
                "baseline_samples_s": [round(x, 3) for x in raw],
                "best_ratio": round(min(raw) / min(ours), 3),
                "loadavg_1min": [round(v, 2) for v in loads],
            }
        )
    return rows


@contextlib.contextmanager
def server(root: Path, artifacts: str):
    """The server under test: local artifacts, or moto's S3 with multipart uploads on."""
    if artifacts == "local":
        with mlflow_server(root / "server") as (url, proc):
            wait_quiet(proc)
            yield url
        return
    with s3_server(root) as s3:
        env = {**S3_ENV, "MLFLOW_S3_ENDPOINT_URL": s3}
        os.environ.update(env)
        os.environ["MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD"] = "true"
        with mlflow_server(
            root / "server", artifacts_destination="s3://mlflow/artifacts", env=env
        ) as (url, proc):
            wait_quiet(proc)
            yield url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 1 round")
    ap.add_argument("--size-gib", type=float, default=None, help="params size (default 1)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    ap.add_argument("--scale", default="", help="also peak RSS at these sizes, e.g. 4,8 (GiB)")
    ap.add_argument("--artifacts", choices=("local", "s3"), default="local")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--child", nargs=4, metavar=("MODE", "URL", "BYTES", "NAME"), help="internal")
    a = ap.parse_args(argv)
    if a.child:
        child(a.child[0], a.child[1], int(a.child[2]), a.child[3])
        return 0
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    size = a.size_gib if a.size_gib is not None else (1 / 16 if a.quick else 1.0)
    rounds = a.rounds or (1 if a.quick else 3)
    import mlflow

    workdir = Path(tempfile.mkdtemp(prefix="bench_remote_", dir=os.getcwd()))
    try:
        with server(workdir, a.artifacts) as url:
            mlflow.set_tracking_uri(url)
            mlflow.set_experiment("bench-remote")
            rows = bench_scale(url, [float(s) for s in a.scale.split(",") if s])
            rows = bench_transfer(size, rounds, workdir) + rows
    finally:
        mlflow.set_tracking_uri(None)
        shutil.rmtree(workdir, ignore_errors=True)
    print_rows(rows)
    if a.json:
        write_json(a.json, "remote", rows, artifacts=a.artifacts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
