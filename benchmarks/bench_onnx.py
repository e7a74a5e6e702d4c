"""The ONNX route beside ours: the same three models both ways, in one interleaved run.

The route a JAX user would most likely pick instead of this flavor: convert the function with
jax2onnx, log it with MLflow's built-in ``mlflow.onnx``, run it with onnxruntime. The models
(``onnx_models.py``: an MLP, a Flax NNX transformer encoder, a Flax NNX CNN) are built from the
same seed on both sides; jax2onnx runs in a venv of its own (its pins clash with ours: it wants
``orbax-checkpoint<0.11.37``), made once under ``~/.cache/jaxexp/bench-onnx-venv`` or named with
``--onnx-python``; onnxruntime and onnx must be importable here (``pip install onnxruntime
onnx``). The ONNX outputs are checked against the jitted function before anything is timed.

Ratios are ours / peer (below 1: ours faster), medians of interleaved rounds, with the load
average before and after:

The in-process rows run as the flavor runs a scoring server: CPU computations on the calling
thread (``--cpu-dispatch server``, the default; ``jax`` keeps jax's handoff to a worker thread).

* ``call``: in-process ``mlflow.jaxexp.load_model(path)(x)`` (numpy in and out) against
  ``InferenceSession.run``, batch 1 and 1024 (``--skip call`` also skips ``pyfunc``: the
  transformer's batch 1024 on XLA, onnxruntime and IREE in one process needed 10.8 GB);
* ``pyfunc``: ``mlflow.pyfunc.load_model(path).predict(x)`` of both models, batch 1 and 1024;
* ``first``: a fresh process to its first ``pyfunc`` prediction (warm caches: JAX's persistent
  compilation cache and the flavor's executable store, filled by an untimed child first);
  also less the time of the child's garbage-collector passes (``gc.callbacks``);
* ``ping``: ``mlflow models serve --env-manager local`` from spawn to the first ``/ping`` 200;
* ``iree``: ``load_model(path, backend="iree")(x)`` against ``InferenceSession.run`` (a model
  IREE refuses is listed with the refusal). The IREE model compiles per batch size (``main``
  specialized to static shapes, params bound into the module: docs/longevity.md), so each batch
  size is called once, untimed, before the rounds.

Each model runs in a process of its own (the conversion and the compilation cache shared):
measured in one process, an earlier model's state (onnxruntime's and IREE's worker threads, our
buckets and stores) slowed a later model's rows on both sides, e.g. the CNN's ``pyfunc`` at
batch 1 549 us after the MLP and the transformer against 165-174 us alone. ``--one-process``
keeps them in this one.

    python benchmarks/bench_onnx.py                 # 5 rounds
    python benchmarks/bench_onnx.py --quick         # 1 round, fewer calls
    python benchmarks/bench_onnx.py --models mlp --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import onnx_models  # noqa: E402

BATCHES = (1, 1024)
ONNX_VENV = Path.home() / ".cache" / "jaxexp" / "bench-onnx-venv"
JAX2ONNX = "jax2onnx==0.17.1"


def onnx_python(given: str | None) -> str:
    """A Python with jax2onnx, made once in its own venv unless given."""
    if given:
        return given
    py = ONNX_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(ONNX_VENV)], check=True)
        import flax
        import jax

        pins = [JAX2ONNX, f"jax=={jax.__version__}", f"flax=={flax.__version__}"]
        subprocess.run([str(py), "-m", "pip", "install", "-q", *pins], check=True)
    return str(py)


def convert(py: str, outdir: Path) -> None:
    subprocess.run([py, str(HERE / "onnx_models.py"), "convert", str(outdir)], check=True)


def save_both(name: str, root: Path, onnx_dir: Path) -> tuple[Path, Path]:
    """Our model directory and an ``mlflow.onnx`` one, for model ``name``."""
    import jax
    import mlflow.jaxexp
    import mlflow.onnx
    import numpy as np
    import onnx
    import onnxruntime as ort

    f, params = onnx_models.build(name)
    ours, peer = root / f"{name}-jaxexp", root / f"{name}-onnx"
    x = onnx_models.example(name, 4)
    mlflow.jaxexp.save_model(jax.jit(f), ours, params=params, input_example=x)
    mlflow.onnx.save_model(onnx.load(str(onnx_dir / f"{name}.onnx")), peer)
    sess = ort.InferenceSession(str(onnx_dir / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    want = np.asarray(jax.jit(f)(params, x))
    if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise SystemExit(f"{name}: the ONNX model differs from the jitted function")
    return ours, peer


def per_call(fn, x, target: float) -> float:
    """Mean seconds of a call of ``fn(x)``, over as many calls as fill about ``target`` s."""
    t = time.perf_counter()
    fn(x)  # warm: a first call of a shape may compile
    one = time.perf_counter() - t
    calls = max(1, min(2000, int(target / max(one, 1e-6))))
    t = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t) / calls


def steady(pairs: dict, xs: dict, rounds: int, target: float) -> dict:
    """Median per-call seconds of every ``(ours, peer)`` pair, rounds interleaved. Every pair
    is called once first, and what a first call leaves to the flavor's store thread (writing
    and proving the bucket's executable) is waited for: none of it runs inside a timing."""
    from jaxexp_mlflow.runtime import executables

    for k, (ours, peer) in pairs.items():
        ours(xs[k[-1]])
        peer(xs[k[-1]])
    executables.flush()
    times: dict = {k: ([], []) for k in pairs}
    for _ in range(rounds):
        for k, (ours, peer) in pairs.items():
            b = k[-1]
            times[k][0].append(per_call(ours, xs[b], target))
            times[k][1].append(per_call(peer, xs[b], target))
    return {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in times.items()}


