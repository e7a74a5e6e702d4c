"""The shipped tables: jaxlib releases and their build dates (``data/jaxlib_releases.json``)
and the kernel signatures each jax release runs (``data/kernel_abi.json``), with the
exporter's build date read from them (or bracketed from a bare blob's own fields).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from jaxexp_mlflow.codec.schema import (
    CALLING_CONVENTION_WRITTEN_UNTIL,
    SCHEMA_DATES,
    SERIALIZATION_FIELD_WRITTEN_FROM,
    SERIALIZATION_FIELD_WRITTEN_UNTIL,
)


@functools.lru_cache(maxsize=1)
def release_table() -> dict[str, Any]:
    """The shipped jaxlib release table (package data), parsed once."""
    text = resources.files("jaxexp_mlflow").joinpath("data/jaxlib_releases.json").read_text()
    return json.loads(text)


@functools.lru_cache(maxsize=1)
def kernel_abi_table() -> dict[str, Any]:
    """The shipped kernel-signature table (package data), parsed once."""
    text = resources.files("jaxexp_mlflow").joinpath("data/kernel_abi.json").read_text()
    return json.loads(text)


def _table_release(jax_version: str | None) -> str | None:
    """The release of the kernel table that stands for ``jax_version``: the newest one not
    newer than it (a jax newer than the table is judged as the newest release known)."""
    if not jax_version:
        return None
    key = version_key(jax_version)
    known = [v for v in kernel_abi_table()["releases"] if version_key(v) <= key]
    return max(known, key=version_key) if known else None


def _in_ranges(version: str, ranges: Sequence[Sequence[str]]) -> bool:
    key = version_key(version)
    return any(version_key(a) <= key <= version_key(b) for a, b in ranges)


def kernel_signatures(target: str, jax_version: str | None) -> list[dict[str, Any]] | None:
    """The signatures of ``target`` JAX's archive shows, each with ``runs`` (whether the release
    standing for ``jax_version`` still runs it); None if the table does not know the target."""
    rows = kernel_abi_table()["targets"].get(target)
    release = _table_release(jax_version)
    if rows is None or release is None:
        return None
    return [{**r, "runs": _in_ranges(release, r["releases"])} for r in rows]


def calling_convention_enforced(jax_version: str | None) -> bool | None:
    """Whether that jax refuses, when reading, a convention outside its stated range."""
    release = _table_release(jax_version)
    facts = kernel_abi_table()["calling_conventions"].get(release or "")
    return None if facts is None else bool(facts["enforced_on_read"])


@functools.lru_cache(maxsize=1024)  # a verdict compares the same few versions ~90 times
def version_key(version: str) -> tuple[int, ...]:
    """A version as a tuple of ints, for comparing (``'v0.4.31rc1'`` -> ``(0, 4, 31)``; ``()``
    when it starts with no number)."""
    nums = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(x) for x in nums.group(1).split(".")) if nums else ()


def release_date(version: str | None) -> dt.date | None:
    """Build date of a jaxlib version: from the table, or from a ``.devYYYYMMDD`` suffix."""
    if not version:
        return None
    entry = release_table()["releases"].get(version)
    if entry is None:
        base = re.sub(r"\+.*$", "", version)
        entry = release_table()["releases"].get(base)
    if entry is not None:
        return dt.date.fromisoformat(entry["date"])
    m = re.search(r"dev(\d{8})", version)
    if m:
        try:
            return dt.datetime.strptime(m.group(1), "%Y%m%d").date()
        except ValueError:
            return None
    return None


def _releases() -> list[tuple[str, dt.date]]:
    rows = release_table()["releases"].items()
    return [(v, dt.date.fromisoformat(e["date"])) for v, e in rows if not e.get("yanked")]


def newest_release_before(limit: dt.date) -> str | None:
    """The newest (non-yanked) jaxlib released on or before ``limit``."""
    best = [(d, version_key(v), v) for v, d in _releases() if d <= limit]
    return max(best)[2] if best else None


def oldest_release_after(limit: dt.date) -> str | None:
    """The oldest (non-yanked) jaxlib released on or after ``limit``."""
    best = [(d, version_key(v), v) for v, d in _releases() if d >= limit]
    return min(best)[2] if best else None


def exporter_dates(
    meta: Mapping[str, Any], description: Any = None
) -> tuple[str | None, dt.date | None, dt.date | None, list[str]]:
    """(version, earliest, latest, evidence) of the exporting jaxlib's build date.

    With a recorded ``jaxlib_version`` known to the table, earliest == latest. For bare blobs
    the date is bracketed from the blob's own signals; either bound may be ``None``.
    """
    version = meta.get("jaxlib_version")
    if version:
        d = release_date(version)
        return version, d, d, [f"jaxlib {version}"]
    evidence: list[str] = []
    lows: list[dt.date] = []
    highs: list[dt.date] = []
    schema = getattr(description, "schema_generation", None) or meta.get("schema_generation")
    if schema:
        known = [g for g in SCHEMA_DATES if g <= int(schema)]
        if known:
            lows.append(SCHEMA_DATES[max(known)])
            evidence.append(f"serialization schema {schema}")
    ser = meta.get("serialization_version") or getattr(description, "serialization_version", None)
    if ser is not None:
        until = SERIALIZATION_FIELD_WRITTEN_UNTIL.get(int(ser))
        if until and (d := release_date(until)):
            highs.append(d)
            evidence.append(f"serialization version field {ser}")
        elif int(ser) >= 3 and (d := release_date(SERIALIZATION_FIELD_WRITTEN_FROM[3])):
            lows.append(d)
            evidence.append(f"serialization version field {ser}")
    cc = meta.get("calling_convention_version")
    if cc is None:
        cc = getattr(description, "calling_convention_version", None)
    if cc is not None:
        until = CALLING_CONVENTION_WRITTEN_UNTIL.get(int(cc))
        if until and (d := release_date(until)):
            highs.append(d)
            evidence.append(f"calling convention {cc}")
    earliest = max(lows) if lows else None
    latest = min(highs) if highs else None
    if earliest and latest and latest < earliest:  # contradictory signals: trust the schema
        latest = None
    return None, earliest, latest, evidence


def iso_date(d: dt.date | None) -> str | None:
    """The date as ISO text (``None`` stays ``None``)."""
    return d.isoformat() if d else None
