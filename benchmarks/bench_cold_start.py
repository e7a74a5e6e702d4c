"""Cold start: a fresh process, from interpreter start to the first prediction.

Each measurement is a new Python process (so every import, the backend start-up and the
compilation are paid again), timed by the parent from spawn to the child's report, and split by
the child into phases: imports, load (model files to a callable), first call (compile + run) and
a second call (run only). Four ways to get a first prediction from the same exported MLP, two
direct:

* ``raw``: the baseline, plain JAX: ``jax.export.deserialize`` the blob, read params from npz,
  ``jax.jit(exported.call)``;
* ``flavor``: ``mlflow.jaxexp.load_model(path)`` then ``model(x)`` (checksum, verdict, Orbax
  params, placement included).

and, through MLflow, ``mlflow.pyfunc.load_model(path).predict(x)``:

* ``pyfunc``: the flavor's pyfunc (its first predict of a bucket found in the executable store
  of ``runtime/cache.py`` runs without lowering);
* ``peer``: a hand-written ``PythonModel`` (models from code) around ``jax.jit(exp.call)`` and
  ``ocp.StandardCheckpointer().restore`` (``PEER_SOURCE``);

Before timing, the jaxexp_mlflow package is byte-compiled in place (``compileall``), which is what
``pip install`` of its wheel does (even under ``PYTHONDONTWRITEBYTECODE=1``): an editable install
under that variable, as in this repository's venvs, otherwise compiles ~50 modules from source in
every child (~60 ms), a cost no installed package pays; jax, MLflow and Orbax came with bytecode.

Each variant runs with a *cold* persistent compilation cache (a new empty
``JAX_COMPILATION_CACHE_DIR``) and a *warm* one (the same directory filled by an untimed run
before). Ratios printed: warm/cold of the load-to-first-call time and of the whole process, and
flavor/raw for each. The child also checks that ``import jaxexp_mlflow`` loads neither jax nor
mlflow (nothing heavy at import time).

    python benchmarks/bench_cold_start.py                # 5 rounds
    python benchmarks/bench_cold_start.py --quick        # 1 round, seconds
    python benchmarks/bench_cold_start.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("raw", "flavor", "peer", "pyfunc")

CHILD = r"""
import json, os, sys, time
t0 = float(os.environ["BENCH_T0"])
mode, path = sys.argv[1], sys.argv[2]
out = {}
if mode in ("pyfunc", "peer"):  # what a user runs: mlflow.pyfunc.load_model(uri).predict(x)
    import mlflow.pyfunc
    import numpy as np
    t_imports = time.time()
    x = np.load(os.path.join(path, "x.npy"))
    model = mlflow.pyfunc.load_model(os.path.join(path, "model" if mode == "pyfunc" else "peer"))
    t_loaded = time.time()
    y = np.asarray(model.predict(x))
    t_first = time.time()
    y2 = np.asarray(model.predict(x))
    t_second = time.time()
    out.update(
        imports_s=t_imports - t0,
        load_s=t_loaded - t_imports,
        first_call_s=t_first - t_loaded,
        second_call_s=t_second - t_first,
        load_to_first_s=t_first - t_imports,
        to_first_s=t_first - t0,
        checksum=float(np.abs(y).sum()),
        jaxexp_import_s=0.0,
        jaxexp_import_loads=[],
    )
    print("BENCH " + json.dumps(out))
    sys.exit(0)
t = time.time()
import jaxexp_mlflow
out["jaxexp_import_s"] = time.time() - t
out["jaxexp_import_loads"] = sorted(m for m in ("jax", "mlflow", "orbax") if m in sys.modules)
import numpy as np
if mode == "flavor":
    import mlflow
