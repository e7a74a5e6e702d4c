"""Run every benchmark of the project and print one table: figure, baseline, ratio, goal.

Each ``bench_*.py`` script runs in its own process with ``--json``; this collects their rows,
prints them side by side, writes all results to ``benchmarks/results.json`` and a short
``BENCHMARKS.md`` (machine, date, command, table). ``--quick`` runs every script in its
seconds-long mode (what CI uses to prove the scripts still work). Nothing here is asserted.

    python benchmarks/run_all.py [--quick] [--only call,codec] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Order: cheap first. Each entry: (name, script).
SUITE = [
    ("codec", "bench_codec.py"),
    ("call", "bench_call.py"),
    ("pyfunc", "bench_pyfunc.py"),
    ("rest", "bench_rest.py"),
    ("cold_start", "bench_cold_start.py"),
    ("iree", "bench_iree.py"),
    ("params", "bench_params.py"),
    ("remote", "bench_remote.py"),  # a real mlflow server; 1 GiB each way, a few minutes
    ("spark", "bench_spark.py"),  # needs the spark extra and Java; minutes
    ("mlserver", "bench_mlserver.py"),  # needs .venv-mlserver (scripts/mlserver_env.sh)
    ("llm", "bench_llm.py"),  # examples/llm.py's 1b config: ~15 minutes on 2 cores
]


def run_one(name: str, script: str, quick: bool) -> dict:
    """Run one benchmark script; return its JSON document (rows) plus status and wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, f"{name}.json")
        cmd = [sys.executable, str(HERE / script), "--json", str(out)] + (
            ["--quick"] if quick else []
        )
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        doc = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    doc.update(name=name, script=script, returncode=proc.returncode, wall_s=round(wall, 1))
    if proc.returncode != 0:
        doc["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return doc


def fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table(results: list[dict]) -> list[str]:
    """Markdown table of every row of every benchmark."""
    lines = [
        "| benchmark | figure | value | baseline (same run) | baseline value | ratio | goal |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for doc in results:
        if doc.get("error"):
            lines.append(f"| {doc['name']} | FAILED: {doc['error']} | | | | | |")
        for r in doc.get("rows", []):
            lines.append(
                f"| {doc['name']} | {r.get('figure')} | {fmt(r.get('value'))} | "
                f"{r.get('baseline_name', '')} | {fmt(r.get('baseline'))} | "
                f"{fmt(r.get('ratio'))} | {r.get('goal', '')} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long mode of every script")
    ap.add_argument("--only", default="", help="comma-separated subset, e.g. call,codec")
    ap.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/ (full run)")
    args = ap.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    suite = [(n, s) for n, s in SUITE if (not only or n in only) and (HERE / s).is_file()]
    results = []
    for name, script in suite:
        print(f"running {name} ({script}{' --quick' if args.quick else ''}) ...", flush=True)
        results.append(run_one(name, script, args.quick))
    lines = table(results)
    print("\n".join(lines))
    command = "python benchmarks/run_all.py" + (" --quick" if args.quick else "")
    if only:
        command += f" --only {args.only}"
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) if args.quick else HERE)
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import jax

        machine.update(jax=jax.__version__, backend=jax.default_backend())
    except ImportError:
        pass
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": command,
        "machine": machine,
        "results": results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    md = [
        "# Benchmarks",
        "",
        f"- date: {doc['date']}",
        f"- command: `{command}`",
        f"- machine: {', '.join(f'{k} {v}' for k, v in machine.items())}",
        "",
        "Every figure is measured beside its baseline in the same run; ratios are value/baseline.",
        "",
        *lines,
        "",
    ]
    target = (REPO if out_dir == HERE else out_dir) / "BENCHMARKS.md"
    target.write_text("\n".join(md))
    print(f"\nwrote {out_dir / 'results.json'} and {target}")
    return 1 if any(d["returncode"] for d in results) else 0


if __name__ == "__main__":
    sys.exit(main())
