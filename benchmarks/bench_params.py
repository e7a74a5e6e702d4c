"""Params I/O benchmark: save_params / restore_params against raw file I/O of the same bytes.

Baselines, measured in the same run and interleaved with the measured figures (the disk of a
shared VM drifts, so each round measures raw and Orbax back to back and the median is kept):

* save: raw ``write`` + ``fsync`` of every array into its own file;
* restore warm: raw ``readinto`` of those files into fresh buffers, page cache warm;
* restore cold: the same after ``posix_fadvise(DONTNEED)`` on every file (after fsync).

Peak memory: a subprocess builds a params tree of ``--mem-gib`` GiB, saves
it, and a second subprocess restores it; each reports its peak RSS (VmHWM, the ru_maxrss of
that process image). Goal: peak below two copies.

    python benchmarks/bench_params.py               # 1 GiB in 20 float32 arrays, 4 GiB memory
    python benchmarks/bench_params.py --quick       # 64 MiB, 256 MiB memory: seconds
    python benchmarks/bench_params.py --json out.json --size-gib 1 --mem-gib 4
    python benchmarks/bench_params.py --only model --sizes 0.5,2 --rounds 4

The load average (1 min) is printed each round and stored with the rows: this VM is shared.
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

import numpy as np
from report import print_rows, write_json

GB = 1e9
N_ARRAYS = 20


def evict(directory: str) -> None:
    """Drop every file of ``directory`` from the page cache (after fsync so nothing is dirty)."""
    for dp, _, files in os.walk(directory):
        for f in files:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def make_params(total_bytes: int, n: int = N_ARRAYS) -> dict:
    """``n`` float32 jax arrays, 2-D, totalling ``total_bytes`` (values in [0, 1): incompressible
    like trained weights; zero-copy from aligned numpy buffers so only one copy exists)."""
    import jax

    from jaxexp_mlflow.codec.zarr import aligned_empty

    rng = np.random.default_rng(0)
    cols = 1024
    rows = max(1, total_bytes // 4 // n // cols)
    out = {}
    for i in range(n):
        buf = aligned_empty((rows, cols), np.float32)
        rng.random(out=buf, dtype=np.float32)
        out[f"layer_{i:02d}"] = {"w": jax.device_put(buf)}
    return out


def raw_write(params: dict, directory: str) -> float:
    import jax

    os.makedirs(directory)
    t = time.perf_counter()
    for i, a in enumerate(jax.tree.leaves(params)):
        with open(os.path.join(directory, f"{i}.bin"), "wb", buffering=0) as f:
            f.write(memoryview(np.asarray(a)).cast("B"))
            os.fsync(f.fileno())
    dfd = os.open(directory, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    return time.perf_counter() - t


def raw_read(params: dict, directory: str) -> float:
    import jax

    t = time.perf_counter()
    bufs = []
    for i, a in enumerate(jax.tree.leaves(params)):
        buf = np.empty(a.shape, a.dtype)
        with open(os.path.join(directory, f"{i}.bin"), "rb", buffering=0) as f:
            f.readinto(memoryview(buf).cast("B"))
        bufs.append(buf)
    dt = time.perf_counter() - t
    del bufs
    gc.collect()
    return dt


def crc_pass(params: dict) -> float:
    """CRC-32C (what restore checks against the manifest) over every array, in memory."""
    import jax

    from jaxexp_mlflow.codec.crc32c import crc32c

    bufs = [np.asarray(a) for a in jax.tree.leaves(params)]
    t = time.perf_counter()
    for buf in bufs:
        crc32c(memoryview(buf).cast("B"))
    return time.perf_counter() - t


def pretouch(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory once and free it. This VM charges ~1-2 s/GiB the first
    time memory is touched, ~30 ms/GiB after: without this the contender that happens to get
    never-touched pages (raw buffers or restored arrays) loses by 2x, whichever it is."""
    block = 256 * 2**20
    bufs = []
    for _ in range(max(1, nbytes // block)):
        buf = np.empty(block, np.uint8)
        buf[::4096] = 1
        bufs.append(buf)
    del bufs


def bench_io(size_gib: float, rounds: int, compressions: list, workdir: str) -> list[dict]:
    import jax

    from jaxexp_mlflow import params as P
    from jaxexp_mlflow.params.restore import LAST_RESTORE_STATS

    params = make_params(int(size_gib * 2**30))
    pretouch(int(3 * size_gib * 2**30))  # raw buffers + restored arrays + slack
    nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params
    )
    # the same bytes as numpy leaves (zero-copy views): Orbax's numpy path, which used to copy
    np_params = jax.tree.map(np.asarray, params)
    times: dict[str, list[float]] = {}

    def rec(name: str, dt: float) -> None:
        times.setdefault(name, []).append(dt)

    P.save_params(params, os.path.join(workdir, "warmup"), compression=None)  # imports, threads
    jax.block_until_ready(P.restore_params(os.path.join(workdir, "warmup"), target=target))
    shutil.rmtree(os.path.join(workdir, "warmup"))
    for r in range(rounds):
        raw = os.path.join(workdir, f"raw{r}")
        rec("raw_write", raw_write(params, raw))
        evict(raw)
        rec("raw_read_cold", raw_read(params, raw))
        rec("raw_read_warm", raw_read(params, raw))
        rec("crc32c", crc_pass(params))
        shutil.rmtree(raw)
        ck = os.path.join(workdir, f"ck_numpy{r}")
        t = time.perf_counter()
        P.save_params(np_params, ck, compression=None)
        rec("save_numpy", time.perf_counter() - t)
        shutil.rmtree(ck)
        for comp in compressions:
            tag = comp or "none"
            ck = os.path.join(workdir, f"ck_{tag}{r}")
            t = time.perf_counter()
            P.save_params(params, ck, compression=comp)
            rec(f"save_{tag}", time.perf_counter() - t)
            evict(ck)
            t = time.perf_counter()
            out = jax.block_until_ready(P.restore_params(ck, target=target))
            rec(f"restore_cold_{tag}", time.perf_counter() - t)
            del out
            gc.collect()  # JAX frees zero-copy host buffers only at a cyclic collection
            t = time.perf_counter()
            out = jax.block_until_ready(P.restore_params(ck, target=target))
            rec(f"restore_warm_{tag}", time.perf_counter() - t)
            stats = dict(LAST_RESTORE_STATS)
            if r == 0:  # a figure only counts if the bytes are right
                for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params), strict=True):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), "restore differs"
            del out
            gc.collect()  # JAX frees zero-copy host buffers only at a cyclic collection
            shutil.rmtree(ck)
            times.setdefault(f"paths_{tag}", []).append(stats)  # type: ignore[arg-type]

    def gbps(name: str) -> float:
        return nbytes / statistics.median(times[name]) / GB

    rows = [
        {
            "figure": f"crc32c checksum alone ({size_gib:g} GiB) GB/s",
            "value": round(gbps("crc32c"), 3),
            "baseline_name": "raw readinto warm",
            "baseline": round(gbps("raw_read_warm"), 3),
            "ratio": round(gbps("crc32c") / gbps("raw_read_warm"), 3),
            "goal": "(restore verifies it)",
            "samples_s": [round(x, 4) for x in times["crc32c"]],
            "baseline_samples_s": [round(x, 4) for x in times["raw_read_warm"]],
        },
        {
            "figure": f"save_none numpy leaves ({size_gib:g} GiB, {N_ARRAYS} arrays) GB/s",
            "value": round(gbps("save_numpy"), 3),
            "baseline_name": "raw write+fsync",
            "baseline": round(gbps("raw_write"), 3),
            "ratio": round(gbps("save_numpy") / gbps("raw_write"), 3),
            "goal": ">= 0.8",
            "samples_s": [round(x, 4) for x in times["save_numpy"]],
            "baseline_samples_s": [round(x, 4) for x in times["raw_write"]],
        },
    ]
    for comp in compressions:
        tag = comp or "none"
        for fig, base, label in (
            (f"save_{tag}", "raw_write", "raw write+fsync"),
            (f"restore_warm_{tag}", "raw_read_warm", "raw readinto warm"),
            (f"restore_cold_{tag}", "raw_read_cold", "raw readinto cold"),
        ):
            rows.append(
                {
                    "figure": f"{fig} ({size_gib:g} GiB, {N_ARRAYS} arrays) GB/s",
                    "value": round(gbps(fig), 3),
                    "baseline_name": label,
                    "baseline": round(gbps(base), 3),
                    "ratio": round(gbps(fig) / gbps(base), 3),
                    "goal": ">= 0.8" if comp is None else "(trade-off, no goal)",
                    "samples_s": [round(x, 4) for x in times[fig]],
                    "baseline_samples_s": [round(x, 4) for x in times[base]],
                    "restore_paths": times[f"paths_{tag}"][-1],
                }
            )
    return rows


