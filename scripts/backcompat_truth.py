"""Regenerate ``tests/data/backcompat_truth/jax-<installed version>.json``: what the installed
jax does with each of JAX's archived back-compat modules (run in child processes), for the verdict
tests to compare against.

    python scripts/backcompat_truth.py            # fetch older jax wheels, run, rewrite the file
    python scripts/backcompat_truth.py --no-fetch # only the installed wheel and cached ones

The older wheels (``tests/backcompat.py: OLDER_WHEELS``) are fetched with ``pip download`` into
``~/.cache/jaxexp-mlflow/jax-wheels`` (``JAXEXP_WHEEL_CACHE``); only their test data is read.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import backcompat  # noqa: E402


def build(fetch: bool = True) -> dict:
    """The ground-truth document for the installed jax."""
    import jax
    import jaxlib

    if fetch:
        backcompat.fetch_wheels()
    mods = backcompat.modules()
    with tempfile.TemporaryDirectory() as tmp:
        truth = backcompat.ground_truth(mods, Path(tmp))
    rows = {}
    for m in sorted(mods, key=lambda m: m.key):
        rows[m.key] = {
            "source": m.source,
            "platform": m.platform,
            "calling_convention": int(m.data["xla_call_module_version"]),
            "custom_call_targets": sorted(m.data["custom_call_targets"]),
            **truth[m.key],
        }
    return {
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "generated": dt.date.today().isoformat(),
        "wheels": [f"jax-{jax.__version__} (installed)"]
        + [f"jax-{v}" for v in backcompat.OLDER_WHEELS],
        "note": "truth = what jax.export.deserialize + call does with the module on one CPU "
        "device with jax_enable_x64 (as JAX runs these tests); matches = outputs within 1e-3 "
        "of the recorded ones (eigenvectors may differ by sign); regenerate with "
        "scripts/backcompat_truth.py",
        "modules": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fetch", action="store_true", help="do not pip download older wheels")
    ap.add_argument("--out", type=Path, default=None, help="default: the installed jax's file")
    args = ap.parse_args(argv)
    doc = build(fetch=not args.no_fetch)
    args.out = args.out or backcompat.truth_file(doc["jax_version"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    runs = sum(r["truth"] == "runs" for r in doc["modules"].values())
    print(f"wrote {len(doc['modules'])} modules ({runs} run) for jax {doc['jax_version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
