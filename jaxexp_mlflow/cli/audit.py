"""``jaxexp audit``: sweep a registry or experiments; each model's verdict, its window, and
what to refresh first.

For every jaxexp model in scope only MLmodel and the blob are fetched (never params), the
verdict is reached as ``jaxexp check`` reaches it, and the date JAX's 6-month backward window
closes is computed from the exporter's jaxlib build date (bracketed for bare blobs). Models are
then ranked: those that run here and whose window has closed or closes within a month come
first ("refresh now"), then those JAX still runs but no longer promises (older calling
convention, window past), then "refresh soon" (within 3 months); models that cannot be
refreshed here say where they can be (another platform, more devices, an older jax) or that
they must be exported again from source (kernels gone or changed). A blob jax >= 0.11.1 reads
only with its expired-versions flag is "refresh now with JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS=1"
(run the refresh with the flag set); one with old-style shardings, which no flag helps, is
"refresh with an older jax".
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import click

from jaxexp_mlflow.cli._common import (
    Command,
    InputProblem,
    common_options,
    emit_json,
    one_line,
    progress_enabled,
    safe_text,
    setup_logging,
    table,
)
from jaxexp_mlflow.runtime.compat import EXPIRED_ENV  # jax-free

NOW_DAYS, SOON_DAYS = 31, 92
#: Verdict codes a refresh cannot fix: the module itself calls kernels this jaxlib lacks.
_SOURCE_ONLY = {"custom_calls", "kernel_abi"}
#: Codes a refresh fixes if it runs somewhere else (the right machine or an older jax).
_ELSEWHERE = {
    "platform": "on a machine of the exported platform",
    "devices": "with enough devices",
    "calling_convention": "with an older jax that reads it",
    "schema": "with a newer jax",
    "expired": f"with {EXPIRED_ENV}=1",
    "hlo_sharding": "with an older jax (its recorded environment: --env-manager uv)",
    "window_backward": "with an older jax that still reads it",
}


@dataclass
class Row:
    """One model of the sweep."""

    uri: str
    name: str
    version: str | None = None
    model_id: str | None = None
    jax_version: str | None = None
    status: str = "error"
    codes: list[str] = field(default_factory=list)
    window_closes: str | None = None
    window: str = "unknown"
    months_left: float | None = None
    action: str = ""
    priority: int = 9
    rank: int | None = None
    reasons: list[str] = field(default_factory=list)
    #: the routes that run the model here (``runtime.routes.plan``), each with when it closes
    routes: list[dict] = field(default_factory=list)


def plan(
    status: str, codes: list[str], closes: dt.date | None, as_of: dt.date, how: str = "exact"
) -> tuple[int, str]:
    """(priority, action) of one model: lower priority numbers come first. ``how`` qualifies
    ``closes`` as ``compat.window_closes`` does (an ``"after"`` date is only a lower bound)."""
    if status == "incompatible":
        blocking = set(codes) - {"window_backward", "jaxlib_unknown", "window_forward"}
        if blocking & _SOURCE_ONLY:
            return 1, "export again from source (its kernels are gone or changed)"
        if blocking == {"expired"}:  # this jax reads it with its flag: refresh it here, now
            return 0, f"refresh now with {EXPIRED_ENV}=1" + _closed(closes, as_of, how)
        if "hlo_sharding" in blocking:  # no flag helps: only an older jax reads it
            return 2, "refresh with an older jax (its recorded environment: --env-manager uv)"
        where = [_ELSEWHERE[c] for c in codes if c in _ELSEWHERE]
        return 2, "refresh " + (where[0] if where else "elsewhere") + " before the window closes"
    if closes is None:
        return 3, "refresh soon (window unknown)"
    left = (closes - as_of).days
    if left <= NOW_DAYS or "calling_convention" in codes:
        return 0, "refresh now" + _closed(closes, as_of, how)
    if left <= SOON_DAYS:
        return 3, "refresh soon"
    return 5, "ok"


def _closed(closes: dt.date | None, as_of: dt.date, how: str) -> str:
    """`` (window closed)`` (or ``may have closed`` for a lower bound) once it has, else ''."""
    if closes is None or closes >= as_of:
        return ""
    return " (window " + ("may have " if how == "after" else "") + "closed)"


def _pages(search: Any, **kwargs: Any) -> list:
    """Every result of an MLflow ``search_*`` call (they return one page at a time), at most
    ``JAXEXP_MAX_LIST_ENTRIES`` of them and no page token twice: a tracking server that pages
    without end is refused (``InputProblem``), not followed."""
    from jaxexp_mlflow.store.transfer import list_limits

    limit = list_limits()[1]
    out, token, seen = [], None, set()
    while True:
        page = search(**kwargs, page_token=token)
        out.extend(page)
        token = getattr(page, "token", None)
        if not token:
            return out
        if len(out) > limit or token in seen:
            raise InputProblem(
                f"the tracking server's {getattr(search, '__name__', 'search')} answered more "
                f"than {limit} results or the same page twice: expected a list with an end. The "
                "server is broken or hostile; raise JAXEXP_MAX_LIST_ENTRIES if the registry "
                "really holds that many."
            )
        seen.add(token)


def name_filter(name: str) -> str:
    """An MLflow filter string selecting the versions of the registered model ``name``.

    MLflow's filter syntax has no escape inside a quoted string: a name holding ``'`` is quoted
    with ``"``; one holding both quotes is matched by ``LIKE`` with ``_`` (any one character)
    in place of each quote, backslash and wildcard, which may select other names too: callers
    keep exact matches only.
    """
    if "'" not in name:
        return f"name='{name}'"
    if '"' not in name:
        return f'name="{name}"'
    pattern = "".join("_" if ch in "'\"\\%_" else ch for ch in name)
    return f"name LIKE '{pattern}'"


def _registry(client: Any, only: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(uri, row fields) of every version of the registered models ``only`` (default: all).
    A model whose versions cannot be listed is one row carrying the error; the sweep goes on."""
    names = only or tuple(m.name for m in _pages(client.search_registered_models))
    for name in only:  # a name asked for that the registry lacks: as --experiment's, refused
        try:
            client.get_registered_model(name)
        except Exception as err:  # noqa: BLE001 - MLflow's RESOURCE_DOES_NOT_EXIST
            if getattr(err, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
                import mlflow

                raise InputProblem(
                    f"no registered model named {name!r} in {mlflow.get_tracking_uri()}"
                ) from None
    for name in names:
        try:
            versions = _pages(client.search_model_versions, filter_string=name_filter(name))
        except Exception as err:  # noqa: BLE001 - one unlistable model must not stop the sweep
            yield f"models:/{name}", {"name": name, "error": one_line(err)}
            continue
        versions = [v for v in versions if v.name == name]
        for mv in sorted(versions, key=lambda v: int(v.version)):
            yield (
                f"models:/{name}/{mv.version}",
                {"name": name, "version": str(mv.version), "model_id": mv.model_id},
            )


def _experiments(names: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    import mlflow

    ids = []
    for name in names:
        exp = mlflow.get_experiment_by_name(name) or (
            mlflow.get_experiment(name) if name.isdigit() else None
        )
        if exp is None:
            raise InputProblem(f"no experiment named {name!r} in {mlflow.get_tracking_uri()}")
        ids.append(exp.experiment_id)
    for m in _pages(mlflow.MlflowClient().search_logged_models, experiment_ids=ids):
        yield f"models:/{m.model_id}", {"name": m.name, "model_id": m.model_id}


def audit_one(uri: str, info: dict, as_of: dt.date) -> Row | None:
    """The row of one model, or None if it is not a jaxexp model."""
    from jaxexp_mlflow.cli.check import assess_target
    from jaxexp_mlflow.cli.uri import resolve
    from jaxexp_mlflow.runtime import compat

    info = dict(info)
    listing_error = info.pop("error", None)
    row = Row(uri=uri, **info)
    if listing_error:
        row.action, row.reasons = "fix the model (cannot be listed)", [listing_error]
        return row
    target = None
    try:
        target = resolve(uri, parts=())
        verdict, _ = assess_target(target)
    except Exception as err:  # noqa: BLE001 - one broken model must not stop the sweep
        if isinstance(err, InputProblem) and "without the jaxexp flavor" in str(err):
            return None
        reason = one_line(err)
        if target is not None and target.remote:  # the download's directory: say the URI
            reason = reason.replace(str(target.path), uri)
        row.action, row.reasons = "fix the model (cannot be read)", [reason]
        return row
    row.jax_version = target.flavor.get("jax_version")
    row.status, row.codes = verdict.status, verdict.codes()
    row.reasons = [str(r) for r in verdict.reasons]
    closes, how = compat.window_closes(verdict.exporter)
    if closes is not None:
        row.window_closes, row.window = closes.isoformat(), how
        row.months_left = round((closes - as_of).days / 30.44, 1)
    row.priority, row.action = plan(row.status, row.codes, closes, as_of, how)
    here = (verdict.environment or {}).get("jax_version")
    if row.action.startswith("refresh now") and row.jax_version and row.jax_version == here:
        # a refresh here re-exports with the jax that wrote it: the same window
        row.action = row.action.replace("refresh now", "refresh now with a newer jax", 1)
    try:
        row.routes = _routes(target, verdict, uri)
    except Exception as err:  # noqa: BLE001 - the verdict stands without its routes
        row.reasons.append(f"routes not planned: {one_line(err)}")
    return row


def _routes(target: Any, verdict: Any, uri: str) -> list[dict]:
    """The working routes of the target (``runtime.routes.plan``), JSON-able, in order."""
    from jaxexp_mlflow.cli.check import blob_meta
    from jaxexp_mlflow.runtime import routes

    desc = target.description  # parsed once, by assess_target
    meta = target.flavor or blob_meta(desc)
    return [r.to_dict() for r in routes.plan(verdict, meta, desc, uri=uri)]


def _route_text(r: Row) -> str:
    """``expired-flag (closes 2027-05-20)``: the first working route and when it closes."""
    if not r.routes:
        return "none here"
    first = r.routes[0]
    who = f" jax {first['jax_version']}" if first.get("jax_version") else ""
    return f"{first['name']}{who} (closes {first.get('closes_on') or 'no known date'})"


def _closes_text(r: Row) -> str:
    if r.window_closes is None:
        return "unknown"
    prefix = {"by": "by ", "after": "after "}.get(r.window, "")
    return prefix + r.window_closes


@click.command(
    cls=Command,
    epilog="""\b
Examples:
  jaxexp audit                          # every version of every registered model
  jaxexp audit --model classifier --json
  jaxexp audit --experiment training --experiment archive
  jaxexp audit --as-of 2027-03-01       # what will need a refresh by then
""",
)
@click.option("--experiment", "experiments", multiple=True, help="Sweep this experiment's models.")
@click.option("--model", "models", multiple=True, help="Only this registered model (repeatable).")
@click.option(
    "--as-of",
    type=click.DateTime(formats=["%Y-%m-%d"]),
    default=None,
    help="Judge the windows as of this date (default: today).",
)
@common_options
def audit(
    experiments: tuple[str, ...],
    models: tuple[str, ...],
    as_of: dt.datetime | None,
    as_json: bool,
    debug: bool,
) -> None:
    """Every model's verdict, the months left in its window, and what to refresh first.

    Sweeps the registered models (every version; --model to narrow) or, with --experiment, the
    logged models of those experiments. Only MLmodel and the blob of each are downloaded.
    Prints a table ranked by urgency (or --json); progress goes to stderr on a terminal only.
    Exits 0 when the sweep ran, whatever it found; 2 if the scope cannot be read.
    """
    setup_logging(debug)
    import mlflow

    day = as_of.date() if as_of else dt.date.today()
    if experiments:
        scope = f"experiments {', '.join(experiments)}"
        found = list(_experiments(experiments))
    else:
        scope = "registry" + (f" (models {', '.join(models)})" if models else "")
        found = list(_registry(mlflow.MlflowClient(), models))
    rows: list[Row] = []
    if progress_enabled() and found:
        with click.progressbar(found, label="Auditing", file=sys.stderr) as bar:
            rows = [r for uri, info in bar if (r := audit_one(uri, info, day))]
    else:
        rows = [r for uri, info in found if (r := audit_one(uri, info, day))]
    rows.sort(key=lambda r: (r.priority, r.window_closes or "9999", r.uri))
    for i, r in enumerate(rows, 1):
        r.rank = i
    counts: dict[str, int] = {}
    for r in rows:
        key = r.action.split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    if as_json:
        emit_json(
            {
                "scope": scope,
                "tracking_uri": mlflow.get_tracking_uri(),
                "as_of": day.isoformat(),
                "models": [asdict(r) for r in rows],
                "summary": counts,
            }
        )
        return
    click.echo(f"Audit of {scope} as of {day} ({len(rows)} jaxexp model(s))")
    click.echo("")
    cells = [
        [
            r.rank,
            f"{r.name}/{r.version}" if r.version else f"{r.name} ({r.model_id})",
            r.jax_version or "bare blob",
            r.status,
            _closes_text(r),
            "" if r.months_left is None else f"{r.months_left:+.1f}",
            _route_text(r),
            r.action,
        ]
        for r in rows
    ]
    heads = ["#", "model", "logged by jax", "verdict", "window closes", "months", "route"]
    click.echo(table([*heads, "action"], cells))
    broken = [r for r in rows if r.action.startswith("fix the model") and r.reasons]
    if broken:  # why a model cannot be read or listed: the table has no room for it
        click.echo("")
        for r in broken:
            reason = safe_text(" ".join(str(r.reasons[0]).split()))
            click.echo(f"#{r.rank}: {reason if len(reason) <= 300 else reason[:297] + '...'}")
    if counts:
        click.echo("")
        click.echo("Summary: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