CHILD = r"""
import gc, json, os, sys, time
t0 = float(os.environ["BENCH_T0"])
collecting = [0.0, 0.0]  # seconds in the collector's passes, start of the current one
def timed(phase, info):
    if phase == "start":
        collecting[1] = time.perf_counter()
    else:
        collecting[0] += time.perf_counter() - collecting[1]
gc.callbacks.append(timed)
import numpy as np
import mlflow.pyfunc
sys.path.insert(0, sys.argv[3])
model = mlflow.pyfunc.load_model(sys.argv[1])
x = np.load(sys.argv[2])
y = model.predict(x)
cpu = sum(os.times()[:2])
first = time.time() - t0
print("BENCH " + json.dumps({"first_s": first, "cpu_s": cpu, "less_gc_s": first - collecting[0]}))
"""


def first_prediction(path: Path, x_file: Path, env: dict) -> tuple[float, float, float]:
    """Wall and CPU seconds (user + system) of a fresh process to its first prediction, and
    the wall seconds less those its garbage collector's passes took: a full pass (~0.1 s after
    ``import mlflow``) falls in whichever route's allocations cross its threshold first."""
    from bench_cold_start import spawn

    got = spawn(CHILD, [str(path), str(x_file), str(HERE)], env)
    return got["first_s"], got["cpu_s"], got["less_gc_s"]


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo.extend(c for c, (parent, _) in stats.items() if parent == p)
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping_time(path: Path, env: dict, limit: float = 600.0) -> tuple[float, float]:
    """Seconds from spawning ``mlflow models serve`` to its first ``/ping`` 200, and the CPU
    seconds its processes had used by then (less sensitive to a loaded machine)."""
    port = free_port()
    mlflow = str(Path(sys.executable).parent / "mlflow")
    cmd = [mlflow, "models", "serve", "-m", str(path), "-p", str(port), "--env-manager", "local"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.time() - t0 < limit:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=1) as r:
                    if r.status == 200:
                        return time.time() - t0, tree_cpu(proc.pid)
            except OSError:
                time.sleep(0.05)
            if proc.poll() is not None:
                raise SystemExit(f"mlflow models serve -m {path} exited with {proc.returncode}")
        raise SystemExit(f"no /ping from {path} in {limit} s")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def row(rows: list, model: str, figure: str, ours: float, peer: float) -> None:
    """Record and print one figure, ours / peer."""
    ratio = ours / peer
    rows.append({"model": model, "figure": figure, "ours": ours, "peer": peer, "ratio": ratio})
    print(
        f"{model:12} {figure:34} ours {ours:10.6f} peer {peer:10.6f}  ratio {ratio:6.2f}",
        flush=True,
    )


def medians(rows: list, model: str, figure: str, ours: list, peer: list) -> None:
    """Rows for the median wall and CPU seconds of ``(wall, cpu)`` pairs, ours and peer (and
    of the wall seconds less the collector's, where a third figure is given)."""
    for i, unit in enumerate(("s", "CPU s", "s less GC")[: len(ours[0])]):
        mid = [statistics.median(x[i] for x in side) for side in (ours, peer)]
        row(rows, model, f"{figure} ({unit})", *mid)


