"""Run the project's benchmarks, store their results as data and render BENCHMARKS.md from them.

Each ``bench_*.py`` script runs in a process of its own with ``--json``. A run writes one results
file, ``benchmarks/results/<date>-<commit>.json`` (the run's date, commit, machine, versions and
command, and the rows of each family: figure, ours, baseline, ratio, goal), then renders
BENCHMARKS.md from every stored results file (``render.py``: the newest file per family).
Optional families (the ONNX route, Spark, MLServer, IREE, GPU) are skipped, and said so, where
their prerequisites are missing.

``--quick`` runs every script in its seconds-long mode, to prove the scripts work; its results
and page go to a temporary folder (or ``--out-dir``), never over the stored ones. ``--render``
rebuilds the page from the stored results without running anything. Nothing here is asserted.

Where an accelerator is visible, the LLM is stored as the ``gpu_llm`` family beside ``gpu``: run
``python benchmarks/run_all.py --only gpu,llm`` on that machine and commit its results file here
for the page's GPU tables to come from it.

    python benchmarks/run_all.py [--only call,codec] [--quick] [--out-dir DIR] [--render]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import machine  # noqa: E402
import render  # noqa: E402

REPO = HERE.parent


def _importable(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


def _why_not_onnx() -> str | None:
    if not _importable("onnxruntime", "onnx"):
        return "needs onnxruntime and onnx (pip install onnxruntime onnx)"
    return None


def _why_not_spark() -> str | None:
    if not _importable("pyspark") or shutil.which("java") is None:
        return "needs pyspark (the spark extra) and Java"
    return None


def _why_not_mlserver() -> str | None:
    if not (REPO / ".venv-mlserver" / "bin").is_dir():
        return "needs .venv-mlserver (bash scripts/mlserver_env.sh)"
    return None


def _why_not_iree() -> str | None:
    return None if _importable("iree") else "needs the iree extra"


def _why_not_gpu() -> str | None:
    return None if machine.has_accelerator() else "needs an accelerator"


# Cheap first. Each entry: (family, script, why it cannot run here or None).
SUITE: list[tuple[str, str, Callable[[], str | None]]] = [
    ("codec", "bench_codec.py", lambda: None),
    ("call", "bench_call.py", lambda: None),
    ("pyfunc", "bench_pyfunc.py", lambda: None),
    ("rest", "bench_rest.py", lambda: None),
    ("cold_start", "bench_cold_start.py", lambda: None),
    ("iree", "bench_iree.py", _why_not_iree),
    ("params", "bench_params.py", lambda: None),
    ("remote", "bench_remote.py", lambda: None),  # a real mlflow server; 1 GiB each way
    ("onnx", "bench_onnx.py", _why_not_onnx),  # a jax2onnx venv of its own; minutes
    ("spark", "bench_spark.py", _why_not_spark),  # minutes
    ("mlserver", "bench_mlserver.py", _why_not_mlserver),
    ("llm", "bench_llm.py", lambda: None),  # the 1b config: ~15 minutes on 2 cores
    ("gpu", "bench_gpu.py", _why_not_gpu),
]
ONNX_BASELINE = "ONNX route"


def onnx_rows(rows: list[dict]) -> list[dict]:
    """``bench_onnx.py``'s rows (model, figure, ours, peer) as the page's rows."""
    out = []
    for r in rows:
        iree = r["figure"].startswith("iree")
        if "refused" in r:
            out.append({"figure": f"{r['model']}: {r['figure']}", "value": "refused"})
            continue
        figure, scale = r["figure"], 1.0
        if figure.endswith("(s/call)"):  # a call's seconds as the page's other calls: µs
            figure, scale = figure.replace("(s/call)", "(µs)"), 1e6
        out.append(
            {
                "figure": f"{r['model']}: {figure}",
                "value": round(r["ours"] * scale, 4),
                "baseline_name": ONNX_BASELINE,
                "baseline": round(r["peer"] * scale, 4),
                "ratio": round(r["ratio"], 3),
                "goal": "<= 1.2" if iree else "<= 1.0",
            }
        )
    return out


def run_one(name: str, script: str, quick: bool) -> dict:
    """Run one benchmark script; its rows, the rest of its document, status and wall time."""
    command = f"python benchmarks/{script}" + (" --quick" if quick else "")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, f"{name}.json")
        cmd = [sys.executable, str(HERE / script), "--json", str(out)]
        cmd += ["--quick"] if quick else []
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        doc = json.loads(out.read_text()) if out.is_file() else {}
    rows = doc.pop("rows", [])
    if name == "onnx":
        rows = onnx_rows(rows)
    res = {
        "script": script,
        "command": command,
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "rows": rows,
        "detail": doc,
    }
    if proc.returncode != 0:
        res["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return res


def results_path(out_dir: Path, date: str, commit: str) -> Path:
    """``<date>-<commit>.json`` in ``out_dir``; ``-2``, ``-3``... for a further run."""
    path, n = out_dir / f"{date}-{commit}.json", 1
    while path.exists():
        n += 1
        path = out_dir / f"{date}-{commit}-{n}.json"
    return path


def print_rows(name: str, res: dict) -> None:
    if res.get("skipped"):
        print(f"{name}: skipped: {res['skipped']}")
    if res.get("error"):
        print(f"{name}: FAILED: {res['error']}")
    for r in res.get("rows", []):
        print(
            f"{name} | {r.get('figure')} | {render.fmt(r.get('value'))} | "
            f"{render.fmt(r.get('baseline'))} | {render.fmt(r.get('ratio'))} | {r.get('goal', '')}"
        )


def run(args: argparse.Namespace, argv: list[str]) -> tuple[Path, int]:
    """Run the chosen families, write the results file; its path and the exit status."""
    only = {s for s in args.only.split(",") if s}
    unknown = only - {n for n, _, _ in SUITE}
    if unknown:
        known = ", ".join(n for n, _, _ in SUITE)
        raise SystemExit(f"--only: unknown families {sorted(unknown)}; known: {known}")
    accel = machine.has_accelerator()
    families: dict[str, dict] = {}
    status = 0
    for name, script, why_not in SUITE:
        if only and name not in only:
            continue
        key = "gpu_llm" if name == "llm" and accel else name
        reason = why_not()
        if reason:
            families[key] = {"script": script, "skipped": reason, "rows": []}
        else:
            print(f"running {name} ({script}{' --quick' if args.quick else ''}) ...", flush=True)
            families[key] = run_one(name, script, args.quick)
            status |= families[key]["returncode"] != 0
        print_rows(key, families[key])
    commit, dirty = machine.git_commit()
    info = machine.describe_machine()
    gpu = families.get("gpu", {}).get("detail", {}).get("device")
    if gpu:
        info["accelerator"] = gpu.get("device_kind")
    doc = {
        "schema": render.SCHEMA,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "time": time.strftime("%H:%M:%S", time.gmtime()),
        "commit": commit,
        "commit_dirty": dirty,
        "command": " ".join(["python", "benchmarks/run_all.py", *argv]),
        "quick": args.quick,
        "machine": info,
        "versions": machine.versions(),
        "families": families,
    }
    out_dir = args.out_dir or (
        Path(tempfile.mkdtemp(prefix="bench-quick-")) if args.quick else render.RESULTS_DIR
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = results_path(out_dir, doc["date"], commit)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"\nwrote {path}")
    return out_dir, int(status)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long mode of every script")
    ap.add_argument("--only", default="", help="comma-separated subset, e.g. call,codec")
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where the results file and the page go (default: benchmarks/results/ and "
        "BENCHMARKS.md; a temporary folder for --quick)",
    )
    ap.add_argument(
        "--render", action="store_true", help="only rebuild the page from the stored results"
    )
    args = ap.parse_args(argv)
    status = 0
    if args.render:
        results_dir = args.out_dir or render.RESULTS_DIR
    else:
        results_dir, status = run(args, argv)
    stored = results_dir.resolve() == render.RESULTS_DIR
    page = render.PAGE if stored else results_dir / "BENCHMARKS.md"
    page.write_text(render.render_dir(results_dir), encoding="utf-8")
    print(f"wrote {page}")
    return status


if __name__ == "__main__":
    sys.exit(main())
