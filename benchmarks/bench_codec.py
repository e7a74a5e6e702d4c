"""Benchmark the jax-free blob reader against jax.export.deserialize, measured in the same run.

1. ``read_blob`` on every corpus blob (µs per read, best of several rounds) vs
   ``jax.export.deserialize`` on the same bytes in this process (jax already imported). The
   baseline covers the blobs the installed jax reads as configured: jax >= 0.11.1 refuses schema
   < 5 blobs (jax <= 0.7) unless ``JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS=1`` is set, and old
   HLO shardings whatever the flag; the blobs it refuses are listed, read by the reader alone.
2. Wall time of a fresh ``python -c`` process that reads one blob:
   - ``reader (package)``: ``from jaxexp_mlflow.codec.reader import read_blob_file`` (runs the
     package ``__init__``),
   - ``reader (standalone)``: the codec modules loaded without executing any package
     ``__init__`` (what a vendored copy would cost),
   - ``jax deserialize``: ``import jax`` + ``jax.export.deserialize``,
   - ``python -c pass``: the interpreter start-up floor.

Goals: read < 1 ms, fresh process < 0.3 s. ``--quick`` runs in a few seconds.

    python benchmarks/bench_codec.py [--quick] [--corpus DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = Path(os.environ.get("JAXEXP_CORPUS", REPO.parent / "shared" / "corpus"))
sys.path.insert(0, str(REPO))

from jaxexp_mlflow.codec.reader import read_blob  # noqa: E402

_STANDALONE = """
import sys, types
root = {root!r}
for name, path in (("jaxexp_mlflow", root), ("jaxexp_mlflow.codec", root + "/codec")):
    m = types.ModuleType(name); m.__path__ = [path]; sys.modules[name] = m
from jaxexp_mlflow.codec.reader import read_blob_file
d = read_blob_file({blob!r})
"""
_PACKAGE = """
from jaxexp_mlflow.codec.reader import read_blob_file
d = read_blob_file({blob!r})
"""
_JAX = """
from jax import export
e = export.deserialize(bytearray(open({blob!r}, "rb").read()))
"""
_HEAVY = """
import sys
print(",".join(m for m in ("jax", "jaxlib", "numpy", "mlflow", "flatbuffers") if m in sys.modules))
"""


def per_call_us(fn, data: bytes, rounds: int, number: int) -> float:
    """Best-of-``rounds`` mean time of ``fn(data)`` in microseconds."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(number):
            fn(data)
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


def fresh_process_s(code: str, reps: int) -> tuple[float, str]:
    """Median wall time of ``python -c code`` and what it printed last."""
    times, out = [], ""
    for _ in range(reps):
        t0 = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
        )
        times.append(time.perf_counter() - t0)
        out = res.stdout.strip()
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few blobs and repetitions (CI)")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--json", type=Path, default=None, help="write the result rows here")
    args = ap.parse_args()

    blobs = sorted(args.corpus.glob("jax-*/*/exported.bin"))
    if not blobs:
        sys.exit(f"no blobs under {args.corpus} (set --corpus or JAXEXP_CORPUS)")
    if args.quick:
        blobs = [b for b in blobs if b.parent.name in ("linalg", "mlp")]
    rounds, number, reps = (3, 20, 3) if args.quick else (5, 200, 10)

    import jax
    from jax import export  # the baseline, imported once (not part of the per-call times)

    def jax_deserialize(data: bytes) -> None:
        export.deserialize(bytearray(data))

    def jax_refusal(data: bytes) -> str | None:
        """Why the installed jax refuses the blob (its error, first line), or None."""
        try:
            jax_deserialize(data)
        except Exception as err:  # noqa: BLE001 - jax raises assorted types
            return f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
        return None

    print(f"# read_blob vs jax.export.deserialize, in process ({len(blobs)} blobs)")
    print(f"{'blob':<28} {'bytes':>7} {'read_blob µs':>13} {'jax µs':>10} {'jax/reader':>11}")
    reads, ratios, readable, refused = [], [], [], []
    paired: list[tuple[float, float]] = []  # (reader, jax) on the blobs jax reads
    for path in blobs:
        data = path.read_bytes()
        r = per_call_us(read_blob, data, rounds, number)
        reads.append(r)
        name = f"{path.parent.parent.name}/{path.parent.name}"
        why = jax_refusal(data)
        if why is not None:
            refused.append((name, why))
            print(f"{name:<28} {len(data):>7} {r:>13.0f} {'refused':>10} {'-':>11}")
            continue
        readable.append(path)
        j = per_call_us(jax_deserialize, data, rounds, max(1, number // 4))
        ratios.append(j / r)
        paired.append((r, j))
        print(f"{name:<28} {len(data):>7} {r:>13.0f} {j:>10.0f} {j / r:>10.1f}x")
    for name, why in refused:
        print(f"  jax {jax.__version__} refuses {name}: {why}")
    if refused:
        print(
            "  (JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS=1 has jax >= 0.11.1 read the schema < 5 "
            "ones too; old HLO shardings stay refused)"
        )
    if not ratios:
        sys.exit(f"jax {jax.__version__} reads none of the blobs: no baseline to compare with")
    print(
        f"{'max / median':<28} {'':>7} {max(reads):>7.0f} / {statistics.median(reads):<4.0f}"
        f" {'':>10} {statistics.median(ratios):>10.1f}x (median)"
    )
    print(f"goal read < 1000 µs: {'met' if max(reads) < 1000 else 'NOT met'}")

    blob = str(next(b for b in readable if b.parent.name == "linalg"))  # one jax reads too
    print(f"\n# fresh process reading one blob ({Path(blob).parent.parent.name}/linalg), median")
    rows = [
        ("python -c pass", "pass"),
        ("reader (package)", _PACKAGE.format(blob=blob) + _HEAVY),
        ("reader (standalone)", _STANDALONE.format(root=str(REPO / "jaxexp_mlflow"), blob=blob)),
        ("jax deserialize", _JAX.format(blob=blob)),
    ]
    results = {}
    for label, code in rows:
        results[label] = fresh_process_s(code, reps)
    base = results["jax deserialize"][0]
    print(f"{'process':<22} {'wall s':>8} {'vs jax':>8}  heavy modules imported")
    for label, (secs, out) in results.items():
        heavy = out if label == "reader (package)" else ""
        print(f"{label:<22} {secs:>8.3f} {base / secs:>7.1f}x  {heavy or '-'}")
    pkg = results["reader (package)"][0]
    print(f"goal fresh process < 0.3 s: {'met' if pkg < 0.3 else 'NOT met'} ({pkg:.3f} s)")
    if args.json:
        med_read = statistics.median(r for r, _ in paired)  # the blobs both read
        med_jax = statistics.median(j for _, j in paired)
        rows = [
            {
                "figure": "read_blob per blob, median (µs)",
                "value": round(med_read, 1),
                "baseline_name": "jax.export.deserialize, same blobs"
                + (f" ({len(refused)} refused by jax {jax.__version__})" if refused else ""),
                "baseline": round(med_jax, 1),
                "ratio": round(med_read / med_jax, 3),
                "goal": f"max < 1000 µs (max {max(reads):.0f} µs)",
            },
            {
                "figure": "fresh process: read one blob (s)",
                "value": round(pkg, 3),
                "baseline_name": "fresh process: import jax + deserialize",
                "baseline": round(base, 3),
                "ratio": round(pkg / base, 3),
                "goal": "< 0.3 s",
            },
        ]
        args.json.write_text(json.dumps({"benchmark": "codec", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
