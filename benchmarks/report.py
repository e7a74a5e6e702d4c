"""Printing and saving benchmark rows the way run_all.py collects them."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path


def print_rows(rows: list[dict]) -> None:
    """One line per row: figure, value, baseline, ratio, goal (baseline name)."""
    w = max(len(r["figure"]) for r in rows)
    print(f"{'figure':<{w}}  {'value':>8}  {'baseline':>8}  {'ratio':>6}  goal  (baseline)")
    for r in rows:
        print(
            f"{r['figure']:<{w}}  {r['value']:>8.3f}  {r['baseline']:>8.3f}  {r['ratio']:>6.2f}  "
            f"{r['goal']}  ({r['baseline_name']})"
        )


def write_json(path: str | os.PathLike, name: str, rows: list[dict], **machine: str) -> None:
    """The document run_all.py reads: benchmark name, command, date, machine, rows."""
    doc = {
        "benchmark": name,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            **machine,
        },
        "rows": rows,
    }
    Path(path).write_text(json.dumps(doc, indent=1))