import jax
t_imports = time.time()
x = np.load(os.path.join(path, "x.npy"))
if mode == "raw":
    with open(os.path.join(path, "model", "exported.bin"), "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    with np.load(os.path.join(path, "params.npz")) as f:
        flat = [f[f"p_{i}"] for i in range(len(f.files))]
    fn = jax.jit(exp.call)
    call = lambda x: fn(*jax.tree.unflatten(exp.in_tree, flat + [x])[0])
else:
    model = mlflow.jaxexp.load_model(os.path.join(path, "model"))
    call = model
t_loaded = time.time()
y = np.asarray(call(x))
t_first = time.time()
y2 = np.asarray(call(x))
t_second = time.time()
out.update(
    imports_s=t_imports - t0,
    load_s=t_loaded - t_imports,
    first_call_s=t_first - t_loaded,
    second_call_s=t_second - t_first,
    load_to_first_s=t_first - t_imports,
    to_first_s=t_first - t0,
    checksum=float(np.abs(y).sum()),
)
print("BENCH " + json.dumps(out))
"""

PEER_SOURCE = """
import mlflow
import numpy as np


class Peer(mlflow.pyfunc.PythonModel):
    \"\"\"What a user writes without jaxexp-mlflow: deserialize, Orbax restore, jit, predict.\"\"\"

    def load_context(self, context):
        import jax
        import orbax.checkpoint as ocp

        with open(context.artifacts["blob"], "rb") as fh:
            exp = jax.export.deserialize(bytearray(fh.read()))
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.in_avals]
        target = jax.tree.unflatten(exp.in_tree, avals)[0][0]  # the params argument
        self.params = ocp.StandardCheckpointer().restore(context.artifacts["params"], target)
        self.fn = jax.jit(exp.call)

    def predict(self, context, model_input, params=None):
        x = np.asarray(model_input, dtype=np.float32)
        return np.asarray(self.fn(self.params, x))


mlflow.models.set_model(Peer())
"""


def save_peer(directory: Path, params: list) -> None:
    """The peer: an MLflow ``PythonModel`` (models from code) around ``jax.jit(exp.call)`` with
    the same blob as the flavor's model and the same params in an Orbax checkpoint."""
    import mlflow
    import orbax.checkpoint as ocp

    ckpt = directory / "peer_params"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(ckpt.absolute(), params)
    checkpointer.wait_until_finished()
    (directory / "peer_model.py").write_text(PEER_SOURCE)
    mlflow.pyfunc.save_model(
        directory / "peer",
        python_model=str(directory / "peer_model.py"),
        artifacts={"blob": str(directory / "peer.bin"), "params": str(ckpt)},
        pip_requirements=["mlflow", "jax", "orbax-checkpoint"],
    )


def build_model(directory: Path, depth: int, width: int) -> None:
    """An exported MLP of ``depth`` layers (deep enough that compilation is visible)."""
    import jax
    import jax.numpy as jnp
    import mlflow  # noqa: F401
    import numpy as np

    import jaxexp_mlflow  # noqa: F401

    keys = jax.random.split(jax.random.key(0), depth)
    params = [
        {
            "w": jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width),
            "b": jnp.zeros((width,), jnp.float32),
        }
        for k in keys
    ]

    def apply(params, x):
        for i, layer in enumerate(params):
            x = x @ layer["w"] + layer["b"]
            x = jnp.tanh(x) if i % 2 else jax.nn.gelu(x)
            x = x / (1.0 + jnp.linalg.norm(x, axis=-1, keepdims=True))
        return jax.nn.log_softmax(x)

    x = np.asarray(jax.random.normal(jax.random.key(1), (32, width)), np.float32)
    mlflow.jaxexp.save_model(jax.jit(apply), directory / "model", params=params, input_example=x)
    np.save(directory / "x.npy", x)
    flat = jax.tree.leaves(params)
    np.savez(directory / "params.npz", **{f"p_{i}": np.asarray(a) for i, a in enumerate(flat)})
    # the peer exports the same function itself (symbolic batch, like the flavor's export)
    spec = jax.export.symbolic_shape(f"b, {width}")
    exp = jax.export.export(jax.jit(apply))(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
        jax.ShapeDtypeStruct(spec, np.float32),
    )
    (directory / "peer.bin").write_bytes(exp.serialize())
    save_peer(directory, params)


def compile_package() -> str:
    """Byte-compile jaxexp_mlflow in place, as ``pip install`` of the wheel does; what was done."""
    import compileall

    import jaxexp_mlflow

    root = Path(jaxexp_mlflow.__file__).parent
    if not compileall.compile_dir(root, quiet=1):
        raise SystemExit(f"compileall failed for {root}")
    return f"byte-compiled in place like a pip install ({root})"


