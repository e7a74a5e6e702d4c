"""MkDocs hook: the environment variable reference, generated from ``jaxexp_mlflow/settings.py``.

The page ``reference/environment.md`` holds a marker; at build time it is replaced by one table
per group of the registry (name, type, default, when it is read, description). ``settings.py``
imports only the standard library and is loaded here by its file path, so neither the package's
``__init__`` nor JAX or MLflow is imported: the docs build needs none of them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

SETTINGS = Path(__file__).resolve().parents[2] / "jaxexp_mlflow" / "settings.py"
PAGE = "reference/environment.md"
MARKER = "<!-- jaxexp-env-vars -->"
_NAME = "_jaxexp_settings_for_docs"


def load_settings(path: Path = SETTINGS) -> ModuleType:
    """``jaxexp_mlflow/settings.py`` loaded by its path, apart from the package.

    Args:
        path: the registry module's file.

    Returns:
        The module object.
    """
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module  # while it runs, as an import would
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(_NAME, None)
    return module


def _size(value: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f"{value >> shift} {unit} (`{value}`)"
    return f"`{value:_}`".replace("_", " ") if value >= 10_000 else f"`{value}`"


def _default(var: Any) -> str:
    value = var.default
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and var.name.endswith("_BYTES"):
        return _size(value)
    if isinstance(value, int):
        return _size(value) if value >= 10_000 else f"`{value}`"
    return f"`{value}`"


def _type(var: Any) -> str:
    name = "path" if var.type is Path or var.type.__name__ == "Path" else var.type.__name__
    if var.type is bool:
        off = ", ".join(f"`{w}`" for w in var.off if w) or "nothing"
        return f"bool (off: {off})"
    return name


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(settings: ModuleType) -> str:
    """The Markdown of the reference: one section and table per group, in registry order.

    Args:
        settings: the loaded registry module.

    Returns:
        Markdown text.
    """
    parts = []
    for group, title in settings.GROUPS.items():
        rows = [v for v in settings.REGISTRY.values() if v.group == group]
        if not rows:
            continue
        parts.append(f"## {title}\n")
        parts.append("| Variable | Type | Default | Read | Description |")
        parts.append("| --- | --- | --- | --- | --- |")
        for var in rows:
            read = "at import" if var.import_time else "per use"
            parts.append(
                f"| `{var.name}` | {_type(var)} | {_default(var)} | {read} | "
                f"{_cell(var.description)} |"
            )
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Fill the reference page's marker with the registry's tables."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE}: the marker {MARKER} is missing")
    return markdown.replace(MARKER, render(load_settings()))
