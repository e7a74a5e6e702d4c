"""The benchmark scripts still run (quick mode) and report a baseline beside every figure.

Timings are never asserted: only that each script finishes and its rows are well formed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QUICK = ["codec", "call", "params"]  # the slower suites (REST, cold start) run with -m slow


def _run(only: str, tmp_path: Path) -> dict:
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/run_all.py"),
            "--quick",
            "--only",
            only,
            "--out-dir",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads((tmp_path / "results.json").read_text())


def _check(doc: dict, names: list[str], tmp_path: Path) -> None:
    assert [r["name"] for r in doc["results"]] == names
    for res in doc["results"]:
        assert res["returncode"] == 0, res.get("error")
        assert res["rows"], f"{res['name']} reported no rows"
        for row in res["rows"]:
            assert {"figure", "value", "baseline", "ratio", "goal"} <= row.keys()
            assert row["baseline"] > 0 and row["value"] >= 0
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "python benchmarks/run_all.py --quick" in md and "| ratio |" in md


def test_quick_benchmarks_run(tmp_path):
    _check(_run(",".join(QUICK), tmp_path), QUICK, tmp_path)


@pytest.mark.slow
def test_quick_serving_benchmarks_run(tmp_path):
    import importlib.util

    suites = ("pyfunc", "rest", "cold_start", "iree", "remote", "llm")
    names = [
        n
        for n in suites
        if (REPO / f"benchmarks/bench_{n}.py").exists()
        and (n != "iree" or importlib.util.find_spec("iree") is not None)
    ]
    _check(_run(",".join(names), tmp_path), names, tmp_path)
