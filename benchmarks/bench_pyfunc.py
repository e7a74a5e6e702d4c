"""pyfunc.predict latency of a jaxexp model as a ratio to the raw jitted call.

For each model, in the same process: ``jax.jit(f)(params, x)`` (blocked until ready) is the
baseline; ``mlflow.pyfunc.load_model(...).predict(x)`` is measured at batch 1 and 1024, and so
is the jaxexp part alone (``JaxExpPyfunc.predict``, without MLflow's ``PyFuncModel`` wrapper,
whose signature enforcement and prediction context cost a fixed few tens of microseconds).
Goal: pyfunc.predict at batch 1 within 1.3x of the jitted call. "floor" is MLflow's own
``PyFuncModel`` (the loaded model's metadata) around the bare jitted call: what any model pays
through ``mlflow.pyfunc``.

    python benchmarks/bench_pyfunc.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

MODELS = {  # name: layer widths
    "mlp-8-16-4": (8, 16, 4),
    "mlp-784-512-512-10": (784, 512, 512, 10),
}


def make_params(widths: tuple[int, ...], seed: int = 0) -> list[dict]:
    keys = jax.random.split(jax.random.key(seed), len(widths) - 1)
    return [
        {
            "w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
            "b": jnp.zeros((b,), jnp.float32),
        }
        for k, a, b in zip(keys, widths[:-1], widths[1:], strict=True)
    ]


def apply(params: list[dict], x: jax.Array) -> jax.Array:
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def timeit(fn, *, seconds: float, min_runs: int = 20) -> float:
    """Median wall time of ``fn()`` in microseconds over ~``seconds`` (after a warm-up)."""
    for _ in range(5):
        fn()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < min_runs:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def compare(fns: dict, *, seconds: float, min_runs: int = 50) -> dict[str, float]:
    """Median microseconds of each function, calls interleaved round-robin.

    Interleaving keeps a shared machine's load drift from favouring one of them.
    """
    for fn in fns.values():
        for _ in range(5):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    end = time.perf_counter() + seconds * len(fns)
    while time.perf_counter() < end or len(times[next(iter(fns))]) < min_runs:
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


class _Bare:
    """A pyfunc implementation that is only the jitted call (MLflow's floor, above); its
    predict carries a precomputed ``__signature__`` as the flavor's does, so that MLflow's
    per-call ``inspect.signature`` is a lookup and the floor is MLflow's least cost."""

    def __init__(self, jitted, params) -> None:
        import inspect

        def predict(data, params=None):
            return np.asarray(jitted(dev_params, data))

        dev_params = params
        predict.__signature__ = inspect.signature(predict)
        self.predict = predict


def bench_model(name: str, widths: tuple[int, ...], tmp: Path, seconds: float) -> dict:
    import mlflow

    import jaxexp_mlflow  # noqa: F401

    params = make_params(widths)
    x_ex = np.zeros((2, widths[0]), np.float32)
    path = tmp / name
    mlflow.jaxexp.save_model(jax.jit(apply), path, params=params, input_example=x_ex)
    model = mlflow.pyfunc.load_model(str(path))
    impl = model._model_impl  # the JaxExpPyfunc inside the PyFuncModel
    jitted = jax.jit(apply)
    # the same param arrays for every contender: calls are interleaved, and two copies of the
    # weights would evict each other from the CPU caches and bias the comparison
    # (the model stores its params as a flat {name: array} dict, docs/model-families.md)
    flat = impl.model.params
    dev_params = [{k: flat[f"[{i}].{k}"] for k in ("w", "b")} for i in range(len(widths) - 1)]
    # MLflow's floor: its own PyFuncModel (same metadata, so the same signature handling)
    # around the bare jitted call; what any flavor pays through mlflow.pyfunc
    floor = mlflow.pyfunc.PyFuncModel(model.metadata, _Bare(jitted, dev_params))
    rows = {}
    for n in (1, 1024):
        x = np.random.default_rng(n).standard_normal((n, widths[0])).astype(np.float32)
        np.testing.assert_allclose(model.predict(x), jitted(dev_params, x), rtol=1e-4, atol=1e-4)
        t = compare(
            {
                "jit": lambda x=x: jitted(dev_params, x).block_until_ready(),
                "jit_np": lambda x=x: np.asarray(jitted(dev_params, x)),
                "pyfunc": lambda x=x: model.predict(x),
                "ours": lambda x=x: impl.predict(x),
                "floor": lambda x=x: floor.predict(x),
            },
            seconds=seconds,
        )
        base, base_np, pyf, ours, fl = t["jit"], t["jit_np"], t["pyfunc"], t["ours"], t["floor"]
        rows[n] = {
            "jit_us": round(base, 1),
            "jit_to_numpy_us": round(base_np, 1),
            "pyfunc_predict_us": round(pyf, 1),
            "jaxexp_predict_us": round(ours, 1),
            "ratio_pyfunc": round(pyf / base, 3),
            "ratio_jaxexp": round(ours / base, 3),
            "mlflow_floor_us": round(fl, 1),
            "ratio_floor": round(fl / base, 3),
            "ratio_pyfunc_to_floor": round(pyf / fl, 3),
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds in all")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    seconds = 0.3 if args.quick else 2.0
    os.environ.setdefault("JAXEXP_COMPILATION_CACHE", tempfile.mkdtemp(prefix="jaxexp-bench-"))
    results = {"jax": jax.__version__, "backend": jax.default_backend(), "models": {}}
    results["loadavg_start"] = [round(v, 2) for v in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        for name, widths in MODELS.items():
            results["models"][name] = bench_model(name, widths, Path(tmp), seconds)
    print(
        f"{'model':<22}{'batch':>6}{'jit us':>10}{'pyfunc us':>11}{'ratio':>8}"
        f"{'jaxexp us':>11}{'ratio':>8}{'floor us':>10}{'ratio':>8}{'pyf/floor':>10}"
    )
    for name, rows in results["models"].items():
        for n, r in rows.items():
            print(
                f"{name:<22}{n:>6}{r['jit_us']:>10.1f}{r['pyfunc_predict_us']:>11.1f}"
                f"{r['ratio_pyfunc']:>8.2f}{r['jaxexp_predict_us']:>11.1f}{r['ratio_jaxexp']:>8.2f}"
                f"{r['mlflow_floor_us']:>10.1f}{r['ratio_floor']:>8.2f}"
                f"{r['ratio_pyfunc_to_floor']:>10.2f}"
            )
    print("goal: pyfunc.predict at batch 1 within 1.3x of the jitted call")
    print("floor: MLflow's PyFuncModel around np.asarray(jax.jit(f)(params, x)), same metadata")
    results["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    print(f"loadavg start {results['loadavg_start']}, end {results['loadavg_end']}")
    if args.json:
        results["rows"] = summary_rows(results)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def summary_rows(results: dict) -> list[dict]:
    """The figure/baseline/ratio/goal rows the suite runner (run_all.py) prints."""
    rows = []
    for name, by_batch in results["models"].items():
        for n, r in by_batch.items():
            for label, key in (("pyfunc.predict", "pyfunc"), ("JaxExpPyfunc.predict", "jaxexp")):
                rows.append(
                    {
                        "figure": f"{label}, {name}, batch {n} (µs)",
                        "value": r[f"{key}_predict_us"],
                        "baseline_name": "jax.jit(f)(params, x)",
                        "baseline": r["jit_us"],
                        "ratio": r[f"ratio_{key}"],
                        "goal": "<= 1.3" if (str(n) == "1" and key == "pyfunc") else "",
                    }
                )
            rows.append(
                {
                    "figure": f"MLflow's floor (PyFuncModel around the jitted call), {name}, "
                    f"batch {n} (µs)",
                    "value": r["mlflow_floor_us"],
                    "baseline_name": "jax.jit(f)(params, x)",
                    "baseline": r["jit_us"],
                    "ratio": r["ratio_floor"],
                    "goal": "(reference)",
                }
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