def spawn(code: str, args: list[str], env: dict) -> dict:
    """Run ``code`` in a fresh interpreter; its last ``BENCH <json>`` line plus ``process_s``,
    the wall time from spawn to exit (``BENCH_T0`` in the child's env is the spawn time)."""
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**env, "BENCH_T0": repr(t0)},
        check=False,
    )
    wall = time.time() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"child failed ({' '.join(args)}):\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][6:])
    res["process_s"] = wall
    return res


def run_child(mode: str, model_dir: Path, cache_dir: Path) -> dict:
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_PLATFORMS": "cpu",
    }
    env.pop("XLA_FLAGS", None)
    res = spawn(CHILD, [mode, str(model_dir)], env)
    res["loadavg_1min"] = os.getloadavg()[0]
    res["cache_files"] = sum(1 for _ in cache_dir.rglob("*") if _.is_file())
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round, a smaller model")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--depth", type=int, default=None, help="MLP layers (compile cost)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated subset of {','.join(MODES)} (default: all)",
    )
    args = ap.parse_args(argv)
    modes = [m for m in MODES if m in args.modes.split(",")]
    rounds = args.rounds or (1 if args.quick else 5)
    depth = args.depth or (8 if args.quick else 24)

    bytecode = compile_package()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "m"
        model_dir.mkdir()
        build_model(model_dir, depth, args.width)
        results: dict[str, list[dict]] = {}
        warm_dirs = {}
        for mode in modes:  # fill one warm cache per mode, untimed
            warm_dirs[mode] = tmp / f"warm-{mode}"
            run_child(mode, model_dir, warm_dirs[mode])
        for r in range(rounds):  # interleave so that drift hits every variant alike
            for mode in modes:
                cold = run_child(mode, model_dir, tmp / f"cold-{mode}-{r}")
                warm = run_child(mode, model_dir, warm_dirs[mode])
                results.setdefault(f"{mode}/cold", []).append(cold)
                results.setdefault(f"{mode}/warm", []).append(warm)

    def med(key: str, field: str) -> float:
        return statistics.median(x[field] for x in results[key])

    fields = (
        "to_first_s",
        "process_s",
        "imports_s",
        "load_s",
        "first_call_s",
        "second_call_s",
        "load_to_first_s",
    )
    summary = {k: {f: med(k, f) for f in fields} for k in results}
    for k in summary:
        summary[k]["loadavg_1min"] = med(k, "loadavg_1min")
    check = {round(x["checksum"], 2) for v in results.values() for x in v}

    def ratio(a: str, b: str, field: str) -> float | None:
        if a in summary and b in summary:
            return summary[a][field] / summary[b][field]
        return None

    def paired(a: str, b: str, field: str) -> float | None:
        """The median of each round's ratio (a/b)."""
        if a not in results or b not in results:
            return None
        pairs = zip(results[a], results[b], strict=True)
        return statistics.median(x[field] / y[field] for x, y in pairs)

    ratios = {
        "pyfunc/peer to_first cold": ratio("pyfunc/cold", "peer/cold", "to_first_s"),
        "pyfunc/peer to_first warm": ratio("pyfunc/warm", "peer/warm", "to_first_s"),
        "pyfunc/peer load_to_first cold": ratio("pyfunc/cold", "peer/cold", "load_to_first_s"),
        "pyfunc/peer load_to_first warm": ratio("pyfunc/warm", "peer/warm", "load_to_first_s"),
        # paired: both ran in the same round, a few seconds apart, so slow drift cancels
        "pyfunc/peer to_first cold, rounds": paired("pyfunc/cold", "peer/cold", "to_first_s"),
        "pyfunc/peer to_first warm, rounds": paired("pyfunc/warm", "peer/warm", "to_first_s"),
    }
    if "flavor" not in modes or "raw" not in modes:
        ratios = {k: v for k, v in ratios.items() if v is not None}
    else:
        ratios.update(
            {
                "flavor warm/cold load_to_first": summary["flavor/warm"]["load_to_first_s"]
                / summary["flavor/cold"]["load_to_first_s"],
                "flavor warm/cold process": summary["flavor/warm"]["process_s"]
                / summary["flavor/cold"]["process_s"],
                "raw warm/cold load_to_first": summary["raw/warm"]["load_to_first_s"]
                / summary["raw/cold"]["load_to_first_s"],
                "flavor/raw load_to_first cold": summary["flavor/cold"]["load_to_first_s"]
                / summary["raw/cold"]["load_to_first_s"],
                "flavor/raw load_to_first warm": summary["flavor/warm"]["load_to_first_s"]
                / summary["raw/warm"]["load_to_first_s"],
                "flavor/raw process warm": summary["flavor/warm"]["process_s"]
                / summary["raw/warm"]["process_s"],
            }
        )
    ratios = {k: v for k, v in ratios.items() if v is not None}
    first = results.get("flavor/cold", results[next(iter(results))])[0]
    print(
        f"cold start, {rounds} round(s), MLP depth {depth} width {args.width}, "
        f"python {platform.python_version()}, {os.cpu_count()} cpus (median seconds)"
    )
    print(f"{'variant':14s}" + "".join(f"{f:>16s}" for f in (*fields, "loadavg_1min")))
    for k, row in summary.items():
        print(f"{k:14s}" + "".join(f"{row[f]:16.3f}" for f in (*fields, "loadavg_1min")))
    for name, value in ratios.items():
        print(f"ratio {name:36s} {value:6.3f}")
    print(
        f"import jaxexp_mlflow: {first['jaxexp_import_s'] * 1e3:.1f} ms, loads "
        f"{first['jaxexp_import_loads'] or 'neither jax nor mlflow'}"
    )
    print(f"jaxexp_mlflow: {bytecode}")
    if len(check) != 1:
        print(f"WARNING: the variants disagree on the output checksum: {sorted(check)}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rounds": rounds,
                    "depth": depth,
                    "width": args.width,
                    "summary": summary,
                    "ratios": ratios,
                    "rows": summary_rows(summary),
                    "jaxexp_import_s": first["jaxexp_import_s"],
                    "jaxexp_import_loads": first["jaxexp_import_loads"],
                    "bytecode": bytecode,
                    "raw": results,
                },
                indent=1,
            )
        )
    return 0


