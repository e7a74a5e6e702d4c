"""JAX's compatibility window between the build dates of the exporting and the running
jaxlib, and what jax >= 0.11.1 refuses outright: expired schemas and old-style (HLO)
shardings (codes ``jaxlib_unknown``, ``expired``, ``hlo_sharding``, ``window_backward``,
``window_forward``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from jaxexp_mlflow.codec.schema import (
    ENFORCING_JAX,
    OLDEST_SCHEMA_READ_BY_ENFORCING_JAX,
    SCHEMA_DATES,
)
from jaxexp_mlflow.runtime.compat.environment import EXPIRED_ENV, EXPIRED_FLAG, Environment
from jaxexp_mlflow.runtime.compat.releases import (
    exporter_dates,
    iso_date,
    newest_release_before,
    oldest_release_after,
    release_date,
    release_table,
    version_key,
)
from jaxexp_mlflow.runtime.compat.verdict import INCOMPATIBLE, WARN

#: JAX's compatibility window, between the build dates of the exporting and consuming jaxlib.
BACKWARD_WINDOW = dt.timedelta(days=183)  # 6 months


FORWARD_WINDOW = dt.timedelta(days=21)  # 3 weeks


def _months(delta: dt.timedelta) -> str:
    days = abs(delta.days)
    return f"{days} days" if days < 62 else f"{days / 30.44:.0f} months"


def judge_window(meta: Mapping[str, Any], description: Any, env: Environment, add: Any) -> dict:
    """The build-date window and what jax >= 0.11.1 refuses (``jaxlib_unknown``, ``expired``,
    ``hlo_sharding``, ``window_backward``, ``window_forward``); returns what is known of the
    exporter (``Verdict.exporter``)."""
    version, earliest, latest, evidence = exporter_dates(meta, description)
    exporter = {
        "jax_version": meta.get("jax_version"),
        "jaxlib_version": version,
        "build_date_earliest": iso_date(earliest),
        "build_date_latest": iso_date(latest),
        "evidence": evidence,
    }
    table_note = (
        "Update the table: upgrade jaxexp-mlflow, or run scripts/update_jaxlib_releases.py "
        "from its source tree."
    )
    if version and earliest is None:
        add(
            "jaxlib_unknown",
            WARN,
            f"The exporter's jaxlib {version} is not in the release table (of "
            f"{release_table().get('generated')}), so the 6-month/3-week window cannot be checked.",
            table_note,
        )
    here = release_date(env.jaxlib_version)
    if env.jaxlib_version and here is None:
        add(
            "jaxlib_unknown",
            WARN,
            f"This jaxlib {env.jaxlib_version} is not in the release table (of "
            f"{release_table().get('generated')}), so the 6-month/3-week window cannot be checked.",
            table_note,
        )
    enforcing = env.enforces_window
    if enforcing is None and env.jax_version:
        enforcing = version_key(env.jax_version) >= ENFORCING_JAX
    who = f"jaxlib {version}" if version else "the exporting jaxlib"
    when_latest = f"built {latest}" if version else f"built on or before {latest}"
    schema = getattr(description, "schema_generation", None) or meta.get("schema_generation")
    older_jax = _suggest_back(latest or earliest)
    refused = False
    hlo = hlo_shardings(description)
    if enforcing and schema and int(schema) < OLDEST_SCHEMA_READ_BY_ENFORCING_JAX:
        written = (
            f"serialization schema {schema} (written before "
            f"{SCHEMA_DATES[OLDEST_SCHEMA_READ_BY_ENFORCING_JAX]})"
        )
        if env.reads_expired and hlo:
            pass  # the flag opens the schema, not the shardings: hlo_sharding below refuses it
        elif env.reads_expired:
            add(
                "expired",
                WARN,
                f"The blob is of {written}; jax {env.jax_version} reads it only because "
                f"{EXPIRED_FLAG} is set, and a later jax may not read it at all.",
                "Refresh it now (jaxexp_mlflow.refresh / `jaxexp refresh`, with the same flag): "
                "the refreshed blob is of this jax's schema.",
            )
        elif hlo:  # the flag would not open it: see hlo_sharding below
            refused = True
            add(
                "expired",
                INCOMPATIBLE,
                f"The blob is of {written}; jax {env.jax_version} refuses it as older than its "
                "backward-compatibility window.",
                f"Run it with jax/jaxlib {older_jax} (`jaxexp verify --env-manager uv` uses the "
                "recorded environment) and refresh it there (`jaxexp refresh`).",
            )
        else:
            refused = True
            add(
                "expired",
                INCOMPATIBLE,
                f"The blob is of {written}; jax {env.jax_version} refuses it as older than its "
                "backward-compatibility window.",
                f"Read it with JAX's flag for expired blobs: set {EXPIRED_ENV}=1 in the "
                f"environment (or jax.config.update({EXPIRED_FLAG!r}, True)) and load it again, "
                "then refresh it (`jaxexp refresh`); or run it with jax/jaxlib "
                f"{older_jax} (`jaxexp verify --env-manager uv` uses the recorded environment).",
            )
    if enforcing and hlo:
        refused = True
        add(
            "hlo_sharding",
            INCOMPATIBLE,
            f"The blob gives {len(hlo)} sharding(s) in the old HLO form ({hlo[0]}); jax "
            f"{env.jax_version} reads only NamedSharding and refuses it, whatever its flags "
            f"({EXPIRED_FLAG} does not help).",
            f"Run it with jax/jaxlib {older_jax} (`jaxexp verify --env-manager uv` uses the "
            "recorded environment) and refresh it there (`jaxexp refresh`), or export the "
            "function again from its Python source.",
        )
    if here is None:
        return exporter
    if latest is not None and here - latest > BACKWARD_WINDOW and not refused:
        age = _months(here - latest)
        base = (
            f"{who} ({when_latest}) is {age} older than this jaxlib {env.jaxlib_version} "
            f"(built {here}): outside JAX's 6-month backward compatibility window"
            + (f" (estimated from {', '.join(evidence)})" if not version else "")
            + "."
        )
        add(
            "window_backward",
            WARN,
            base + " It may still run, but JAX no longer promises it.",
            "Refresh it now while this jax still reads it (jaxexp_mlflow.refresh(model_uri) "
            "or `jaxexp refresh`), which also checks it reproduces its reference outputs.",
        )
    if earliest is not None and earliest - here > FORWARD_WINDOW:
        age = _months(earliest - here)
        when = f"built {earliest}" if version else f"built on or after {earliest}"
        target = oldest_release_after(earliest - FORWARD_WINDOW)
        add(
            "window_forward",
            WARN,
            f"{who} ({when}) is {age} newer than this jaxlib {env.jaxlib_version} (built {here}): "
            "outside JAX's 3-week forward compatibility window; it may use features this "
            "jaxlib lacks.",
            f"Upgrade jax and jaxlib (pip install -U 'jaxlib>={target or version}' "
            "with the matching jax).",
        )
    return exporter


def hlo_shardings(description: Any) -> list[str]:
    """The blob's top-level shardings given only in the old HLO form (jax >= 0.11.1 refuses
    them); the reader prints those as HLO text and NamedShardings as ``NamedSharding(...)``."""
    found = [
        s
        for s in (
            *(getattr(description, "in_shardings", None) or ()),
            *(getattr(description, "out_shardings", None) or ()),
        )
        if s is not None and not str(s).startswith("NamedSharding")
    ]
    return found


def _suggest_back(exported_on: dt.date | None) -> str:
    """Which jax/jaxlib to install to read a blob built on ``exported_on`` (outside the window)."""
    last_lenient = newest_release_before(
        (release_date(".".join(map(str, ENFORCING_JAX))) or dt.date.max) - dt.timedelta(days=1)
    )
    lenient = f"=={last_lenient} (the newest release that does not enforce the window)"
    if exported_on is None:
        return lenient if last_lenient else "of the exporter's era"
    v = newest_release_before(exported_on + BACKWARD_WINDOW)
    if v is None or v == last_lenient:
        return lenient if last_lenient else "of the exporter's era"
    inside = f"=={v} (the newest release JAX guarantees to read it)"
    return f"{inside} or {lenient}" if last_lenient else inside


def window_closes(exporter: Mapping[str, Any]) -> tuple[dt.date | None, str]:
    """When JAX's 6-month backward window of a blob closes, from ``Verdict.exporter``.

    Returns ``(date, how)``: ``how`` is ``"exact"`` (known exporter build date), ``"by"`` (a bare
    blob built on or before a date: the window closes by then at the latest), ``"after"`` (only
    a lower bound is known) or ``"unknown"`` (``date`` is None).
    """
    earliest, latest = exporter.get("build_date_earliest"), exporter.get("build_date_latest")
    if earliest and latest and earliest == latest:
        return dt.date.fromisoformat(latest) + BACKWARD_WINDOW, "exact"
    if latest:
        return dt.date.fromisoformat(latest) + BACKWARD_WINDOW, "by"
    if earliest:
        return dt.date.fromisoformat(earliest) + BACKWARD_WINDOW, "after"
    return None, "unknown"
