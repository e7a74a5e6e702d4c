"""Regenerate ``jaxexp_mlflow/data/jaxlib_releases.json`` from PyPI's JSON API.

The compatibility verdict (``jaxexp_mlflow.runtime.compat``) compares the *build dates* of the
exporting and the consuming jaxlib, as JAX's compatibility promise is stated in time (6 months
backward, 3 weeks forward). A jaxlib release's date is the earliest upload time of any of its
files on PyPI (wheels are built the same day). Yanked releases are kept (an archive may have been
written by one) and marked.

    python scripts/update_jaxlib_releases.py            # rewrite the package data file
    python scripts/update_jaxlib_releases.py --check    # exit 1 if the shipped table is stale
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import urllib.request
from pathlib import Path

URL = "https://pypi.org/pypi/jaxlib/json"
OUT = Path(__file__).resolve().parents[1] / "jaxexp_mlflow" / "data" / "jaxlib_releases.json"


def fetch(url: str = URL, timeout: float = 30.0) -> dict:
    """The PyPI JSON document of jaxlib."""
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (fixed https URL)
        return json.load(resp)


def build_table(doc: dict) -> dict:
    """``{"releases": {version: {"date": "YYYY-MM-DD", "yanked": bool}}, ...}`` from PyPI JSON."""
    releases = {}
    for version, files in doc.get("releases", {}).items():
        times = [f["upload_time_iso_8601"] for f in files if f.get("upload_time_iso_8601")]
        if not times:
            continue  # a version without files was never installable
        first = min(dt.datetime.fromisoformat(t.replace("Z", "+00:00")) for t in times)
        entry = {"date": first.date().isoformat()}
        if all(f.get("yanked") for f in files):
            entry["yanked"] = True
        releases[version] = entry
    ordered = dict(sorted(releases.items(), key=lambda kv: (kv[1]["date"], kv[0])))
    return {
        "source": URL,
        "generated": dt.date.today().isoformat(),
        "latest": doc.get("info", {}).get("version"),
        "note": "date = earliest upload of any file of the release (UTC); regenerate with "
        "scripts/update_jaxlib_releases.py",
        "releases": ordered,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="only report whether the table is stale")
    args = ap.parse_args(argv)
    table = build_table(fetch())
    if args.check:
        old = json.loads(args.out.read_text()) if args.out.exists() else {"releases": {}}
        missing = sorted(set(table["releases"]) - set(old["releases"]))
        print(f"{len(missing)} release(s) missing from {args.out}: {missing}")
        return 1 if missing else 0
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(
        f"wrote {len(table['releases'])} jaxlib releases (latest {table['latest']}) to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
