"""REST latency of a served jaxexp model, against the raw jitted call, the JSON floor and the peer.

Starts real servers on 127.0.0.1 and measures, in the same run:

* the request parse at batch 256 of the 784-512-512-10 MLP (a 4.1 MB JSON body), in process:
  ``pyfunc.parse_request`` (what ``jaxexp serve`` runs: ``json.loads`` + the contract on the
  arrays) and the whole server-side request (parse, predict, JSON answer) against the floor,
  a plain ``json.loads`` + ``np.asarray`` of the same body, and against the per-number-hook
  parser of earlier releases; contenders interleaved in rounds, ``gc.collect()`` between them;
* REST p50 at batch 1 and 256 of the same model through ``jaxexp serve``, through ``mlflow models
  serve`` and of the peer (a hand-written MLflow ``PythonModel`` around ``jax.jit(exp.call)``
  served by ``mlflow models serve``), requests of the three servers interleaved;
* batch 1 and batch 1024 latency of ``jaxexp serve`` (64-256-256-10 MLP) as a ratio to
  ``jax.jit(f)(params, x)``;
* p50/p99 under a mix of batch sizes (uniform 1..128, every request a new random size) after a
  warm-up, with buckets on (the default) and, unless ``--quick``, with ``JAXEXP_BUCKETS=off``
  for comparison (each new batch size then compiles on the request path).

Goals: the request parse within 1.2x of the floor; REST p99 under mixed batch sizes no more
than 2x its p50.

    python benchmarks/bench_rest.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import socket
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
from bench_pyfunc import apply, make_params, timeit  # noqa: E402

WIDTHS = (64, 256, 256, 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    model_dir: Path, env: dict, log: Path, server: str = "mlflow"
) -> tuple[subprocess.Popen, str]:
    """``mlflow models serve`` (``server="mlflow"``) or ``jaxexp serve`` on a free port."""
    port = free_port()
    venv_bin = str(Path(sys.executable).parent)
    env = {**env, "PATH": venv_bin + os.pathsep + env.get("PATH", "")}
    if server == "jaxexp":
        cmd = [os.path.join(venv_bin, "jaxexp"), "serve", "-m", str(model_dir), "--host"]
        cmd += ["127.0.0.1", "-p", str(port)]
    else:
        cmd = [os.path.join(venv_bin, "mlflow"), "models", "serve", "-m", str(model_dir)]
        cmd += ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(
        cmd,
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


BIG = (784, 512, 512, 10)  # the model of the parse and peer figures: 4.1 MB bodies at batch 256

PEER_SOURCE = """
import mlflow
import numpy as np


class Peer(mlflow.pyfunc.PythonModel):
    \"\"\"What a user writes without jaxexp-mlflow: deserialize, restore, jit, predict.\"\"\"

    def load_context(self, context):
        import jax
        from jax import export

        with open(context.artifacts["blob"], "rb") as fh:
            exp = export.deserialize(bytearray(fh.read()))
        flat = np.load(context.artifacts["params"])
        n = len(flat.files) // 2
        self.params = [{"w": flat[f"{i}.w"], "b": flat[f"{i}.b"]} for i in range(n)]
        self.params = jax.device_put(self.params)
        self.fn = jax.jit(exp.call)

    def predict(self, context, model_input, params=None):
        x = np.asarray(model_input, dtype=np.float32)
        return np.asarray(self.fn(self.params, x))