def summary_rows(summary: dict) -> list[dict]:
    """The figure/baseline/ratio/goal rows the suite runner (run_all.py) prints."""

    def row(figure: str, key: str, base_name: str, base: str, field: str, goal: str) -> dict:
        value, baseline = summary[key][field], summary[base][field]
        return {
            "figure": figure,
            "value": round(value, 3),
            "baseline_name": base_name,
            "baseline": round(baseline, 3),
            "ratio": round(value / baseline, 3),
            "goal": goal,
            "loadavg_1min": round(summary[key]["loadavg_1min"], 2),
        }

    rows = []
    if "pyfunc/cold" in summary and "peer/cold" in summary:
        for cache in ("warm", "cold"):
            rows.append(
                row(
                    f"fresh process to first mlflow.pyfunc predict, {cache} compilation cache (s)",
                    f"pyfunc/{cache}",
                    "peer PythonModel (jax.jit(exp.call) + Orbax restore), same cache state",
                    f"peer/{cache}",
                    "to_first_s",
                    "<= 0.9",
                )
            )
    if "flavor/cold" not in summary or "raw/cold" not in summary:
        return rows
    return rows + [
        row(
            "flavor load -> first prediction, warm compilation cache (s)",
            "flavor/warm",
            "same, cold cache",
            "flavor/cold",
            "load_to_first_s",
            "< 1 (the cache helps)",
        ),
        row(
            "flavor load -> first prediction, cold cache (s)",
            "flavor/cold",
            "raw jax: deserialize + jit + first call, cold",
            "raw/cold",
            "load_to_first_s",
            "(reference)",
        ),
        row(
            "fresh process to first prediction, flavor, warm cache (s)",
            "flavor/warm",
            "raw jax process, warm cache",
            "raw/warm",
            "process_s",
            "(imports: mlflow ~1-2 s)",
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
