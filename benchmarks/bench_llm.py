"""An LLM end to end: examples/llm.py's ``generate``, archived and loaded,
against the raw JAX path on the same params, measured in the same run.

Figures (medians of interleaved rounds; the load average is printed with them):

* tokens/s of ``mlflow.jaxexp.load_model(path)(ids)`` vs the raw ``jax.jit(generate)`` on the
  same params (goal >= 0.97);
* a fresh process to its generated tokens (imports, load, compile, call: one ``generate`` call
  returns every new token, the first with the others) through ``load_model`` vs the raw path:
  Orbax restore + ``jax.export.deserialize`` + call (goal <= 1.1); persistent compilation
  caches off in both, so each compiles;
* ``log_model`` (export, params, reference run, read-back) vs the raw path: ``jax.export`` +
  serialize + ``write`` + ``fsync`` of every param (goal >= 0.8 of the raw throughput), each
  round with an empty compilation cache (a first log);
  ``load_model`` vs ``readinto`` of those files (goal >= 0.8);
* peak RSS added by ``log_model`` (in this process, the peak reset through
  ``/proc/self/clear_refs`` before it) and by a fresh process' load (VmHWM after the load minus
  VmRSS before it), each over the params' bytes (goal <= 1.25), with the raw paths' beside.

    python benchmarks/bench_llm.py                 # the 1b config (~1.03e9 params, 2 GB bf16)
    python benchmarks/bench_llm.py --quick         # the tiny config, seconds
    python benchmarks/bench_llm.py --json out.json --rounds 3 --new-tokens 8
"""

from __future__ import annotations

import argparse
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
from bench_params import pretouch
from report import print_rows, write_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

