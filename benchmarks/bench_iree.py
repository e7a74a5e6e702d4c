"""IREE backend beside the JAX path: fresh process to first prediction, and steady-state calls.

One model (an MLP with params, saved by ``mlflow.jaxexp.save_model``), measured in the same run:

* **fresh process to first prediction**, timed by the parent from spawn to the child's report,
  each child a new interpreter with warm caches (the ``.vmfb`` cache for IREE, JAX's persistent
  compilation cache for JAX; both filled by an untimed run first):
  - ``iree``: ``jaxexp_mlflow.iree.loader.load_directory`` + ``model(x)``; the child checks that
    neither jax nor the IREE compiler was imported (the precompiled module from the cache, the
    IREE runtime only);
  - ``jax``: ``mlflow.jaxexp.load_model`` + ``model(x)`` (the baseline).
* **steady-state call** at batch 1 and 1024 in this process: ``IreeModel(x)`` (both IREE CPU
  drivers; each as compiled by default: one module per batch size with the params bound,
  speed flags; ``one-module``, ``JAXEXP_IREE_STATIC=0``: one dynamic ``main`` with the batch-1
  function; ``base``, also ``JAXEXP_IREE_SPEED=0``: base flags, ``main`` only) vs
  ``jax.jit(exported.call)`` on the same function and params (XLA, the baseline of the
  ratios) and ``JaxExpModel(x)``, numpy in and out for all, interleaved rounds, median of the
  per-call times. The load average (``os.getloadavg()``) before and after is printed beside
  them: on a busy machine only the ratios of one run mean anything.

    python benchmarks/bench_iree.py             # 5 rounds
    python benchmarks/bench_iree.py --quick     # 1 round, seconds
    python benchmarks/bench_iree.py --json out.json
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

from bench_cold_start import build_model, spawn  # the same MLP, the same child runner

DRIVERS = ("local-task", "local-sync")  # IREE's thread-pool and calling-thread CPU drivers
SETTINGS = {
    "default": {},  # per batch size, params bound, speed flags
    "one-module": {"JAXEXP_IREE_STATIC": "0"},  # one dynamic main + the batch-1 function
    "base": {"JAXEXP_IREE_STATIC": "0", "JAXEXP_IREE_SPEED": "0"},  # base flags, main only
}

CHILD = r"""
import json, os, sys, time
backend, path = sys.argv[1], sys.argv[2]
import numpy as np
x = np.load(os.path.join(path, "x.npy"))[:1]
t0 = time.time()
if backend == "iree":
    from jaxexp_mlflow.iree.loader import load_directory  # imports mlflow (errors' base class)
    import yaml
    t = time.time()
    with open(os.path.join(path, "model", "MLmodel")) as f:
        meta = yaml.safe_load(f)["flavors"]["jaxexp"]
    model = load_directory(os.path.join(path, "model"), meta)
else:
    import mlflow
    t = time.time()
    model = mlflow.jaxexp.load_model(os.path.join(path, "model"))  # imports jax
