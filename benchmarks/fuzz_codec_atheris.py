"""Coverage-guided fuzz target for the jax-free blob reader (atheris / libFuzzer).

The invariant is the one tests/codec/test_codec_fuzz.py checks with hypothesis: ``read_blob``
returns a ``BlobDescription`` or raises ``BlobFormatError``; any other exception is a crash.

    pip install atheris
    python benchmarks/fuzz_codec_atheris.py -atheris_runs=1000000 corpus_dir/
    # seed corpus_dir with the shared corpus: cp ../shared/corpus/*/*/exported.bin corpus_dir/
    # (copy them under distinct names, e.g. jax-0.10.2_mlp.bin)

``--quick`` runs the target once over the shared corpus without atheris (a smoke test).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxexp_mlflow.codec.reader import BlobFormatError, read_blob  # noqa: E402


def test_one_input(data: bytes) -> None:
    """libFuzzer entry point: anything but BlobFormatError propagates as a crash."""
    try:
        read_blob(data)
    except BlobFormatError:
        pass


def main() -> None:
    if "--quick" in sys.argv:
        corpus = Path(os.environ.get("JAXEXP_CORPUS", REPO.parent / "shared" / "corpus"))
        blobs = sorted(corpus.glob("jax-*/*/exported.bin"))
        for path in blobs:
            data = path.read_bytes()
            for cut in range(0, len(data), 7):
                test_one_input(data[:cut])
        print(f"ok: {len(blobs)} blobs and their truncations")
        return
    import atheris  # type: ignore[import-not-found]

    atheris.instrument_all()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
