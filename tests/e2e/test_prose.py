"""scripts/check_prose.py: what it finds and what it leaves alone, on sample strings."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_prose.py"
_spec = importlib.util.spec_from_file_location("check_prose", SCRIPT)
check_prose = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_prose)


def rules(text: str, kind: str = "md") -> list[str]:
    return [name for _, name, _ in check_prose.findings(text, kind)]


@pytest.mark.parametrize(
    "line, rule",
    [
        ("Measured in the second session on an idle VM.", "session"),
        ("The twenty-fourth session reran it.", "session"),
        ("the forty-third found the rehearsal red", None),  # no "session": not this rule
        ("As this session showed, the load is faster.", "session"),
        ("Rerun in the same session, then in the next session.", "session"),
        ("After last session's changes the save is faster.", "session"),
        ("Since session 40 the MLmodel records a sha256.", "session"),
        ("sessions 37-43 had no GPU", "session"),
        ("Done at 21:18 UTC on an idle machine.", "clock time"),
        ("06:40-07:09 UTC (2-core VM)", "clock time"),
        ("This went away with issue 26.", "issue"),
        ("issues 4, 11, 26 and 27", "issue"),
        ("see #39 for the numbers", "issue"),
        ("Asked by the lead, the README keeps one run.", "the lead"),
        ("Measured on 2026-11-26 on the shared VM.", "date"),
    ],
)
def test_finds_process_talk(line: str, rule: str | None) -> None:
    assert rules(line) == ([rule] if rule else [])


@pytest.mark.parametrize(
    "line",
    [
        "Spark sessions run the UDF on every executor.",
        "The active SparkSession is used; a session is created when none exists.",
        "One HTTP session per thread (`requests.Session`), reused for every part.",
        "The server keeps a session open while the stream runs.",
        "The lead dimension is the batch; the leading axis is split.",
        "Headings link as [saving](saving.md#3-params), a `#1` in code.",
        "expired-flag (closes 2027-05-20): refresh before then.",
        "schema < 10 is to be removed six months after 2026-04-04",
        "jaxexp audit --as-of 2027-03-01",
        "JAX's 6-month window: for schema < 10, any jax after 2026-10-04 may drop its layout",
        "float32[b,784] and 12:30 without a zone",
        "a model at version 3.17.2",
    ],
)
def test_leaves_product_text_alone(line: str) -> None:
    assert rules(line) == []


def test_dates_and_times_count_in_prose_only() -> None:
    md = "Pasted output:\n\n```\nCreated 2026-11-22 03:03:41 UTC\n```\n\nRun on 2026-11-26.\n"
    assert [(n, r) for n, r, _ in check_prose.findings(md, "md")] == [(7, "date")]
    py = (
        '"""Measured 2026-11-26."""\n'
        'WHEN = "2026-11-26"\n'
        'TEXT = f"built on {WHEN}, opened 2026-01-02"\n'
        "# rerun at 02:41 UTC\n"
        'NOTE = "issue 39"\n'
    )
    assert [(n, r) for n, r, _ in check_prose.findings(py, "py")] == [
        (1, "date"),
        (4, "clock time"),
        (5, "issue"),
    ]


def test_pragma_skips_a_line() -> None:
    assert rules("a sample: the third session  <!-- prose: ok -->") == []


def test_cli_prints_file_line_text_and_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.md"
    bad.write_text("# Title\n\nAll good here.\nFixed in issue 12.\n")
    good = tmp_path / "good.md"
    good.write_text("Spark sessions and HTTP sessions are product words.\n")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(bad), str(good)], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert run.stdout.splitlines() == [f"{bad}:4:Fixed in issue 12."]
    run = subprocess.run([sys.executable, str(SCRIPT), str(good)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout == ""


def test_default_files_exempt_generated_output(tmp_path: Path) -> None:
    for rel in ("README.md", "BENCHMARKS.md", "docs/a.md", "benchmarks/results/x.py", "tests/t.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run.sh").write_text("")
    (tmp_path / "examples").mkdir()
    got = {p.relative_to(tmp_path).as_posix() for p in check_prose.default_files(tmp_path)}
    assert got == {"README.md", "docs/a.md", "tests/t.py", "scripts/run.sh"}
