"""Routes: the ways a model runs here when this JAX cannot simply load it, in order.

From the compatibility verdict (``compat.assess``), the blob's description (jax-free reader)
and the model's recorded facts, :func:`plan` names the routes that work here, each a
:class:`Route` saying what to pass or run and when it closes:

``direct``        this process, as is (the verdict is not ``incompatible``)
``expired-flag``  this process, with JAX's ``jax_export_deserialize_expired_versions`` set around
                  the deserialization only (jax >= 0.11.1, a blob of schema < 5 and nothing else
                  blocking); :func:`expired_flag` is that scope
``bridge``        a JAX that reads the old serialization (jax ``BRIDGE_JAX``, in a cached venv)
                  re-exports the blob into one this JAX reads, which then runs here (old-style
                  HLO shardings become ``NamedSharding``; the module is kept, so not for a blob
                  calling kernels this jaxlib lacks)
``recorded-env``  the whole model run by the writer's JAX: the recorded ``jax_version``, else the
                  era inferred from the blob (:func:`era`), in a cached venv
``iree``          the IREE backend, when its own verdict says it compiles the module
``remesh``        fewer devices than the blob's ``nr_devices``: its meshes resized to the devices
                  here, in this process (``runtime.remesh``); taken only when asked
``virtual-devices`` fewer devices, a module that cannot be re-meshed: the blob as it is, on
                  ``nr_devices`` simulated CPU devices in a child process of this Python

The closing dates come from JAX itself: its 6-month backward window (a promise, not enforced),
the TODOs of ``jax/_src/export/serialization.py`` in jax 0.12 (the per-argument layout of schema
< 10 is to be removed six months after 2026-04-04; a minimum-schema check is planned after
2027-01-27; the expired-versions flag is temporary), and which releases still run a blob's
kernels (``data/kernel_abi.json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.runtime import compat
from jaxexp_mlflow.runtime.device_routes import REMESH as REMESH
from jaxexp_mlflow.runtime.device_routes import VIRTUAL_DEVICES as VIRTUAL_DEVICES

_logger = logging.getLogger(__name__)

DIRECT, EXPIRED_FLAG, BRIDGE, RECORDED_ENV, IREE = (
    "direct",
    "expired-flag",
    "bridge",
    "recorded-env",
    "iree",
)
ROUTES = (DIRECT, EXPIRED_FLAG, BRIDGE, RECORDED_ENV, IREE, REMESH, VIRTUAL_DEVICES)
#: The bridge: deserializes every blob of the shared corpus (jax 0.4.35 to 0.10.2, HLO shardings
#: included) and has wheels for Python 3.11 to 3.13.
BRIDGE_JAX = "0.10.2"
#: The first jax without wheels for Python 3.11 (jax 0.11 and later need Python >= 3.12).
NEEDS_PYTHON_312 = (0, 11)
#: jax 0.12's serialization.py: "remove 6 months after 4/4/26" (reading schema < 10's layout).
OLD_LAYOUT_UNTIL = dt.date(2026, 10, 4)
OLD_LAYOUT_SCHEMA = 10
#: jax 0.12's serialization.py: a minimum serialization version "after 1/27/2027".
MINIMUM_SCHEMA_CHECK = dt.date(2027, 1, 27)
#: Reasons a re-export in the bridge fixes (it reads them; this jax reads what it writes).
_BRIDGE_FIXES = {"expired", "hlo_sharding", "calling_convention", "window_backward"}
#: Reasons no route changes (they concern this machine, not the blob's era).
_MACHINE = {"platform", "devices"}
#: How a route without a known closing date starts its ``closes`` text.
NO_DATE = "no known date"


@dataclass(frozen=True)
class Route:
    """One way to run the model here: ``name`` (one of ``ROUTES``), the JAX that reads the
    blob on it, what to pass or run (``how``), and when it closes (``closes``, with
    ``closes_on`` where a date is known)."""

    name: str
    jax_version: str | None
    how: str
    closes: str
    closes_on: dt.date | None = None
    source: str = ""  # recorded-env: "recorded" or "inferred from the blob"

    def __post_init__(self) -> None:
        # every route states when it closes: a date, or that none is known
        if self.closes_on is None and not self.closes.startswith(NO_DATE):
            object.__setattr__(self, "closes", f"{NO_DATE}; {self.closes}")

    def __str__(self) -> str:
        who = f" (jax {self.jax_version})" if self.jax_version else ""
        return f"{self.name}{who}: {self.how} Closes: {self.closes}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        d = dataclasses.asdict(self)
        d["closes_on"] = self.closes_on.isoformat() if self.closes_on else None
        return d


# -- the writer's era -----------------------------------------------------------------------------


def _kernel_calls(meta: Mapping[str, Any], description: Any) -> list[tuple[str, int]]:
    """(target, operand count or -1) of the CPU kernels the module calls."""
    calls = getattr(description, "custom_calls", None)
    if calls:
        found = [(str(t), int(o)) for t, o, _ in calls]
    else:
        targets = meta.get("custom_call_targets") or getattr(
            description, "custom_call_targets", None
        )
        found = [(str(t), -1) for t in targets or ()]
    return [(t, n) for t, n in found if compat.target_platform(t) == "cpu"]


def _runs_kernels(release: str, calls: list[tuple[str, int]]) -> bool:
    for target, n_ops in calls:
        sigs = compat.kernel_signatures(target, release)
        if sigs is None:
            return False
        if not any(s["runs"] and (n_ops < 0 or s["operands"] == n_ops) for s in sigs):
            return False
    return True


def era(meta: Mapping[str, Any], description: Any = None) -> tuple[str | None, str]:
    """(jax version, where it comes from) of the JAX that wrote the blob.

    The recorded ``jax_version`` of a model saved from a function; the version the blob states
    (schema 12 writers); else, for a bare blob, the newest release built inside the date bracket
    the blob's own fields give (``compat.exporter_dates``: before the first release that writes
    newer) that reads the blob (not jax >= 0.11.1 for HLO shardings or a schema < 5) and still
    runs every CPU kernel the module calls with the operand count it calls it with (the newest:
    the most likely to install on a newer Python). ``(None, why)`` when none is known.
    """
    recorded = meta.get("jax_version")
    if recorded:
        return str(recorded), "recorded"
    stated = getattr(description, "jax_version", None)
    if stated:
        return str(stated), "written in the blob"
    _, earliest, latest, evidence = compat.exporter_dates(meta, description)
    calls = _kernel_calls(meta, description)
    known = set(compat.kernel_abi_table()["releases"])
    # a jax that refuses the blob is of no era of it: jax >= 0.11.1 reads neither HLO shardings
    # nor, without its flag (which the child does not set), a schema < 5
    schema = getattr(description, "schema_generation", None) or meta.get("schema_generation")
    refused_by_new = bool(compat.hlo_shardings(description)) or bool(
        schema and int(schema) < compat.OLDEST_SCHEMA_READ_BY_ENFORCING_JAX
    )
    in_era = [
        (d, compat._vkey(v), v)
        for v, d in compat._releases()
        if v in known
        and (earliest is None or d >= earliest)
        and (latest is None or d < latest)
        and not (refused_by_new and compat._vkey(v) >= compat.ENFORCING_JAX)
        and (sys.version_info >= (3, 12) or compat._vkey(v) < NEEDS_PYTHON_312)
    ]
    # the module's own kernel signatures first; then the kernels by name only (JAX's archive
    # dates a signature by when its tests were rewritten, which may be after a release wrote it)
    loose = [(t, -1) for t, _ in calls]
    candidates = [c for c in in_era if _runs_kernels(c[2], calls)] or [
        c for c in in_era if _runs_kernels(c[2], loose)
    ]
    if not candidates:
        return None, "no release of the blob's era runs its kernels"
    why = f"inferred from the blob ({', '.join(evidence) or 'no dated field'})"
    return max(candidates)[2], why


# -- the plan -------------------------------------------------------------------------------------


def _blocking(verdict: compat.Verdict) -> set[str]:
    return {r.code for r in verdict.reasons if r.severity == compat.INCOMPATIBLE} - _MACHINE


def _vkey(v: str | None) -> tuple[int, ...]:
    return compat._vkey(v or "")


def _direct_closes(verdict: compat.Verdict, schema: int | None) -> tuple[str, dt.date | None]:
    when, how = compat.window_closes(verdict.exporter)
    past = when is not None and when < dt.date.today() and how != "after"
    verb = "closed" if past else "closes"
    window = (
        f"JAX's 6-month backward window {verb if how == 'exact' else verb + ' ' + how} "
        f"{when} (a promise; no release refuses a blob by its date)"
        if when
        else "JAX's backward window (exporter date unknown)"
    )
    if schema is not None and schema < OLD_LAYOUT_SCHEMA:
        return (
            f"any jax released after {OLD_LAYOUT_UNTIL} may stop reading serialization schema "
            f"{schema} (JAX plans to drop the layout of schema < {OLD_LAYOUT_SCHEMA}); {window}",
            OLD_LAYOUT_UNTIL,
        )
    return window, when


def plan(
    verdict: compat.Verdict,
    meta: Mapping[str, Any],
    description: Any = None,
    *,
    iree_verdict: compat.Verdict | None = None,
    uri: str = "MODEL_URI",
) -> list[Route]:
    """The routes that work here for the model judged by ``verdict``, in order of preference.

    ``meta`` is the MLmodel ``jaxexp`` section (``{}`` for a bare blob), ``description`` the
    blob's ``BlobDescription``; ``iree_verdict`` the IREE backend's verdict if one was made.
    """
    env = verdict.environment or {}
    here = env.get("jax_version")
    enforcing = _vkey(here) >= compat.ENFORCING_JAX
    blocking = _blocking(verdict)
    schema = getattr(description, "schema_generation", None) or meta.get("schema_generation")
    schema = int(schema) if schema else None
    kernels = bool(blocking & {"custom_calls", "kernel_abi"})
    machine = sorted(
        r.code for r in verdict.reasons if r.severity == compat.INCOMPATIBLE and r.code in _MACHINE
    )
    # the routes that run in this process need this machine to fit the model first
    first = f" First fix this machine ({', '.join(machine)}: see the reasons)." if machine else ""
    routes: list[Route] = []
    if "platform" in machine:
        # no JAX of any era runs a cuda-only (tpu-only...) lowering on this machine's devices:
        # every JAX route, the recorded environment's included, needs the exported platform
        return routes
    if not blocking:
        text, when = _direct_closes(verdict, schema)
        routes.append(Route(DIRECT, here, "load it as it is." + first, text, when))
    if blocking == {"expired"} and enforcing:
        routes.append(
            Route(
                EXPIRED_FLAG,
                here,
                f"load_model(uri, route={EXPIRED_FLAG!r}) or --route {EXPIRED_FLAG} (JAX's "
                f"{compat.EXPIRED_FLAG} set around the deserialization only); "
                f"`{compat.EXPIRED_ENV}=1 jaxexp refresh` makes a current copy of a logged "
                "model." + first,
                f"at the jax release that drops the flag or schema {schema}: JAX calls the flag "
                f"temporary and may drop the layout of schema < {OLD_LAYOUT_SCHEMA} in any "
                f"release after {OLD_LAYOUT_UNTIL} (a minimum-schema check is planned after "
                f"{MINIMUM_SCHEMA_CHECK}).",
                OLD_LAYOUT_UNTIL,
            )
        )
    if enforcing and blocking and blocking <= _BRIDGE_FIXES and not kernels:
        routes.append(
            Route(
                BRIDGE,
                BRIDGE_JAX,
                f"--route {BRIDGE} (jax {BRIDGE_JAX} in a cached venv re-exports the blob, "
                "which then runs here)." + first,
                f"when jax {BRIDGE_JAX} no longer installs on this Python (its wheels: "
                f"CPython 3.11-3.13); the re-exported blob is of jax {BRIDGE_JAX}'s schema, "
                f"which JAX reads beyond {MINIMUM_SCHEMA_CHECK}.",
                None,
            )
        )
    version, source = era(meta, description)
    if version is not None:
        routes.append(
            Route(
                RECORDED_ENV,
                version,
                f"--route {RECORDED_ENV} (jax {version}, {source}, in a cached venv runs the "
                "whole model)"
                + (
                    "; `jaxexp verify --env-manager uv` for the model's recorded requirements."
                    if meta.get("jax_version")
                    else "."
                ),
                f"when jax {version} no longer installs on this Python or machine (the route "
                "runs the writer's own JAX; nothing in it expires by date).",
                None,
                source,
            )
        )
    if iree_verdict is not None and iree_verdict.ok:
        routes.append(
            Route(
                IREE,
                None,
                "load_model(uri, backend='iree') or --backend iree (IREE compiles the StableHLO "
                "module; no JAX).",
                "when IREE stops reading this StableHLO version (IREE releases keep reading "
                "older StableHLO; the compiled .vmfb does not cross IREE versions).",
                None,
            )
        )
    if machine == ["devices"] and not blocking:  # fewer devices here than the blob's
        from jaxexp_mlflow.runtime.device_routes import device_routes

        routes.extend(device_routes(meta, description, env, Route))
    return routes


def describe(routes: list[Route]) -> str:
    """The lines an error prints: the working routes, first the preferred one."""
    if not routes:
        return (
            "No route runs it here: not this jax (with or without its flags), not a bridge "
            "re-export, and no JAX of the writer's era on this machine's platform."
        )
    return "Routes that work here, in order:\n" + "\n".join(
        f"  {i + 1}. {r}" for i, r in enumerate(routes)
    )


def why_not(name: str, verdict: compat.Verdict, description: Any = None) -> str:
    """Why the route ``name`` is not among those that work here, for a refusal's message
    (``description``, the blob's, names what in its module keeps it from ``remesh``)."""
    blocking = sorted(_blocking(verdict))
    machine = sorted(
        r.code for r in verdict.reasons if r.severity == compat.INCOMPATIBLE and r.code in _MACHINE
    )
    if name == IREE:
        return "the IREE backend is asked for with --backend iree, not --route"
    if name in (REMESH, VIRTUAL_DEVICES):
        from jaxexp_mlflow.runtime.device_routes import why_not_devices

        return why_not_devices(name, blocking, machine, description)
    if machine:
        return f"this machine does not fit the model ({', '.join(machine)}: see `jaxexp check`)"
    if not blocking:
        return "nothing keeps this jax from loading the model as it is: take the direct route"
    found = ", ".join(blocking)
    if name == EXPIRED_FLAG:
        return (
            f"it reads only a blob this jax refuses as expired (jax >= {compat.ENFORCING_JAX}); "
            f"this one is refused for {found}"
        )
    if name == BRIDGE:
        return (
            f"a re-export through jax {BRIDGE_JAX} fixes only {', '.join(sorted(_BRIDGE_FIXES))}"
            f"; this one is refused for {found}"
        )
    if name == DIRECT:
        return f"this jax refuses the blob as it is ({found})"
    return f"this jax refuses the blob for {found}"


def find(routes: list[Route], name: str) -> Route | None:
    """The route called ``name`` among ``routes``."""
    return next((r for r in routes if r.name == name), None)


# -- the expired-versions flag, scoped -----------------------------------------------------------

_FLAG_LOCK = threading.RLock()


@contextlib.contextmanager
def expired_flag() -> Iterator[bool]:
    """JAX's ``jax_export_deserialize_expired_versions`` set for the block only, then restored.

    Uses the public ``jax.config.update`` (JAX has no public scoped form of this flag), under a
    lock so that two loads do not restore each other's value. Yields whether this jax has the
    flag (jax < 0.11.1 reads expired blobs without one).
    """
    import jax

    name = compat.EXPIRED_FLAG
    if not hasattr(jax.config, name):
        yield False
        return
    with _FLAG_LOCK:
        before = bool(getattr(jax.config, name))
        jax.config.update(name, True)
        try:
            yield True
        finally:
            jax.config.update(name, before)


def with_scoped_vjp(exported: Any) -> Any:
    """``exported`` whose VJP (which JAX deserializes lazily, at the first ``jax.grad``) is
    read under :func:`expired_flag` too, at every order."""
    from jaxexp_mlflow.internals.jax_private import get_vjp, with_vjp

    inner = get_vjp(exported)
    if inner is None:
        return exported

    def scoped(exp: Any) -> Any:
        with expired_flag():
            return with_scoped_vjp(inner(exp))

    return with_vjp(exported, scoped)


def judged_with_flag(meta: Mapping[str, Any], description: Any, **options: Any) -> compat.Verdict:
    """The verdict as this jax gives it with the expired-versions flag set."""
    base = compat.Environment.current()
    return compat.assess(
        meta, description=description, env=base.replace(reads_expired=True), **options
    )


# -- taking a route in this process ---------------------------------------------------------------

IN_PROCESS = (DIRECT, EXPIRED_FLAG)
#: The routes a load in this process takes when asked (``remesh`` rewrites the blob here).
TAKEN_HERE = (*IN_PROCESS, REMESH)


def check_name(route: str | None, *, allowed: tuple[str, ...] = TAKEN_HERE) -> str | None:
    """``route`` if it is one this caller takes, else :class:`IncompatibleError` naming them."""
    from jaxexp_mlflow.errors import IncompatibleError

    if route is None or route in allowed:
        return route
    where = {
        BRIDGE: "`jaxexp predict/verify --route bridge`, or `jaxexp refresh` to log the "
        "re-export as a new version",
        RECORDED_ENV: "`jaxexp predict/verify --route recorded-env`",
        IREE: "load_model(uri, backend='iree') or --backend iree",
        VIRTUAL_DEVICES: "`jaxexp predict/verify --route virtual-devices`",
    }.get(route)
    raise IncompatibleError(
        f"route={route!r}: expected one of {', '.join(allowed)} here"
        + (f"; the {route} route runs outside this call: use {where}." if where else ".")
    )


def judge(
    meta: Mapping[str, Any],
    description: Any,
    route: str | None,
    *,
    allow_other_platform: bool = False,
    allow_incompatible: bool = False,
    uri: str = "MODEL_URI",
) -> tuple[compat.Verdict, Any]:
    """(verdict, deserialization scope) for loading in this process by ``route``.

    ``None``/``direct``: the verdict as it is, refused naming the working routes.
    ``expired-flag``: refused unless that route opens the model; then the verdict with the flag
    set, and :func:`expired_flag` as the scope in which to deserialize.
    """
    from jaxexp_mlflow.errors import IncompatibleError

    check_name(route)
    verdict = compat.assess(
        meta, description=description, allow_other_platform=allow_other_platform
    )
    hint = ""
    if verdict.status == compat.INCOMPATIBLE:
        hint = describe(plan(verdict, meta, description, uri=uri))
    if route == REMESH:
        from jaxexp_mlflow.runtime.device_routes import judged_for_remesh

        available = describe(plan(verdict, meta, description, uri=uri))
        judged = judged_for_remesh(verdict, meta, description, available)
        enforce(judged, allow_incompatible=allow_incompatible, hint=hint)
        return judged, contextlib.nullcontext
    if route == EXPIRED_FLAG:
        available = plan(verdict, meta, description, uri=uri)
        if find(available, EXPIRED_FLAG) is None:
            blocking = [r for r in verdict.reasons if r.severity == compat.INCOMPATIBLE]
            found = (
                "\n- ".join(str(r) for r in blocking)
                if blocking
                else f"a model this jax ({(verdict.environment or {}).get('jax_version')}) "
                "reads without the flag"
            )
            raise IncompatibleError(
                f"route={EXPIRED_FLAG!r} does not apply to this model: expected a blob of schema "
                f"< {compat.OLDEST_SCHEMA_READ_BY_ENFORCING_JAX} refused for that alone by jax >= "
                f"0.11.1, found:\n- {found}\n{describe(available)}"
            )
        flagged = judged_with_flag(meta, description, allow_other_platform=allow_other_platform)
        enforce(flagged, allow_incompatible=allow_incompatible, hint=hint)
        return flagged, expired_flag
    enforce(verdict, allow_incompatible=allow_incompatible, hint=hint)
    return verdict, contextlib.nullcontext


def enforce(verdict: compat.Verdict, *, allow_incompatible: bool, hint: str = "") -> None:
    """Refuse an incompatible verdict (unless overridden) and log a warning verdict.

    ``hint`` (the working routes, ``runtime.routes.describe``) is added to the refusal."""
    if verdict.status == compat.INCOMPATIBLE and not allow_incompatible:
        raise IncompatibleError(
            "This model cannot run here:\n- "
            + "\n- ".join(str(r) for r in verdict.reasons if r.severity == compat.INCOMPATIBLE)
            + "".join(
                f"\n- (warning) {r}" for r in verdict.reasons if r.severity != compat.INCOMPATIBLE
            )
            + (f"\n{hint}" if hint else "")
            + "\nFix the above, take a route, or pass allow_incompatible=True to try anyway."
        )
    for reason in verdict.reasons:
        _logger.warning("jaxexp: %s", reason)
