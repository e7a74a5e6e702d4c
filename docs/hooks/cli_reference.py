"""MkDocs hook: tidy the command-line reference that ``mkdocs-click`` renders.

With click 8.2 and later an option without a default reports click's ``UNSET`` sentinel, which
``mkdocs-click`` prints as ``Sentinel.UNSET``; the reference shows an empty default instead.
"""

from __future__ import annotations

from typing import Any

PAGE = "reference/cli.md"
_UNSET = "<td><code>Sentinel.UNSET</code></td>"


def on_page_content(html: str, page: Any, **_: Any) -> str:
    """Blank the default cells that hold click's unset sentinel (MkDocs hook)."""
    if page.file.src_uri != PAGE:
        return html
    return html.replace(_UNSET, "<td></td>")