def bench_read_back(size_gib: float, rounds: int, workdir: str) -> list[dict]:
    """What the read-back of ``save_model`` (never publish what cannot load) adds.

    Saves a model whose params are ``size_gib`` GiB with an input example; the read-back
    (``flavors.readback``: MLmodel, blob, params restored, one compile, two runs) is timed
    inside the same save and reported as a share of the whole ``save_model``.
    """
    import jax
    import jax.numpy as jnp
    import mlflow

    import jaxexp_mlflow  # noqa: F401
    from jaxexp_mlflow.flavors import readback

    params = make_params(int(size_gib * 2**30))

    def fn(p, x):
        return sum(jnp.sum(x @ leaf[:8].T) for leaf in jax.tree.leaves(p))

    x = np.ones((4, 1024), np.float32)
    totals, loads, runs = [], [], []
    for r in range(rounds + 1):
        path = os.path.join(workdir, f"model{r}")
        t = time.perf_counter()
        mlflow.jaxexp.save_model(
            jax.jit(fn), path, params=params, input_example=x, include_package=False
        )
        if r:  # round 0 warms imports and the compilation cache
            totals.append(time.perf_counter() - t)
            loads.append(readback.LAST_TIMINGS["load"])
            runs.append(readback.LAST_TIMINGS["run"])
        shutil.rmtree(path)
    total, load, run = (statistics.median(v) for v in (totals, loads, runs))
    return [
        {
            "figure": f"save_model read-back: load ({size_gib:g} GiB params) s",
            "value": round(load, 3),
            "baseline_name": "whole save_model",
            "baseline": round(total, 3),
            "ratio": round(load / total, 3),
            "goal": "(cost of never publishing an unloadable model)",
            "run_with_both_params_s": round(run, 3),
        }
    ]


