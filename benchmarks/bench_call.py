"""Call overhead of a loaded jaxexp model against the raw jitted function, same run.

Compares, at batch 1 and 1024, ``model(x)`` (a ``JaxExpModel`` loaded from disk), a bare
``Exported.call`` outside jit, and the baseline ``jax.jit(f)(params, x)``. Goal: model/jit <= 1.1.

    python benchmarks/bench_call.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.export
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlflow  # noqa: E402

import jaxexp_mlflow  # noqa: E402, F401


def apply(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def timed_us(fn, x, number: int, rounds: int) -> float:
    """Best-of-rounds mean per call (µs), blocking on the result."""
    jax.block_until_ready(fn(x))
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(number):
            jax.block_until_ready(fn(x))
        best.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(best)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    number, rounds = (200, 3) if args.quick else (2000, 7)
    k = jax.random.split(jax.random.key(0), 2)
    params = {
        "w1": jax.random.normal(k[0], (256, 512)),
        "b1": jnp.zeros(512),
        "w2": jax.random.normal(k[1], (512, 10)),
        "b2": jnp.zeros(10),
    }
    with tempfile.TemporaryDirectory() as d:
        mlflow.jaxexp.save_model(
            jax.jit(apply), Path(d, "m"), params=params, input_example=np.ones((4, 256), "f4")
        )
        model = mlflow.jaxexp.load_model(str(Path(d, "m")))
    jitted = jax.jit(apply)
    rows = []
    for n in (1, 1024):
        x = jnp.ones((n, 256), jnp.float32)
        base = timed_us(lambda x: jitted(params, x), x, number // (1 if n == 1 else 10), rounds)
        for label, fn in (
            ("JaxExpModel(x)", model),
            ("bare Exported.call outside jit", lambda x: model.exported.call(model.params, x)),
        ):
            v = timed_us(fn, x, number // (1 if n == 1 else 10), rounds)
            rows.append(
                {
                    "figure": f"{label}, batch {n} (µs)",
                    "value": round(v, 1),
                    "baseline_name": "jax.jit(f)(params, x)",
                    "baseline": round(base, 1),
                    "ratio": round(v / base, 3),
                    "goal": "<= 1.1" if label.startswith("JaxExpModel") else "(reference)",
                }
            )
    w = max(len(r["figure"]) for r in rows)
    for r in rows:
        print(
            f"{r['figure']:<{w}} {r['value']:>9} vs {r['baseline']:>9}  {r['ratio']:>5}x  "
            f"goal {r['goal']}"
        )
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "call", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