t_loaded = time.time()
y = np.asarray(model(x))
t_first = time.time()
print("BENCH " + json.dumps({
    "imports_s": t - t0, "load_s": t_loaded - t, "first_call_s": t_first - t_loaded,
    "checksum": float(np.abs(y).sum()),
    "jax_imported": "jax" in sys.modules, "compiler_imported": "iree.compiler" in sys.modules,
}))
"""


def run_child(backend: str, work: Path, env: dict) -> dict:
    return spawn(CHILD, [backend, str(work)], env)


def per_call(fn, x, n: int) -> float:
    import numpy as np

    np.asarray(fn(x))  # warm (compiles the JAX path for this shape)
    t = time.perf_counter()
    for _ in range(n):
        np.asarray(fn(x))
    return (time.perf_counter() - t) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round, a smaller model")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    depth = args.depth or (4 if args.quick else 12)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model(work, depth, args.width)
        env = {
            **os.environ,
            "JAXEXP_IREE_CACHE": str(work / "iree-cache"),
            "JAXEXP_COMPILATION_CACHE": str(work / "xla-cache"),
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        }
        env.pop("XLA_FLAGS", None)
        for backend in ("iree", "jax"):  # fill both caches, untimed
            run_child(backend, work, env)
        fresh: dict[str, list[dict]] = {"iree": [], "jax": []}
        for _ in range(rounds):  # interleaved
            for backend in ("iree", "jax"):
                fresh[backend].append(run_child(backend, work, env))

        os.environ["JAXEXP_IREE_CACHE"] = env["JAXEXP_IREE_CACHE"]
        import mlflow
        import numpy as np
        import yaml

        from jaxexp_mlflow.iree.loader import load_directory

        path = work / "model"
        meta = yaml.safe_load((path / "MLmodel").read_text())["flavors"]["jaxexp"]
        iree_models = {}
        for setting, variables in SETTINGS.items():
            os.environ.update(variables)
            for d in DRIVERS:
                iree_models[f"{d} {setting}"] = load_directory(path, meta, iree_driver=d)
            for name in variables:
                os.environ.pop(name)
        jax_model = mlflow.jaxexp.load_model(str(path))
        jit_model = plain_jit(work)
        x1 = np.load(work / "x.npy")[:1]
        rng = np.random.default_rng(0)
        steady: dict[str, list[float]] = {}
        load = [os.getloadavg()]
        for _ in range(rounds):
            for batch, n in ((1, 300 if args.quick else 2000), (1024, 5 if args.quick else 50)):
                x = x1 if batch == 1 else rng.standard_normal((batch, args.width), np.float32)
                models = (*iree_models.items(), ("jit", jit_model), ("jax", jax_model))
                for name, model in models:
                    steady.setdefault(f"{name}/{batch}", []).append(per_call(model, x, n))
        load.append(os.getloadavg())
        agree = max(
            float(np.abs(np.asarray(m(x1)) - np.asarray(jit_model(x1))).max())
            for m in (*iree_models.values(), jax_model)
        )

    med = {k: statistics.median(v) for k, v in steady.items()}
    proc = {b: statistics.median(r["process_s"] for r in rs) for b, rs in fresh.items()}
    first = {
        b: statistics.median(r["load_s"] + r["first_call_s"] for r in rs) for b, rs in fresh.items()
    }
    imports = {b: statistics.median(r["imports_s"] for r in rs) for b, rs in fresh.items()}

    clean = all(not r["jax_imported"] and not r["compiler_imported"] for r in fresh["iree"])
    rows = [
        _row("fresh process to first prediction, IREE, precompiled (s)", proc["iree"],
             "JAX path, warm compilation cache", proc["jax"], "< 1"),
        _row("imports first (jaxexp_mlflow.iree pulls mlflow) (s)", imports["iree"],
             "mlflow (JAX path)", imports["jax"], "(reported)"),
        _row("then load + first call, IREE (s)", first["iree"],
             "JAX path (imports jax)", first["jax"], "< 1"),
    ]  # fmt: skip
    for batch, unit, scale in ((1, "us", 1e6), (1024, "ms", 1e3)):
        for name in iree_models:
            rows.append(
                _row(f"steady-state call, batch {batch}, IREE {name} ({unit})",
                     med[f"{name}/{batch}"] * scale, "jax.jit(exported.call), XLA",
                     med[f"jit/{batch}"] * scale, "< 2" if "default" in name else "(before)")
            )  # fmt: skip
        rows.append(
            _row(f"steady-state call, batch {batch}, JaxExpModel ({unit})",
                 med[f"jax/{batch}"] * scale, "jax.jit(exported.call), XLA",
                 med[f"jit/{batch}"] * scale, "(reported)")
        )  # fmt: skip
    print(f"IREE vs JAX, MLP depth {depth} width {args.width}, {rounds} round(s), median")
    print(f"{'figure':58s} {'value':>10s} {'baseline':>10s} {'ratio':>7s}")
    for r in rows:
        print(
            f"{r['figure']:58s} {r['value']:10.3f} {r['baseline']:10.3f} "
            f"{r['ratio']:7.3f}  ({r['baseline_name']}; goal {r['goal']})"
        )
    print(
        "load average (1, 5, 15 min) before / after the steady-state calls: "
        + " / ".join(", ".join(f"{v:.2f}" for v in la) for la in load)
        + f" on {os.cpu_count()} CPUs"
    )
    print(f"IREE child imported neither jax nor the IREE compiler: {clean}")
    print(f"max |IREE or JaxExpModel - jax.jit| on the batch-1 input: {agree:.3g}")
    if args.json:
        result = {"rows": rows, "fresh": fresh, "steady": steady, "clean": clean}
        result.update(agree=agree, loadavg=load, cpus=os.cpu_count())
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def plain_jit(work: Path):
    """``jax.jit(exported.call)`` on the peer's export of the same function (params as device
    arrays, bound once): XLA with nothing of the flavor around it."""
    import jax
    import numpy as np

    exp = jax.export.deserialize(bytearray((work / "peer.bin").read_bytes()))
    with np.load(work / "params.npz") as f:
        flat = [f[f"p_{i}"] for i in range(len(f.files))]
    params = jax.device_put(jax.tree.unflatten(exp.in_tree.children()[0].children()[0], flat))
    call = jax.jit(exp.call)
    return lambda x: call(params, x)


def _row(figure: str, value: float, base_name: str, base: float, goal: str) -> dict:
    return {
        "figure": figure,
        "value": round(value, 3),
        "baseline_name": base_name,
        "baseline": round(base, 3),
        "ratio": round(value / base, 3),
        "goal": goal,
    }


if __name__ == "__main__":
    sys.exit(main())
