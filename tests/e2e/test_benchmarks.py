"""The benchmark scripts still run (quick mode), and BENCHMARKS.md is their stored results rendered.

Timings are never asserted: only that each script finishes, its rows are well formed, a run
lands as a results file the page is rendered from, and the page in the repository is exactly
what the renderer makes of the stored results.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICK = ["codec", "call", "params"]  # the slower suites (REST, cold start) run with -m slow


def _render_module():
    spec = importlib.util.spec_from_file_location("bench_render", REPO / "benchmarks/render.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(only: str, tmp_path: Path, out_dir: bool = False) -> dict:
    """A quick run of ``only``; its results file's document, in ``tmp_path``.

    Without ``out_dir`` the run is typed as a user types it and its folder moved to
    ``tmp_path``; either way the stored results and the page in the repository stay as they were.
    """
    stored = {p.name: p.read_bytes() for p in (REPO / "benchmarks/results").glob("*.json")}
    page = (REPO / "BENCHMARKS.md").read_bytes()
    cmd = [sys.executable, str(REPO / "benchmarks/run_all.py"), "--quick", "--only", only]
    cmd += ["--out-dir", str(tmp_path)] if out_dir else []
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    written = Path(re.search(r"^wrote (\S+\.json)$", proc.stdout, re.M).group(1))
    if not out_dir:
        for p in written.parent.iterdir():
            shutil.move(p, tmp_path / p.name)
        written.parent.rmdir()
    assert written.parent != REPO / "benchmarks/results"
    assert (REPO / "BENCHMARKS.md").read_bytes() == page
    assert {p.name: p.read_bytes() for p in (REPO / "benchmarks/results").glob("*.json")} == stored
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 1, files
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[0-9a-z]+\.json", files[0].name), files[0].name
    return json.loads(files[0].read_text())


def _check(doc: dict, names: list[str], tmp_path: Path) -> None:
    assert list(doc["families"]) == names
    assert doc["quick"] is True and doc["schema"] == 1
    assert doc["command"].startswith("python benchmarks/run_all.py --quick")
    assert doc["machine"]["cores"] and doc["versions"]["python"]
    for name, res in doc["families"].items():
        assert res["returncode"] == 0, res.get("error")
        assert res["rows"], f"{name} reported no rows"
        for row in res["rows"]:
            assert {"figure", "value", "baseline", "ratio", "goal"} <= row.keys()
            assert row["baseline"] > 0 and row["value"] >= 0
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert md == _render_module().render_dir(tmp_path)
    assert "| figure | ours | baseline | ratio | goal |" in md and "(quick)" in md
    for name in names:
        assert f"--only {name}` measures them" not in md


def test_benchmarks_md_is_the_stored_results_rendered():
    render = _render_module()
    page = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert page == render.render_dir(), (
        "BENCHMARKS.md differs from the stored results: run `python benchmarks/run_all.py "
        "--render`, and edit benchmarks/results/ or benchmarks/decisions.md, not the page"
    )


def test_stored_results_name_their_run_and_rows():
    render = _render_module()
    docs = render.load_results()
    assert docs, "no stored results in benchmarks/results/"
    for name, doc in docs.items():
        assert name == f"{doc['date']}-{doc['commit']}.json" or name.startswith(
            f"{doc['date']}-{doc['commit']}-"
        )
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", doc["date"])
        assert doc["command"] and "machine" in doc and "versions" in doc
        for res in doc["families"].values():
            for row in res["rows"]:
                assert row["figure"] and "ratio" in row and "goal" in row
    # every family of the page comes from the newest file that measured it
    for fam, (name, _) in render.newest_per_family(docs).items():
        measured = [n for n, d in docs.items() if d["families"].get(fam, {}).get("rows")]
        assert max(measured, key=lambda n: render._when(n, docs[n])) == name, fam


def test_newest_file_per_family_wins_and_says_where_it_came_from():
    render = _render_module()

    def doc(date: str, commit: str, fams: dict) -> dict:
        return {
            "schema": 1,
            "date": date,
            "commit": commit,
            "command": "python benchmarks/run_all.py",
            "machine": {"cpu": f"cpu-{commit}", "cores": 2},
            "versions": {"python": "3.11"},
            "families": {
                f: {"rows": [{"figure": f"{f} fig", "value": v, "ratio": v, "goal": "<= 1"}]}
                for f, v in fams.items()
            },
        }

    docs = {
        "2026-01-01-aaaaaaa.json": doc("2026-01-01", "aaaaaaa", {"call": 1.5, "codec": 2.5}),
        "2026-02-01-bbbbbbb.json": doc("2026-02-01", "bbbbbbb", {"call": 0.5}),
        "2026-03-01-ccccccc.json": {
            **doc("2026-03-01", "ccccccc", {}),
            "families": {"codec": {"rows": [], "error": "failed"}},
        },
    }
    page = render.render(docs, "- a decision.")
    call = page.split("## Call")[1].split("## ")[0]
    codec = page.split("## Codec")[1].split("## ")[0]
    assert "`2026-02-01-bbbbbbb.json`" in call and "cpu-bbbbbbb" in call and "| 0.5 |" in call
    # a failed run: no rows
    assert "`2026-01-01-aaaaaaa.json`" in codec and "| 2.5 |" in codec
    assert "2026-03-01-ccccccc.json" not in page
    assert page.endswith("## Performance decisions\n\n- a decision.\n")
    assert page == render.render(dict(reversed(list(docs.items()))), "- a decision.")


def test_stored_page_has_no_session_talk():
    page = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    decisions = page.split("## Performance decisions")[1]
    for word in ("session", "issue"):
        assert word not in page.lower(), word
    assert "UTC" not in page
    assert not re.search(r"\b\d{1,2}:\d{2}\b", decisions)  # no clock times
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", decisions)  # undated


def test_quick_benchmarks_run(tmp_path):
    _check(_run(",".join(QUICK), tmp_path), QUICK, tmp_path)


@pytest.mark.slow
def test_quick_serving_benchmarks_run(tmp_path):
    suites = ("pyfunc", "rest", "cold_start", "iree", "remote", "llm")
    names = [
        n
        for n in suites
        if (REPO / f"benchmarks/bench_{n}.py").exists()
        and (n != "iree" or importlib.util.find_spec("iree") is not None)
    ]
    _check(_run(",".join(names), tmp_path, out_dir=True), names, tmp_path)
