"""Fuzz JAX's deserializer with StableHLO module mutations; check the CLI survives every one.

Each mutation keeps the flatbuffer valid and changes bytes *inside* the MLIR bytecode module
(overwrites, bit flips, varint bumps), the way a damaged but consistently checksummed blob looks
(a model logged from such bytes). Stage 1 runs ``jax.export.deserialize`` + ``mlir_module()`` on
every mutation in a forked grandchild of a capped child (``RLIMIT_AS``) and counts how each one
ends: ok, Python error, signal (a crash in native code), out of memory, timeout. Stage 2 runs
``jaxexp_mlflow.runtime.isolate.probe`` (what ``jaxexp check``/``verify`` use) on every mutation
that crashed, ran out of memory or hung in stage 1, and counts refusals: the goal is that every
one is refused with an ``ArtifactError`` and that the calling process survives.

    python benchmarks/fuzz_module.py                 # 600 mutations of every 0.10.2 corpus blob
    python benchmarks/fuzz_module.py --quick         # 60 mutations: about a minute
    python benchmarks/fuzz_module.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MAGIC = b"ML\xefR"


def module_span(blob: bytes) -> tuple[int, int]:
    """(start, end) of the MLIR bytecode module inside the flatbuffer blob."""
    start = blob.find(MAGIC)
    if start < 4:
        raise ValueError("no MLIR bytecode module in the blob")
    length = int.from_bytes(blob[start - 4 : start], "little")  # flatbuffer vector length
    return start, start + length


def mutate(blob: bytes, rng: random.Random) -> bytes:
    """One mutation of the module bytes (same length: the flatbuffer stays valid)."""
    start, end = module_span(blob)
    data = bytearray(blob)
    body = start + 8  # keep the magic and the version: the reader's own framing checks
    kind = rng.randrange(3)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(body, end)
        if kind == 0:
            data[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data[at] = rng.choice([0x00, 0x7F, 0x80, 0xFF, 0x01])
        else:
            n = min(8, end - at)
            data[at : at + n] = bytes(rng.getrandbits(8) for _ in range(n))
    return bytes(data)


_HARNESS = r"""
import json, os, resource, signal, sys
cap, timeout = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import jax, jax.export
paths = sys.stdin.read().split()
for path in paths:
    data = open(path, "rb").read()
    pid = os.fork()
    if pid == 0:
        signal.alarm(timeout)
        try:
            jax.export.deserialize(bytearray(data)).mlir_module()
        except MemoryError:
            os._exit(3)
        except BaseException:
            os._exit(4)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        out = "timeout" if sig == signal.SIGALRM else "signal:" + signal.Signals(sig).name
    else:
        out = {0: "ok", 3: "oom", 4: "error"}.get(os.WEXITSTATUS(status), "exit")
    print(json.dumps([path, out]), flush=True)
"""


def classify(paths: list[str], *, cap: int, timeout: int = 20) -> dict[str, str]:
    """Stage 1: how JAX itself ends on each mutated blob (forked, capped, with an alarm)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [sys.executable, "-c", _HARNESS, str(cap), str(timeout)],
        input="\n".join(paths).encode(),
        capture_output=True,
        env=env,
        timeout=60 + timeout * len(paths),
    )
    lines = proc.stdout.decode("utf-8", "replace").splitlines()
    seen = dict(json.loads(line) for line in lines if line.startswith("["))
    return {p: seen.get(p, "harness-died") for p in paths}


def corpus_blobs() -> list[bytes]:
    """The 0.10.2 corpus blobs, in the order the mutations take them."""
    corpus = Path(os.environ.get("JAXEXP_CORPUS", REPO.parent / "shared" / "corpus"))
    return [p.read_bytes() for p in sorted(corpus.glob("jax-0.10.2/*/exported.bin"))]


def mutations(n: int, *, seed: int = 0) -> list[bytes]:
    """The first ``n`` mutations of the 0.10.2 corpus blobs (deterministic for a seed)."""
    blobs = corpus_blobs()
    rng = random.Random(seed)
    return [mutate(blobs[i % len(blobs)], rng) for i in range(n)]


def run(n: int, workdir: Path, *, seed: int = 0, cap: int = 2 << 30) -> dict:
    """Generate ``n`` mutations over the 0.10.2 corpus, classify them, probe the dangerous ones."""
    from jaxexp_mlflow.errors import ArtifactError
    from jaxexp_mlflow.runtime.isolate import probe

    paths = []
    for i, data in enumerate(mutations(n, seed=seed)):
        path = workdir / f"m{i:05d}.bin"
        path.write_bytes(data)
        paths.append(str(path))
    outcomes = classify(paths, cap=cap)
    counts: dict[str, int] = {}
    for out in outcomes.values():
        key = out.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    dangerous = [p for p, out in outcomes.items() if out not in ("ok", "error")]
    refused = 0
    for path in dangerous:
        try:
            probe(Path(path).read_bytes(), source=Path(path).name, memory_bytes=cap, timeout_s=30)
        except ArtifactError:
            refused += 1
    return {
        "mutations": n,
        "outcomes": counts,
        "signals": sorted({o for o in outcomes.values() if o.startswith("signal")}),
        "dangerous": len(dangerous),
        "refused_by_probe": refused,
    }


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("-n", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    n = args.n or (60 if args.quick else 600)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(n, Path(tmp))
    print(f"{'figure':<44}  value")
    print(f"{'module mutations':<44}  {result['mutations']}")
    for key, value in sorted(result["outcomes"].items()):
        print(f"{'  JAX in-process outcome: ' + key:<44}  {value}")
    print(f"{'  signals seen':<44}  {', '.join(result['signals']) or '-'}")
    print(f"{'dangerous (signal/oom/timeout)':<44}  {result['dangerous']}")
    print(f"{'  refused by the isolated probe':<44}  {result['refused_by_probe']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["refused_by_probe"] == result["dangerous"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
