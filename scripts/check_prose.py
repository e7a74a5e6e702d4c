"""Find text that tells how the project was made instead of what the product does.

Scans the docs, the package, the tests, the benchmarks, the examples and the scripts for
process talk: an ordinal or deictic "session" ("second session", "this session", "session 45"),
a clock time followed by UTC, an issue reference ("issue 12", "#12"), "the lead", and ISO dates
in prose. Product words are left alone: Spark sessions, HTTP sessions, ``requests.Session``,
``SparkSession``, and "session" without an ordinal or deictic word before it or a number after it.

Dates and clock times count in prose only: Markdown outside fenced blocks, Python comments and
docstrings. Generated output is exempt: ``BENCHMARKS.md`` and ``benchmarks/results/`` carry
their run date. A line holding ``prose: ok`` is skipped.

Usage: ``python scripts/check_prose.py [PATH ...]`` (default: the whole repository). Prints
``file:line:text`` for every finding and exits 1 when there is one.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_ORDINALS = (
    "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth "
    "thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth "
    "thirtieth fortieth fiftieth sixtieth seventieth eightieth ninetieth hundredth"
).split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
_ORDINAL = (
    r"(?:(?:" + "|".join(_TENS) + r")[- ]?(?:" + "|".join(_ORDINALS[:9]) + r")"
    r"|" + "|".join(_ORDINALS) + r"|\d+(?:st|nd|rd|th))"
)
#: Words that, before "session", point at one session of work rather than a product session.
_DEICTIC = "this that last previous next same earlier later prior".split()
_BEFORE_SESSION = r"(?:" + _ORDINAL + r"|" + "|".join(_DEICTIC) + r")"
#: A date on a line with one of these words is a product fact (a route's closing date, a
#: compatibility window, a deprecation schedule, an ``--as-of`` argument), not a work log.
_PRODUCT_DATE = re.compile(
    r"\b(?:closes?|closed|closing|built|expir\w*|deprecat\w*|remov\w*|as[-_ ]of|releas\w*|written|"
    r"schedule\w*|window)\b",
    re.I,
)
#: A line carrying this marker is skipped (a sample of process talk, e.g. in a test).
PRAGMA = "prose: ok"

#: (name, pattern): each pattern is searched in one line of text.
RULES: list[tuple[str, re.Pattern[str]]] = [
    (
        "session",
        re.compile(r"\b" + _BEFORE_SESSION + r"(?:'s)?\s+(?:work\s+)?sessions?\b", re.I),
    ),
    ("session", re.compile(r"\bsessions?\s+(?:#\s*)?\d+", re.I)),
    ("clock time", re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s*[-–]\s*\d{1,2}:\d{2})?\s*UTC\b")),
    ("issue", re.compile(r"\bissues?\s+#?\d+", re.I)),
    ("issue", re.compile(r"(?<![\w&/#\"'`-])#\d+\b")),
    ("the lead", re.compile(r"\bthe\s+lead\b(?!\s*(?:-|time|dimension|axis|byte|bytes)\b)", re.I)),
    # a date in prose; one quoted as data (``"2026-01-31"``) is left to the date rule's filter
    ("date", re.compile(r"(?<![\w.-])(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")),
]
_QUOTED_DATE = re.compile(r"[\"']\d{4}-\d\d-\d\d[\"']")

#: Suffixes of the files scanned (``examples/`` and ``scripts/``: every text file).
_TEXT_SUFFIXES = {".md", ".py", ".sh", ".txt", ".toml", ".yml", ".yaml", ".cfg", ".ini", ""}
#: Generated output, allowed to carry the date it was made; the checker and its test, which
#: hold the patterns and samples of what they find.
_EXEMPT = (
    "BENCHMARKS.md",
    "benchmarks/results/",
    "scripts/check_prose.py",
    "tests/e2e/test_prose.py",
)


#: Rules that apply to prose lines only: a date or a clock time in code, in a string that is
#: data or in pasted command output (a fenced block) is what the product prints or reads.
_PROSE_ONLY = {"date", "clock time"}


def findings(text: str, kind: str = "md") -> Iterator[tuple[int, str, str]]:
    """Every line of ``text`` that holds process talk.

    Args:
        text: the file's text.
        kind: ``"md"`` (Markdown: fenced code blocks are not prose), ``"py"`` (Python: comments
            and docstrings are prose) or ``"text"`` (every line is prose).

    Returns:
        An iterator of ``(line number, rule name, line)``, line numbers from 1.
    """
    prose = _prose_lines(text, kind)
    for number, line in enumerate(text.splitlines(), start=1):
        if PRAGMA in line:
            continue
        for name, pattern in RULES:
            if name in _PROSE_ONLY and prose is not None and number not in prose:
                continue
            if pattern.search(line) and not (name == "date" and _product_date(line)):
                yield number, name, line
                break


def _product_date(line: str) -> bool:
    """Whether every date on ``line`` is data or a product fact rather than a work log."""
    return bool(_PRODUCT_DATE.search(line)) or (
        len(_QUOTED_DATE.findall(line)) == len(RULES[-1][1].findall(line))
    )


def _prose_lines(text: str, kind: str) -> set[int] | None:
    """The numbers of the lines of ``text`` that are prose (None: every line)."""
    if kind == "md":
        out, fenced = set(), False
        for number, line in enumerate(text.splitlines(), start=1):
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            elif not fenced:
                out.add(number)
        return out
    if kind != "py":
        return None
    try:
        tree = ast.parse(text)
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (SyntaxError, tokenize.TokenError, ValueError):
        return None
    out = {t.start[0] for t in tokens if t.type == tokenize.COMMENT}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            out.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return out


def _kind(path: Path) -> str:
    return {".md": "md", ".py": "py"}.get(path.suffix, "text")


def _exempt(rel: str) -> bool:
    return any(rel == e or rel.startswith(e) for e in _EXEMPT)


def default_files(root: Path = ROOT) -> list[Path]:
    """The files the repository-wide check reads.

    Args:
        root: the repository root.

    Returns:
        README.md and the other Markdown files at the root, ``docs/**/*.md``,
            ``jaxexp_mlflow/**/*.py``, ``tests/**/*.py``, ``benchmarks/**/*.py`` and every text
            file under ``examples/`` and ``scripts/``, less the generated ones.
    """
    out: list[Path] = sorted(root.glob("*.md"))
    out += sorted(root.glob("docs/**/*.md"))
    for folder in ("jaxexp_mlflow", "tests", "benchmarks"):
        out += sorted(root.glob(f"{folder}/**/*.py"))
    for folder in ("examples", "scripts"):
        out += sorted(
            p for p in (root / folder).rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES
        )
    return [p for p in out if not _exempt(p.relative_to(root).as_posix())]


def check(paths: Iterable[Path], root: Path = ROOT) -> list[str]:
    """The findings in ``paths``, as ``file:line:text`` lines.

    Args:
        paths: the files to read (undecodable bytes are replaced, not fatal).
        root: the folder the printed paths are relative to.

    Returns:
        One ``file:line:text`` string per finding, in file order.
    """
    out = []
    for path in paths:
        try:
            shown = path.resolve().relative_to(root).as_posix()
        except ValueError:
            shown = str(path)
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, _, line in findings(text, _kind(path)):
            out.append(f"{shown}:{number}:{line.strip()}")
    return out


def main(argv: list[str]) -> int:
    """Print the findings of the files named in ``argv`` (default: the repository)."""
    paths = [Path(a) for a in argv] if argv else default_files()
    found = check(paths)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