def bench_model(size_gib: float, rounds: int, workdir: str) -> list[dict]:
    """Params through the flavor: ``mlflow.jaxexp.save_model`` of an
    ``Exported`` with ``size_gib`` of params (Orbax writes, manifest, fsync pass, read-back)
    against raw write+fsync of the same bytes, and ``mlflow.jaxexp.load_model`` of the directory
    until the params are in memory (blob checks, manifest, restore) against raw ``readinto``
    (warm: the save just wrote them). Interleaved, raw first in even rounds; round 0 warms up.
    """
    import jax
    import jax.numpy as jnp
    import mlflow

    import jaxexp_mlflow  # noqa: F401

    params = make_params(int(size_gib * 2**30))
    pretouch(int(3 * size_gib * 2**30))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(params))

    def fn(p, x):
        return sum(jnp.sum(x @ leaf[:8].T) for leaf in jax.tree.leaves(p))

    x = np.ones((4, 1024), np.float32)
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    exp = jax.export.export(jax.jit(fn))(spec, jax.ShapeDtypeStruct(x.shape, x.dtype))
    times: dict[str, list[float]] = {k: [] for k in ("raw_write", "raw_read", "save", "load")}
    loads: list[float] = []
    for r in range(rounds + 1):
        raw, path = os.path.join(workdir, f"mraw{r}"), os.path.join(workdir, f"model{r}")
        order = ("raw", "ours") if r % 2 == 0 else ("ours", "raw")
        for who in order:
            if who == "raw":
                w = raw_write(params, raw)
                rd = raw_read(params, raw)
                if r:
                    times["raw_write"].append(w)
                    times["raw_read"].append(rd)
                shutil.rmtree(raw)
                continue
            t = time.perf_counter()
            mlflow.jaxexp.save_model(
                exp, path, params=params, input_example=x, include_package=False
            )
            save = time.perf_counter() - t
            from jaxexp_mlflow.codec import mlmodel

            mlmodel._PARSED.clear()  # as a fresh process: the save's parses do not help the load
            t = time.perf_counter()
            model = mlflow.jaxexp.load_model(path)
            jax.block_until_ready(model.params)
            load = time.perf_counter() - t
            if r == 1:  # a figure only counts if the bytes are right
                for a, b in zip(
                    jax.tree.leaves(model.params), jax.tree.leaves(params), strict=True
                ):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), "load differs"
            del model
            gc.collect()  # JAX frees zero-copy host buffers only at a cyclic collection
            shutil.rmtree(path)
            if r:
                times["save"].append(save)
                times["load"].append(load)
        loads.append(os.getloadavg()[0])
        print(
            f"model round {r}: "
            + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items() if v)
            + f", loadavg {os.getloadavg()}",
            flush=True,
        )

    def gbps(name: str) -> float:
        return nbytes / statistics.median(times[name]) / GB

    return [
        {
            "figure": f"{fig} ({size_gib:g} GiB params, {N_ARRAYS} arrays) GB/s",
            "value": round(gbps(ours), 3),
            "baseline_name": label,
            "baseline": round(gbps(base), 3),
            "ratio": round(gbps(ours) / gbps(base), 3),
            "goal": ">= 0.8",
            "samples_s": [round(v, 4) for v in times[ours]],
            "baseline_samples_s": [round(v, 4) for v in times[base]],
            "loadavg_1min": [round(v, 2) for v in loads],
        }
        for fig, ours, base, label in (
            ("mlflow.jaxexp.save_model", "save", "raw_write", "raw write+fsync"),
            ("mlflow.jaxexp.load_model (local dir)", "load", "raw_read", "raw readinto warm"),
        )
    ]


_CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, {bench_dir!r})
import jax
import bench_params as B
from jaxexp_mlflow import params as P
from jaxexp_mlflow.params.restore import LAST_RESTORE_STATS
mode, ck, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
def peak():
    # VmHWM (peak RSS of this process image): unlike ru_maxrss it does not inherit the parent's
    # high-water mark across fork+exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = peak()
if mode == "save":
    params = B.make_params(size)
    before = peak()
    P.save_params(params, ck)
    print(json.dumps({{"base": base, "before": before, "peak": peak()}}))
else:
    tree = P.checkpoint_tree(ck)
    base = before = peak()
    out = jax.block_until_ready(P.restore_params(ck, target=tree))
    print(json.dumps({{"base": base, "before": before, "peak": peak(),
                  "stats": LAST_RESTORE_STATS}}))
"""


def bench_memory(mem_gib: float, workdir: str) -> list[dict]:
    """Peak RSS of saving and restoring a ``mem_gib`` params tree, each in a fresh process."""
    size = int(mem_gib * 2**30)
    code = _CHILD.format(bench_dir=os.path.dirname(os.path.abspath(__file__)))
    ck = os.path.join(workdir, "mem_ck")
    res = {}
    for mode in ("save", "restore"):
        out = subprocess.run(
            [sys.executable, "-c", code, mode, ck, str(size)],
            check=True,
            capture_output=True,
            text=True,
        )
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(ck, ignore_errors=True)
    rows = []
    for mode in ("save", "restore"):
        # Memory the operation needs beyond the interpreter (jax, orbax, mlflow imported): the
        # params themselves (built before save, produced by restore) plus any transient copy.
        peak = res[mode]["peak"] - res[mode]["base"]
        rows.append(
            {
                "figure": f"{mode} peak RSS above interpreter ({mem_gib:g} GiB params) GiB",
                "value": round(peak / 2**30, 3),
                "baseline_name": "params size",
                "baseline": round(size / 2**30, 3),
                "ratio": round(peak / size, 3),
                "goal": "< 2.0 (never two copies)",
                "interpreter_rss_gib": round(res[mode]["base"] / 2**30, 3),
                "peak_rss_gib": round(res[mode]["peak"] / 2**30, 3),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 256 MiB memory test, 1 round")
    ap.add_argument("--size-gib", type=float, default=None, help="I/O size (default 1)")
    ap.add_argument("--sizes", default=None, help="several I/O sizes, e.g. 0.5,2 (GiB)")
    ap.add_argument("--mem-gib", type=float, default=None, help="memory test size (default 4)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    ap.add_argument("--no-zstd", action="store_true", help="skip the compression='zstd' rows")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir in cwd)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--only",
        choices=("io", "model", "memory", "readback"),
        action="append",
        default=None,
        help="run only these parts (repeatable; default: all)",
    )
    a = ap.parse_args(argv)
    size = a.size_gib if a.size_gib is not None else (1 / 16 if a.quick else 1.0)
    mem = a.mem_gib if a.mem_gib is not None else (0.25 if a.quick else 4.0)
    rounds = a.rounds or (1 if a.quick else 3)
    comps = [None] if a.no_zstd else [None, "zstd"]
    workdir = tempfile.mkdtemp(prefix="bench_params_", dir=a.dir or os.getcwd())
    parts = set(a.only or ("io", "model", "memory", "readback"))
    sizes = [float(x) for x in a.sizes.split(",")] if a.sizes else [size]
    try:
        rows = bench_memory(mem, workdir) if "memory" in parts else []  # while this is small
        for size in sizes:
            print(f"size {size:g} GiB, loadavg {os.getloadavg()}", flush=True)
            if "io" in parts:
                rows = bench_io(size, rounds, comps, workdir) + rows
            if "model" in parts:
                rows += bench_model(size, rounds, workdir)
            if "readback" in parts:
                rows += bench_read_back(size, rounds, workdir)
            gc.collect()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_rows(rows)
    if a.json:
        import jax
        import orbax.checkpoint as ocp

        write_json(a.json, "params", rows, jax=jax.__version__, orbax=ocp.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
