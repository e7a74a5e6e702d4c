"""The docs site's generated MLmodel reference reads every field of the schema object."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from jaxexp_mlflow.store import section

HOOK = Path(__file__).resolve().parents[2] / "docs" / "hooks" / "mlmodel_reference.py"
_spec = importlib.util.spec_from_file_location("mlmodel_reference", HOOK)
hook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hook)


def test_every_field_of_the_schema_object_is_documented() -> None:
    facts = hook.read_schema()
    fields = {f.name: f for f in dataclasses.fields(section.FlavorSection)}
    assert [name for name, *_ in facts["fields"]] == list(fields)
    required = {name for name, _, default, _ in facts["fields"] if default is None}
    assert required == {
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    assert facts["when_set"] == set(section._WRITTEN_WHEN_SET)
    assert dict(facts["bounds"]) == {
        n: getattr(section, n)
        for n in dir(section)
        if n.startswith("MAX_") and n in dict(facts["bounds"])
    }
    assert {"MAX_BATCH", "MAX_DIM", "MAX_LEAVES"} <= dict(facts["bounds"]).keys()
    assert dict(facts["load_time_only"]) == section.PYFUNC_LOAD_TIME_ONLY


def test_the_page_gets_one_row_per_field() -> None:
    class Page:
        class file:  # noqa: N801  (MkDocs' page.file.src_uri)
            src_uri = hook.PAGE

    page = (HOOK.parent.parent / hook.PAGE).read_text()
    out = hook.on_page_markdown(page, Page())
    assert "<!--" not in out
    for f in dataclasses.fields(section.FlavorSection):
        if f.name != "extra":
            assert f"| `{f.name}` |" in out
    assert "| `exported_sha256` | `str` | **required** | always |" in out
    assert "| `route` | `dict[str, Any]` or `None` | `None` | only when set |" in out