mlflow.models.set_model(Peer())
"""


def save_peer(params: list, widths: tuple, tmp: Path) -> Path:
    """The peer: an MLflow ``PythonModel`` (models from code) around ``jax.jit(exp.call)``."""
    import mlflow

    spec = jax.export.symbolic_shape(f"b, {widths[0]}")
    exp = jax.export.export(jax.jit(apply))(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
        jax.ShapeDtypeStruct(spec, np.float32),
    )
    (tmp / "peer.bin").write_bytes(exp.serialize())
    flat = {f"{i}.{k}": np.asarray(v) for i, layer in enumerate(params) for k, v in layer.items()}
    np.savez(tmp / "peer_params.npz", **flat)
    (tmp / "peer_model.py").write_text(PEER_SOURCE)
    path = tmp / "peer"
    mlflow.pyfunc.save_model(
        path,
        python_model=str(tmp / "peer_model.py"),
        artifacts={"blob": str(tmp / "peer.bin"), "params": str(tmp / "peer_params.npz")},
    )
    return path


def hook_loads(text: str) -> object:
    """The parser of earlier releases: ``json.loads`` with a Python hook per number."""

    def parse_int(s: str) -> int:
        if len(s.lstrip("-")) > 40:
            raise ValueError(s[:20])
        return int(s)

    def parse_float(s: str) -> float:
        value = float(s)
        if not math.isfinite(value):
            raise ValueError(s[:20])
        return value

    def parse_constant(s: str) -> float:
        raise ValueError(s)

    return json.loads(
        text, parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant
    )


def parse_figures(model_dir: Path, rounds: int) -> dict:
    """Request parse and server-side request at batch 256 against the JSON floor, in process."""
    from jaxexp_mlflow.serving import pyfunc, server

    _, impl = server.load(str(model_dir), {"precompile": [256]})
    x = np.random.default_rng(256).standard_normal((256, BIG[0])).astype(np.float32)
    data = body(x).encode()
    contenders = {
        "floor": lambda: np.asarray(json.loads(data)["inputs"]),
        "hooks": lambda: impl.convert_inputs(hook_loads(data.decode())["inputs"], wire=True),
        "parse": lambda: pyfunc.parse_request(impl, data),
        "request": lambda: server.invocations(impl, data, "application/json"),
    }
    assert contenders["request"]()[1] == 200
    times: dict[str, list] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "body_bytes": len(data),
        "rounds": rounds,
        "loadavg": [round(v, 2) for v in os.getloadavg()],
        **{f"{k}_ms": round(v, 2) for k, v in med.items()},
        **{f"{k}_ratio": round(med[k] / med["floor"], 3) for k in ("hooks", "parse", "request")},
    }


def peer_figures(servers: dict[str, str], rounds: int) -> dict:
    """REST latency at batch 1 and 256 of each server, requests interleaved in rounds."""
    out: dict = {}
    for n in (1, 256):
        x = np.random.default_rng(n).standard_normal((n, BIG[0])).astype(np.float32)
        data = body(x)
        sessions = {name: requests.Session() for name in servers}
        first = {}
        for name, url in servers.items():  # warm-up (the peer compiles this batch size here)
            for _ in range(3):
                r = sessions[name].post(
                    f"{url}/invocations", data=data, headers={"Content-Type": "application/json"}
                )
            assert r.status_code == 200, (name, r.text[:300])
            first[name] = np.asarray(r.json()["predictions"])
        for name in servers:
            np.testing.assert_allclose(first[name], first["peer"], rtol=1e-4, atol=1e-4)
        times: dict[str, list] = {name: [] for name in servers}
        for _ in range(rounds):
            for name, url in servers.items():
                times[name].append(post(sessions[name], url, data))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out[n] = {f"{k}_ms": round(v, 2) for k, v in med.items()}
        out[n]["loadavg"] = [round(v, 2) for v in os.getloadavg()]
        out[n].update({f"{k}_vs_peer": round(v / med["peer"], 3) for k, v in med.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds of load")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--only",
        default="parse,peer,latency,mixed",
        help="comma-separated parts to run: parse, peer, latency, mixed (default: all)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the parse/peer parts")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))

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

    big_params = make_params(BIG)
    big_dir = tmp / "big"
    mlflow.jaxexp.save_model(
        jax.jit(apply), big_dir, params=big_params, input_example=np.zeros((2, BIG[0]), "f4")
    )
    if "parse" in parts:
        results["parse"] = parse_figures(big_dir, args.rounds or (7 if args.quick else 25))
    peer_dir = save_peer(big_params, BIG, tmp)
    procs = []
    try:
        if "peer" not in parts:
            raise _Skip
        servers = {}
        for name, path, kind in (
            ("peer", peer_dir, "mlflow"),
            ("mlflow_serve", big_dir, "mlflow"),
            ("jaxexp_serve", big_dir, "jaxexp"),
        ):
            proc, servers[name] = start(path, env, tmp / f"{name}.log", kind)
            procs.append(proc)
        results["peer"] = peer_figures(servers, args.rounds or (10 if args.quick else 40))
    except _Skip:
        pass
    finally:
        for proc in procs:
            stop(proc)

    proc, url = start(model_dir, env, tmp / "server.log", "jaxexp")
    try:
        if not parts & {"latency", "mixed"}:
            raise _Skip
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
    except _Skip:
        pass
    finally:
        stop(proc)
    if not args.quick and "mixed" in parts:
        proc, url = start(
            model_dir, {**env, "JAXEXP_BUCKETS": "off"}, tmp / "server-off.log", "jaxexp"
        )
        try:
            mixed(url, 50, seed=0)
            results["mixed_no_buckets"] = mixed(url, n_mixed, seed=1)
        finally:
            stop(proc)

    pr = results.get("parse")
    print(f"loadavg at the end: {os.getloadavg()}")
    if pr:
        print(
            f"parse, batch 256 of mlp-784-512-512-10 ({pr['body_bytes']} bytes, {pr['rounds']} "
            f"rounds): floor json.loads+np.asarray {pr['floor_ms']} ms; per-number hooks "
            f"{pr['hooks_ms']} ms ({pr['hooks_ratio']}x); parse_request {pr['parse_ms']} ms "
            f"({pr['parse_ratio']}x, goal <= 1.2); whole request {pr['request_ms']} ms "
            f"({pr['request_ratio']}x)"
        )
    for n, r in results.get("peer", {}).items():
        print(
            f"REST p50 batch {n:>3}: peer {r['peer_ms']} ms, mlflow models serve "
            f"{r['mlflow_serve_ms']} ms ({r['mlflow_serve_vs_peer']}x), jaxexp serve "
            f"{r['jaxexp_serve_ms']} ms ({r['jaxexp_serve_vs_peer']}x)"
        )
    print(f"model {results['model']}, jax {results['jax']}")
    for n, r in results.get("latency", {}).items():
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


class _Skip(Exception):
    """A part of the benchmark left out by ``--only``."""


def summary_rows(results: dict) -> list[dict]:
    """The figure/baseline/ratio/goal rows the suite runner (run_all.py) prints."""
    pr = results.get("parse")
    rows = (
        []
        if not pr
        else [
            {
                "figure": f"REST request parse, batch 256, {name} (ms)",
                "value": pr[f"{key}_ms"],
                "baseline_name": "json.loads + np.asarray of the same 4.1 MB body",
                "baseline": pr["floor_ms"],
                "ratio": pr[f"{key}_ratio"],
                "goal": goal,
            }
            for key, name, goal in (
                ("parse", "parse_request", "<= 1.2"),
                ("request", "parse + predict + answer", "(reference)"),
                ("hooks", "per-number hooks (before)", "(reference)"),
            )
        ]
    )
    for n, r in results.get("peer", {}).items():
        for key, name in (
            ("jaxexp_serve", "jaxexp serve"),
            ("mlflow_serve", "mlflow models serve"),
        ):
            rows.append(
                {
                    "figure": f"REST p50, batch {n}, mlp-784-512-512-10, {name} (ms)",
                    "value": r[f"{key}_ms"],
                    "baseline_name": "peer PythonModel under mlflow models serve",
                    "baseline": r["peer_ms"],
                    "ratio": r[f"{key}_vs_peer"],
                    "goal": "(reference)",
                }
            )
    rows += [
        {
            "figure": f"REST /invocations, batch {n} (µs)",
            "value": r["rest_us"],
            "baseline_name": "jax.jit(f)(params, x)",
            "baseline": r["jit_us"],
            "ratio": r["ratio"],
            "goal": "(JSON-bound; reference)",
        }
        for n, r in results.get("latency", {}).items()
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
