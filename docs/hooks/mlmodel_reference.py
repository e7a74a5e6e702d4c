"""MkDocs hook: the MLmodel ``jaxexp`` section reference, generated from ``store/section.py``
(and the modules it re-exports its bounds and load-time-only keys from).

The page ``reference/mlmodel.md`` holds markers; at build time they are replaced by tables read
from the schema object's source: every field of ``FlavorSection`` (type, default, whether it is
written only when set, its ``#:`` or trailing comment), the ``MAX_*`` bounds and the
``python_function.config`` keys only the loader may set. The source is parsed, never imported,
so the docs build needs neither JAX nor MLflow.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path
from typing import Any

STORE = Path(__file__).resolve().parents[2] / "jaxexp_mlflow" / "store"
SECTION = STORE / "section.py"
#: the schema object, its ``MAX_*`` bounds and its ``python_function.config`` keys
SOURCES = (SECTION, STORE / "section_fields.py", STORE / "pyfunc_config.py")
PAGE = "reference/mlmodel.md"
MARKERS = {
    "<!-- jaxexp-section-fields -->": "fields",
    "<!-- jaxexp-section-bounds -->": "bounds",
    "<!-- jaxexp-section-load-time-only -->": "load_time_only",
}


def _comments(source: str) -> dict[int, str]:
    """Comment text by line number (``#:`` and ``#`` alike, the marker stripped)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").lstrip(":").strip()
    return out


def _doc_comment(comments: dict[int, str], lines: list[str], lineno: int) -> str:
    """The ``#:`` lines right above ``lineno`` and the comment at its end, joined."""
    above, n = [], lineno - 1
    while n >= 1 and lines[n - 1].lstrip().startswith("#:"):
        above.insert(0, comments[n])
        n -= 1
    trailing = comments.get(lineno, "") if "#" in lines[lineno - 1] else ""
    return " ".join(part for part in (*above, trailing) if part)


def _int_value(node: ast.AST) -> int | None:
    """The value of an integer literal or of ``a << b`` / ``a * b`` of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp):
        left, right = _int_value(node.left), _int_value(node.right)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.LShift):
            return left << right
        if isinstance(node.op, ast.Mult):
            return left * right
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(annotation: str) -> str:
    """``str | None`` -> ``str or None`` (a pipe would split the table's cell)."""
    return " or ".join(f"`{part.strip()}`" for part in annotation.split("|"))


def read_schema(paths: tuple[Path, ...] = SOURCES) -> dict[str, Any]:
    """The schema object's facts, read from its sources.

    Args:
        paths: ``store/section.py`` and the modules holding its bounds and config keys.

    Returns:
        ``fields`` (name, type, default or None when required, comment), ``when_set`` (the
            fields written only when set), ``bounds`` (name, value) and ``load_time_only``
            (key, environment variable or None).

    Raises:
        ValueError: the source no longer holds ``FlavorSection`` (the page would be empty).
    """
    facts: dict[str, Any] = {"fields": [], "when_set": set(), "bounds": [], "load_time_only": []}
    for path in paths:
        _read_source(path, facts)
    if not facts["fields"]:
        raise ValueError(f"{paths[0]}: no FlavorSection fields found")
    return facts


def _read_source(path: Path, facts: dict[str, Any]) -> None:
    """Add the facts one source file holds to ``facts``."""
    source = path.read_text(encoding="utf-8")
    tree, lines, comments = ast.parse(source), source.splitlines(), _comments(source)
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        name = target.id if isinstance(target, ast.Name) else None
        if name and name.startswith("MAX_") and _int_value(node.value) is not None:
            facts["bounds"].append((name, _int_value(node.value)))
        elif name == "_WRITTEN_WHEN_SET":
            facts["when_set"] = {
                n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant)
            }
        elif name == "PYFUNC_LOAD_TIME_ONLY":
            facts["load_time_only"] = list(ast.literal_eval(node.value).items())
        elif isinstance(node, ast.ClassDef) and node.name == "FlavorSection":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    default = None if item.value is None else ast.unparse(item.value)
                    facts["fields"].append(
                        (
                            item.target.id,
                            ast.unparse(item.annotation),
                            default,
                            _doc_comment(comments, lines, item.lineno),
                        )
                    )


def render(facts: dict[str, Any]) -> dict[str, str]:
    """The Markdown table for each marker kind."""
    rows = [
        "| field | type | when absent | written | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, annotation, default, doc in facts["fields"]:
        if name == "extra":
            written = "merged back unchanged"
            absent = "fields a newer writer added, kept as read"
            name_cell = "*(other keys)*"
        else:
            written = "only when set" if name in facts["when_set"] else "always"
            absent = "**required**" if default is None else f"`{default}`"
            name_cell = f"`{name}`"
        rows.append(f"| {name_cell} | {_type(annotation)} | {absent} | {written} | {_cell(doc)} |")
    bounds = ["| bound | value |", "| --- | --- |"]
    for name, value in facts["bounds"]:
        bounds.append(f"| `{name}` | {value:,} |")
    load = ["| key | or set by the environment variable |", "| --- | --- |"]
    for key, env in facts["load_time_only"]:
        load.append(f"| `{key}` | {f'`{env}`' if env else '(a load option only)'} |")
    return {
        "fields": "\n".join(rows),
        "bounds": "\n".join(bounds),
        "load_time_only": "\n".join(load),
    }


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Fill the markers of ``reference/mlmodel.md`` (MkDocs hook)."""
    if page.file.src_uri != PAGE:
        return markdown
    tables = render(read_schema())
    for marker, kind in MARKERS.items():
        if marker not in markdown:
            raise ValueError(f"{PAGE}: marker {marker} missing")
        markdown = markdown.replace(marker, tables[kind])
    return markdown