CHILD = r"""
import json, os, sys, time
t0 = float(os.environ["BENCH_T0"])
mode, path, n_new = sys.argv[1], sys.argv[2], int(sys.argv[3])

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

import numpy as np
import jax
if mode == "flavor":
    import mlflow, jaxexp_mlflow  # noqa: F401  (mlflow first: a PYTHONPATH-only package)
else:
    import orbax.checkpoint as ocp
ids = np.load(os.path.join(path, "prompt.npy"))
jax.block_until_ready(jax.numpy.zeros(1))  # the backend up: its memory is no load's
before = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")
t_load = time.time()
if mode == "flavor":
    model = mlflow.jaxexp.load_model(os.path.join(path, "model"))
    call = model
else:
    params = ocp.StandardCheckpointer().restore(os.path.join(path, "raw", "params"))
    with open(os.path.join(path, "raw", "exported.bin"), "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    call = jax.jit(exp.call)
t_loaded = time.time()
peak = rss("VmHWM:")
out = np.asarray(call(ids) if mode == "flavor" else call(params, ids))
t_done = time.time()
print(json.dumps({"total": t_done - t0, "start": t_load - t0, "load": t_loaded - t_load,
                  "call": t_done - t_loaded,
                  "load_peak": peak - before, "tokens": out.tolist()}))
"""


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """VmHWM back to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def raw_save(fn, params, ids, directory: Path) -> None:
    """The baseline of a save: export + serialize + write+fsync of each param."""
    import jax

    directory.mkdir(parents=True)
    exp = jax.export.export(fn)(params, jax.ShapeDtypeStruct(ids.shape, ids.dtype))
    (directory / "exported.bin").write_bytes(exp.serialize())
    for i, a in enumerate(jax.tree.leaves(params)):
        with open(directory / f"{i}.bin", "wb", buffering=0) as f:
            f.write(memoryview(np.asarray(a).reshape(-1).view(np.uint8)))
            os.fsync(f.fileno())


def raw_read(params, directory: Path) -> list:
    """The baseline of a load: each param's file read into a buffer of its own, all held at
    the end as a load holds them (a loop that dropped each buffer before reading the next would
    read 2 GiB through the same few recycled pages: not a load)."""
    import jax

    bufs = []
    for i, a in enumerate(jax.tree.leaves(params)):
        buf = np.empty(a.nbytes, np.uint8)
        with open(directory / f"{i}.bin", "rb", buffering=0) as f:
            f.readinto(memoryview(buf))
        bufs.append(buf)
    return bufs


def child(mode: str, path: Path, n_new: int) -> dict:
    env = {**os.environ, "BENCH_T0": repr(time.time()), "JAXEXP_COMPILATION_CACHE": "0"}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env["PYTHONPATH"] = f"{REPO}:{env.get('PYTHONPATH', '')}"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(path), str(n_new)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if done.returncode:
        raise RuntimeError(f"{mode} child failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(figure: str, value: float, base: float, base_name: str, goal: str, **extra) -> dict:
    return {
        "figure": figure,
        "value": round(value, 4),
        "baseline_name": base_name,
        "baseline": round(base, 4),
        "ratio": round(value / base, 3) if base else float("nan"),
        "goal": goal,
        **extra,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny config, 2 rounds")
    parser.add_argument("--size", default=None, help="a config of examples/llm.py (default 1b)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--log-rounds", type=int, default=None, help="default: --rounds")
    parser.add_argument("--gen-rounds", type=int, default=None, help="default: 3 x --rounds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    size = args.size or ("tiny" if args.quick else "1b")
    rounds = args.rounds or (2 if args.quick else 3)

    import functools

    import jax
    import llm
    import mlflow
    import orbax.checkpoint as ocp

    import jaxexp_mlflow  # noqa: F401
    from jaxexp_mlflow.flavors import readback

    cfg = llm.CONFIGS[size]
    print(f"load average {load_average()} at start; {size}: {cfg.n_params() / 1e6:.0f}M params")
    params = jax.block_until_ready(llm.init_params(cfg, jax.random.key(0)))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
    ids = llm.prompt(cfg, batch=args.batch, length=args.prompt_len)
    fn = jax.jit(functools.partial(llm.generate, max_new_tokens=args.new_tokens))
    work = Path(tempfile.mkdtemp(prefix="bench-llm-", dir=os.environ.get("BENCH_DIR")))
    times: dict[str, list[float]] = {}

    def rec(name: str, dt: float) -> None:
        times.setdefault(name, []).append(dt)

    try:
        # -- log / save vs the raw save, load vs readinto; peak RSS of the log -------------------
        peaks: dict[str, list[int]] = {"log": [], "raw_save": []}
        log_rounds = args.log_rounds or rounds
        for r in range(log_rounds):
            raw_dir, model_dir = work / f"raw{r}", work / f"model{r}"
            # the two sides alternate, and each read starts on memory touched just before (this
            # VM charges ~1-2 s/GiB for never-touched pages: without it the side that happens to
            # get them loses by 2-3x, whichever it is; bench_params.py does the same)
            for who in ("raw", "ours") if r % 2 == 0 else ("ours", "raw"):
                if who == "raw":
                    before = rss("VmRSS:")
                    reset_peak()
                    t = time.perf_counter()
                    raw_save(fn, params, ids, raw_dir)
                    rec("raw_save", time.perf_counter() - t)
                    peaks["raw_save"].append(rss("VmHWM:") - before)
                    pretouch(nbytes)
                    t = time.perf_counter()
                    bufs = raw_read(params, raw_dir)
                    rec("raw_read", time.perf_counter() - t)
                    del bufs
                    shutil.rmtree(raw_dir)
                    continue
                # a cold compilation cache each round: what a first log of the function costs (a
                # later save of it reads the executables its read-back compiled, docs/saving.md)
                os.environ["JAXEXP_COMPILATION_CACHE"] = str(work / f"xla{r}")
                before = rss("VmRSS:")
                reset_peak()
                t = time.perf_counter()
                mlflow.jaxexp.save_model(fn, model_dir, params=params, input_example=ids)
                rec("log", time.perf_counter() - t)
                peaks["log"].append(rss("VmHWM:") - before)
                for k, v in readback.LAST_TIMINGS.items():  # the read-back's load and reference
                    rec(f"log_readback_{k}", v)
                pretouch(nbytes)
                t = time.perf_counter()
                model = mlflow.jaxexp.load_model(str(model_dir))
                jax.block_until_ready(model.params)
                rec("load", time.perf_counter() - t)
                del model
                gc.collect()  # JAX frees zero-copy host buffers only at a cyclic collection
                if r < log_rounds - 1:
                    shutil.rmtree(model_dir)
        # one more save of the same function, its executables in the last round's cache: what a
        # training hook's later checkpoints or a re-log cost
        t = time.perf_counter()
        mlflow.jaxexp.save_model(fn, work / "warm", params=params, input_example=ids)
        rec("log_warm", time.perf_counter() - t)
        shutil.rmtree(work / "warm")
        print(f"load average {load_average()} after the save/load rounds", flush=True)

        # -- tokens/s: the loaded model vs the raw jitted function, same params ------------------
        model = mlflow.jaxexp.load_model(str(work / f"model{log_rounds - 1}"))
        before = rss("VmRSS:")
        reset_peak()
        want = np.asarray(fn(params, ids))  # its first call: compile + run
        peaks["raw_call"] = [rss("VmHWM:") - before]
        got = np.asarray(model(ids))
        # exact on CPU; on an accelerator another compile may pick other kernels (TF32, autotuned
        # GEMMs): the share of equal tokens is reported rather than asserted
        agree = {"in_process": float(np.mean(got == want))}
        t = time.perf_counter()
        jax.block_until_ready(fn(params, ids))
        reps = max(1, min(50, int(0.5 / (time.perf_counter() - t))))  # >= 0.5 s a sample
        for _ in range(args.gen_rounds or 3 * rounds):  # one call of another process skews one
            for name in ("raw_gen", "gen"):
                t = time.perf_counter()
                for _ in range(reps):
                    jax.block_until_ready(fn(params, ids) if name == "raw_gen" else model(ids))
                rec(name, (time.perf_counter() - t) / reps)
        del model
        print(f"load average {load_average()} after the generate rounds", flush=True)

        # -- fresh processes: the model dir and a raw Orbax + blob beside it --------------------
        fresh = work / "fresh"
        fresh.mkdir()
        os.rename(work / f"model{log_rounds - 1}", fresh / "model")
        np.save(fresh / "prompt.npy", ids)
        (fresh / "raw").mkdir()
        exp = jax.export.export(fn)(params, jax.ShapeDtypeStruct(ids.shape, ids.dtype))
        (fresh / "raw" / "exported.bin").write_bytes(exp.serialize())
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(fresh / "raw" / "params", params)
        ckptr.wait_until_finished()
        load_peaks: dict[str, list[int]] = {"flavor": [], "raw": []}
        for _ in range(rounds):
            for mode in ("raw", "flavor"):
                out = child(mode, fresh, args.new_tokens)
                agree[f"fresh_{mode}"] = float(np.mean(np.asarray(out["tokens"]) == want))
                rec(f"fresh_{mode}", out["total"])
                for part in ("start", "load", "call"):  # interpreter + imports, load, 1st call
                    rec(f"fresh_{mode}_{part}", out[part])
                load_peaks[mode].append(out["load_peak"])
        print(f"load average {load_average()} after the fresh processes", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.batch * args.new_tokens
    gib = nbytes / 2**30
    tag = f"{size}, {gib:.2f} GiB bf16"
    samples = {k: [round(x, 3) for x in v] for k, v in times.items()}
    rows = [
        row(
            f"generate tokens/s ({tag}, b={args.batch}, t={args.prompt_len}, "
            f"{args.new_tokens} new)",
            tokens / med["gen"],
            tokens / med["raw_gen"],
            "raw jax.jit(generate)",
            ">= 0.97",
            samples_s=samples["gen"],
            baseline_samples_s=samples["raw_gen"],
        ),
        row(
            f"fresh process -> generated tokens s ({tag})",
            med["fresh_flavor"],
            med["fresh_raw"],
            "Orbax restore + deserialize + call",
            "<= 1.1",
            samples_s=samples["fresh_flavor"],
            baseline_samples_s=samples["fresh_raw"],
            **{
                f"{part}_s": [samples[f"fresh_flavor_{part}"], samples[f"fresh_raw_{part}"]]
                for part in ("start", "load", "call")
            },
        ),
        row(
            f"log (save_model) GB/s of params ({tag})",
            nbytes / med["log"] / 1e9,
            nbytes / med["raw_save"] / 1e9,
            "jax.export + write+fsync",
            ">= 0.8",
            samples_s=samples["log"],
            baseline_samples_s=samples["raw_save"],
            readback_s={k[12:]: v for k, v in samples.items() if k.startswith("log_readback_")},
        ),
        row(
            f"log again, compilation cache warm, GB/s of params ({tag})",
            nbytes / med["log_warm"] / 1e9,
            nbytes / med["raw_save"] / 1e9,
            "jax.export + write+fsync",
            ">= 0.8",
            samples_s=samples["log_warm"],
        ),
        row(
            f"load_model GB/s of params ({tag})",
            nbytes / med["load"] / 1e9,
            nbytes / med["raw_read"] / 1e9,
            "readinto, page cache warm",
            ">= 0.8",
            samples_s=samples["load"],
            baseline_samples_s=samples["raw_read"],
        ),
        row(
            f"peak RSS added by log, x params ({tag})",
            statistics.median(peaks["log"]) / nbytes,
            peaks["raw_call"][0] / nbytes,
            "raw jax.jit(generate) first call",
            "<= 1.25 (value)",
            raw_export_write=round(statistics.median(peaks["raw_save"]) / nbytes, 3),
        ),
        row(
            f"peak RSS added by a fresh load, x params ({tag})",
            statistics.median(load_peaks["flavor"]) / nbytes,
            statistics.median(load_peaks["raw"]) / nbytes,
            "Orbax restore + deserialize",
            "<= 1.25 (value)",
        ),
    ]
    print_rows(rows)
    print(
        f"backend {jax.default_backend()} {jax.devices()[0].device_kind}; tokens equal to the "
        f"raw call's: {agree}"
    )
    print(f"load average {load_average()} at the end")
    if args.json:
        write_json(
            args.json,
            "bench_llm",
            rows,
            load_average=load_average(),
            device=jax.devices()[0].device_kind,
            tokens_equal=agree,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