def measure(
    name: str, tmp: Path, env: dict, rows: list, rounds: int, target: float, skip: set
) -> None:
    """Every figure of model ``name``, ours against the ONNX route."""
    import mlflow.jaxexp
    import mlflow.pyfunc
    import numpy as np
    import onnxruntime as ort

    ours_dir, peer_dir = save_both(name, tmp, tmp / "onnx")
    xs = {b: onnx_models.example(name, b) for b in BATCHES}
    model = mlflow.jaxexp.load_model(str(ours_dir))
    onnx_file = str(tmp / "onnx" / f"{name}.onnx")
    sess = ort.InferenceSession(onnx_file, providers=["CPUExecutionProvider"])
    feed = sess.get_inputs()[0].name
    ours_py = mlflow.pyfunc.load_model(str(ours_dir))
    peer_py = mlflow.pyfunc.load_model(str(peer_dir))

    def call(x):
        return np.asarray(model(x))

    def run(x):
        return sess.run(None, {feed: x})[0]

    if "call" not in skip:
        for b in BATCHES:  # the same answers before timing
            np.testing.assert_allclose(call(xs[b]), run(xs[b]), rtol=1e-3, atol=1e-4)
        pairs = {}
        for b in BATCHES:
            pairs[("call", b)] = (call, run)
            pairs[("pyfunc", b)] = (ours_py.predict, peer_py.predict)
        for (fig, b), (o, p) in steady(pairs, xs, rounds, target).items():
            row(rows, name, f"{fig} batch {b} (s/call)", o, p)
    if "iree" not in skip:
        try:
            iree = mlflow.jaxexp.load_model(str(ours_dir), backend="iree")
        except Exception as e:  # a refusal is a figure too
            why = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{name:12} iree: refused: {why}", flush=True)
            rows.append({"model": name, "figure": "iree", "refused": why})
        else:
            for b in BATCHES:  # the first call of a batch size compiles its module
                np.testing.assert_allclose(iree(xs[b]), run(xs[b]), rtol=1e-3, atol=1e-4)
            print(f"{name:12} iree: {type(iree).__name__}", flush=True)
            got = steady({("iree", b): (iree, run) for b in BATCHES}, xs, rounds, target)
            for (_, b), (o, p) in got.items():
                row(rows, name, f"iree batch {b} (s/call)", o, p)
    if "first" not in skip:
        x_file = tmp / f"{name}-x1.npy"
        np.save(x_file, xs[1])
        first_prediction(ours_dir, x_file, env)  # fill the caches, untimed
        first_prediction(peer_dir, x_file, env)
        a, b = [], []
        for _ in range(max(1, min(rounds, 3))):
            a.append(first_prediction(ours_dir, x_file, env))
            b.append(first_prediction(peer_dir, x_file, env))
        medians(rows, name, "fresh process -> first pyfunc", a, b)
    if "ping" not in skip:
        a, b = [], []
        for _ in range(max(1, min(rounds, 2))):
            a.append(ping_time(ours_dir, env))
            b.append(ping_time(peer_dir, env))
        medians(rows, name, "serve start -> /ping", a, b)


def keep_or_remove(tmp: Path, keep: bool) -> None:
    """Remove the run's working directory (40 MB or so a run), or say where it was kept."""
    if keep:
        print(f"kept {tmp}", flush=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def per_model(args: argparse.Namespace, names: list[str]) -> None:
    """Each model's figures in a fresh process of this script; the rows gathered into one."""
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-onnx-"))
    rows: list[dict] = []
    try:
        convert(onnx_python(args.onnx_python), tmp / "onnx")
        for name in names:
            out = tmp / f"{name}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--models", name]
            cmd += ["--rounds", str(args.rounds), "--skip", args.skip, "--json", str(out)]
            cmd += ["--cpu-dispatch", args.cpu_dispatch, "--workdir", str(tmp)]
            cmd += ["--quick"] if args.quick else []
            subprocess.run(cmd, check=True)
            rows += json.loads(out.read_text())["rows"]
    finally:
        keep_or_remove(tmp, args.keep)
    load1 = os.getloadavg()
    print(
        f"all models: load average before {load0[0]:.2f} after {load1[0]:.2f} (1 min); "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "loadavg": [load0[0], load1[0]]}, indent=1)
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=",".join(onnx_models.NAMES))
    ap.add_argument("--onnx-python", default=None, help="a Python with jax2onnx installed")
    ap.add_argument("--skip", default="", help="comma list of: call,first,ping,iree")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--cpu-dispatch",
        choices=("server", "jax"),
        default="server",
        help="in-process rows: 'server' runs CPU computations on the calling thread, as the "
        "flavor sets a scoring server (runtime/dispatch.py); 'jax': jax's default handoff",
    )
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="measure every model in this process (default: a process of its own for each)",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the working directory (models, ONNX files, caches); removed by default",
    )
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)  # a parent's, reused
    args = ap.parse_args()
    names = args.models.split(",")
    if len(names) > 1 and not args.one_process:
        per_model(args, names)
        return
    if args.cpu_dispatch == "server":  # before anything makes jax's CPU client
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)
    print(f"in-process CPU dispatch: {args.cpu_dispatch}", flush=True)
    rounds = 1 if args.quick else args.rounds
    target = 0.2 if args.quick else 1.0  # seconds of calls per measurement
    skip = set(filter(None, args.skip.split(",")))

    from bench_cold_start import compile_package

    print(compile_package(), flush=True)  # as bench_cold_start: an installed wheel has bytecode
    load0 = os.getloadavg()
    if args.workdir:  # a parent made the ONNX files and owns the caches
        tmp = Path(args.workdir)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="bench-onnx-"))
        convert(onnx_python(args.onnx_python), tmp / "onnx")
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
        "JAX_PLATFORMS": "cpu",
        "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p
        ),
    }
    os.environ["JAX_COMPILATION_CACHE_DIR"] = env["JAX_COMPILATION_CACHE_DIR"]
    rows: list[dict] = []

    try:
        for name in names:
            measure(name, tmp, env, rows, rounds, target, skip)
    finally:
        if not args.workdir:  # a parent's is the parent's to remove
            keep_or_remove(tmp, args.keep)

    load1 = os.getloadavg()
    print(
        f"load average before {load0[0]:.2f} after {load1[0]:.2f} (1 min); {os.cpu_count()} cores",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "loadavg": [load0[0], load1[0]]}, indent=1)
        )


if __name__ == "__main__":
    main()
