"""On the accelerator JAX runs on: call, predict and params-load speed against raw JAX, same run.

Ratios (ours / baseline, below 1 = ours faster), each baseline measured in this process:

* ``model(x)`` and ``pyfunc.predict(x)`` against ``jax.jit(f)(params, x)`` at batch 1 and 1024,
  from numpy inputs and from device arrays (a 784-512-512-10 MLP, float32);
* ``load_model`` of 1 and 4 GiB of float32 and bfloat16 params (restored straight into device
  memory) against ``np.load`` of the same arrays from ``.npy`` files plus ``jax.device_put``,
  interleaved, after one warm-up of each (page cache warm for both).

    python benchmarks/bench_gpu.py [--quick] [--sizes 1,4] [--json out.json]

It names the device it ran on. ``run_all.py`` runs it where an accelerator is visible and
stores its rows as the ``gpu`` family of a results file (BENCHMARKS.md, "GPU").
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlflow  # noqa: E402

import jaxexp_mlflow  # noqa: E402, F401
from jaxexp_mlflow.runtime.platforms import running_platform  # noqa: E402


def _mlp_apply(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    h = jax.nn.relu(h @ p["w2"] + p["b2"])
    return h @ p["w3"] + p["b3"]


def _timed_us(fn, x, number: int, rounds: int) -> float:
    """Median over rounds of the mean per call (µs), blocking on each result."""
    jax.block_until_ready(fn(x))
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(number):
            jax.block_until_ready(fn(x))
        per.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(per)


def bench_calls(tmp: Path, quick: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    dims = [784, 512, 512, 10]
    params = {}
    for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False), start=1):
        params[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    x = rng.standard_normal((4, 784)).astype(np.float32)
    mlflow.jaxexp.save_model(jax.jit(_mlp_apply), tmp / "mlp", params=params, input_example=x)
    model = mlflow.jaxexp.load_model(str(tmp / "mlp"))
    pyf = mlflow.pyfunc.load_model(str(tmp / "mlp"))
    dev_params = jax.device_put(params)
    jitted = jax.jit(_mlp_apply)
    number, rounds = (50, 3) if quick else (300, 5)
    rows = []
    for batch in (1, 1024):
        xb = rng.standard_normal((batch, 784)).astype(np.float32)
        xd = jax.device_put(xb)
        base_np = _timed_us(lambda v: jitted(dev_params, v), xb, number, rounds)
        base_dev = _timed_us(lambda v: jitted(dev_params, v), xd, number, rounds)
        ours_np = _timed_us(model, xb, number, rounds)
        ours_dev = _timed_us(model, xd, number, rounds)
        # pyfunc returns numpy: its baseline is the jitted call brought back to the host
        base_host = _timed_us(lambda v: np.asarray(jitted(dev_params, v)), xb, number, rounds)
        pyf_np = _timed_us(pyf.predict, xb, number, rounds)
        for what, ours, base in (
            ("model(x) numpy", ours_np, base_np),
            ("model(x) device", ours_dev, base_dev),
            ("pyfunc.predict numpy", pyf_np, base_host),
        ):
            rows.append(
                {
                    "bench": what,
                    "batch": batch,
                    "ours_us": ours,
                    "base_us": base,
                    "ratio": ours / base,
                }
            )
    return rows


def _big_apply(p, x):
    for name in sorted(p):
        x = jnp.tanh(x @ p[name][: x.shape[1], :64].astype(x.dtype))
    return x


def bench_load(tmp: Path, gib: float, dtype: str, rounds: int) -> dict:
    """load_model of ``gib`` GiB of params against np.load + device_put of the same arrays."""
    dt = jnp.bfloat16 if dtype == "bfloat16" else np.float32
    side = 8192
    leaf_bytes = side * side * np.dtype(dt).itemsize
    n = max(1, int(gib * 1024**3 // leaf_bytes))
    rng = np.random.default_rng(0)
    params = {f"w{i:02d}": rng.random((side, side), np.float32).astype(dt) for i in range(n)}
    x = np.ones((2, 64), dt)
    path = tmp / f"big-{gib}-{dtype}"
    npy = tmp / f"npy-{gib}-{dtype}"
    npy.mkdir()
    for k, v in params.items():
        np.save(npy / f"{k}.npy", v.view(np.uint16) if dtype == "bfloat16" else v)
    mlflow.jaxexp.save_model(
        jax.jit(_big_apply), path, params=params, input_example=x, durable=False
    )
    del params
    gc.collect()

    def baseline() -> float:
        t0 = time.perf_counter()
        arrs = []
        for f in sorted(npy.glob("*.npy")):
            a = np.load(f)
            arrs.append(jax.device_put(a.view(dt) if dtype == "bfloat16" else a))
            del a
        jax.block_until_ready(arrs)
        s = time.perf_counter() - t0
        del arrs
        gc.collect()
        return s

    def ours() -> float:
        t0 = time.perf_counter()
        model = mlflow.jaxexp.load_model(str(path))
        jax.block_until_ready(model.params)
        s = time.perf_counter() - t0
        on = {d.platform for leaf in jax.tree.leaves(model.params) for d in leaf.devices()}
        assert on == {jax.devices()[0].platform}, on
        del model
        gc.collect()
        return s

    baseline(), ours()  # warm: page cache, allocator, imports
    base, mine = [], []
    for _ in range(rounds):
        base.append(baseline())
        mine.append(ours())
    b, m = statistics.median(base), statistics.median(mine)
    gbs = n * leaf_bytes / 1024**3
    return {
        "bench": f"load {gbs:.2f} GiB {dtype}",
        "ours_s": m,
        "base_s": b,
        "speed_vs_baseline": b / m,  # the goal: >= 0.8
        "ours_GiB_s": gbs / m,
        "base_GiB_s": gbs / b,
    }


def suite_rows(rows: list[dict]) -> list[dict]:
    """The measurements as run_all.py stores them: figure, ours, baseline, ratio, goal."""
    out = []
    for r in rows:
        if "ours_us" in r:
            pyfunc = r["bench"].startswith("pyfunc")
            out.append(
                {
                    "figure": f"{r['bench']}, batch {r['batch']} (µs)",
                    "value": round(r["ours_us"], 1),
                    "baseline_name": "jitted call + np.asarray"
                    if pyfunc
                    else "jax.jit(f)(params, x)",
                    "baseline": round(r["base_us"], 1),
                    "ratio": round(r["ratio"], 3),
                    "goal": "<= 1.3" if pyfunc else "<= 1.05",
                }
            )
        else:
            out.append(
                {
                    "figure": f"load_model, {r['bench'][5:]} into device memory (s; ratio: "
                    "speed, baseline time / ours)",
                    "value": round(r["ours_s"], 3),
                    "baseline_name": "np.load + jax.device_put",
                    "baseline": round(r["base_s"], 3),
                    "ratio": round(r["speed_vs_baseline"], 3),
                    "goal": ">= 0.8",
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="1,4", help="GiB of params to load, comma-separated")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    head = {
        "platform": running_platform(),
        "device_kind": device.device_kind,
        "jax": jax.__version__,
    }
    print(f"# {head}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows += bench_calls(tmp, args.quick)
        for row in rows:
            print(json.dumps(row), flush=True)
        for gib in [float(s) for s in args.sizes.split(",") if s]:
            for dtype in ("float32", "bfloat16"):
                row = bench_load(tmp, gib, dtype, rounds=2 if args.quick else 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        doc = {"device": head, "rows": suite_rows(rows), "measurements": rows}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
