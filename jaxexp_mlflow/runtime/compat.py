"""Compatibility verdict of an archived model against the running environment.

One function, :func:`assess`, and one data structure, :class:`Verdict`, used by ``load_model``,
the pyfunc loader and the ``jaxexp check`` command. The verdict is reached *before* anything is
compiled or called, from the MLmodel ``jaxexp`` section (and, when given, the blob's own
description from the jax-free reader) and a snapshot of the running environment
(:class:`Environment`). Checks, each giving a :class:`Reason` with a ``code``:

``platform``            the running platform is not among the exported ``platforms``
``devices``             fewer devices visible than the export's ``nr_devices``
``calling_convention``  the blob's calling convention is outside what the running jax reads
``schema``              the blob was written with a newer serialization schema than jax reads
``expired``             jax >= 0.11.1 refuses blobs of schema < 5 (written by jax <= 0.7) unless
                        its flag ``jax_export_deserialize_expired_versions`` is set
``hlo_sharding``        jax >= 0.11.1 refuses blobs carrying old-style (HLO) shardings, flag or not
``window_backward``     exporter's jaxlib built more than 6 months before the running one (a
                        warning: no released jax refuses a blob by its date, see ``expired``)
``window_forward``      exporter's jaxlib built more than 3 weeks after the running one
``jaxlib_unknown``      a jaxlib version the shipped release table does not know
``custom_calls``        custom-call targets of the module the running jaxlib does not register
``kernel_abi``          a registered kernel called with a signature (operand/result count) the
                        running jax no longer runs (it fails at execution); a warning when the
                        calls cannot be read and only dates suggest it

Kernel signatures and what each jax release runs come from ``jaxexp_mlflow/data/kernel_abi.json``,
derived from the history of JAX's own back-compat test data (regenerate with
``scripts/update_kernel_abi.py``); the same table records whether a release enforces its stated
calling-convention range when reading (none does so far: an older convention only warns).

JAX's promise (https://docs.jax.dev/en/latest/export/export.html#compatibility-guarantees) is
stated between the *build dates* of the exporting and the consuming jaxlib; the dates come from
``jaxexp_mlflow/data/jaxlib_releases.json`` (regenerate with
``scripts/update_jaxlib_releases.py``). Bare blobs (logged as bytes) carry no jaxlib version:
their build date is bracketed from what the blob itself says (serialization schema, calling
convention, the serialization version field).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

# the schema's history (dates, breaking versions, what jax >= 0.11.1 refuses) is codec.schema's
from jaxexp_mlflow.codec.schema import (
    BREAKING_SCHEMAS,
    CALLING_CONVENTION_WRITTEN_UNTIL,
    ENFORCING_JAX,
    OLDEST_SCHEMA_READ_BY_ENFORCING_JAX,
    SCHEMA_DATES,
    SERIALIZATION_FIELD_WRITTEN_FROM,
    SERIALIZATION_FIELD_WRITTEN_UNTIL,
)
from jaxexp_mlflow.runtime import stablehlo_ops

OK, WARN, INCOMPATIBLE = "ok", "warn", "incompatible"
_RANK = {OK: 0, WARN: 1, INCOMPATIBLE: 2}

#: JAX's compatibility window, between the build dates of the exporting and consuming jaxlib.
BACKWARD_WINDOW = dt.timedelta(days=183)  # 6 months
FORWARD_WINDOW = dt.timedelta(days=21)  # 3 weeks

EXPIRED_FLAG = "jax_export_deserialize_expired_versions"
EXPIRED_ENV = EXPIRED_FLAG.upper()

#: Custom-call targets handled by JAX/XLA themselves (never in a runtime registry).
BUILTIN_TARGETS = frozenset(
    {
        "shape_assertion",
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
        "AllocateBuffer",
        "ApproxTopK",
        "Eigh",
        "Qr",
        "LuDecomposition",
        "ProductOfElementaryHouseholderReflectors",
        "MoveToHost",
        "MoveToDevice",
        "LayoutConstraint",
        "PartialReduce",
        "TopK",
        "X64Combine",
        "X64SplitLow",
        "X64SplitHigh",
        "dce_sink",
        "local_sharding",
    }
)
_BUILTIN_PREFIXES = ("stablehlo.", "mhlo.", "xla.", "sdy.", "chlo.")
#: Which platform a custom-call target belongs to, by name (the kernels jaxlib ships).
_PLATFORM_PREFIXES = (
    ("cpu", ("lapack_", "blas_", "ducc_", "cpu_", "xla_python_cpu", "xla_ffi_python_cpu")),
    ("cuda", ("cu_", "cusolver", "cusparse", "cublas", "cudnn", "cuda_", "mosaic_gpu")),
    ("rocm", ("hip_", "hipsolver", "hipsparse", "hipblas", "rocm_")),
    ("tpu", ("tpu_custom_call",)),
    ("gpu", ("triton_kernel_call", "xla_python_gpu", "xla_ffi_python_gpu", "gpu_")),
)


# -- reasons and verdicts ------------------------------------------------------------------------


@dataclass(frozen=True)
class Reason:
    """One finding: what is wrong (``message``), what to do about it (``action``)."""

    code: str
    severity: str  # "warn" or "incompatible"
    message: str
    action: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.message} {self.action}"

    def to_dict(self) -> dict[str, str]:
        """JSON-able form."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Verdict:
    """ok / warn / incompatible, with one reason (and what to do) per finding.

    ``environment`` is the snapshot the verdict was made against and ``exporter`` what is known
    or estimated of the exporting jaxlib (version, build date or date bounds).
    """

    status: str = OK
    reasons: tuple[Reason, ...] = field(default_factory=tuple)
    environment: dict[str, Any] = field(default_factory=dict)
    exporter: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True unless the verdict is ``incompatible``."""
        return self.status != INCOMPATIBLE

    def codes(self) -> list[str]:
        """The reason codes, in order."""
        return [r.code for r in self.reasons]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``jaxexp check --json`` prints)."""
        return {
            "status": self.status,
            "reasons": [r.to_dict() for r in self.reasons],
            "environment": dict(self.environment),
            "exporter": dict(self.exporter),
        }

    def __str__(self) -> str:
        lines = [f"compatibility: {self.status}"]
        lines += [f"- {r}" for r in self.reasons]
        return "\n".join(lines)


# -- the release table ---------------------------------------------------------------------------


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
    key = _vkey(jax_version)
    known = [v for v in kernel_abi_table()["releases"] if _vkey(v) <= key]
    return max(known, key=_vkey) if known else None


def _in_ranges(version: str, ranges: Sequence[Sequence[str]]) -> bool:
    key = _vkey(version)
    return any(_vkey(a) <= key <= _vkey(b) for a, b in ranges)


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


def _vkey(version: str) -> tuple[int, ...]:
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
    best = [(d, _vkey(v), v) for v, d in _releases() if d <= limit]
    return max(best)[2] if best else None


def oldest_release_after(limit: dt.date) -> str | None:
    """The oldest (non-yanked) jaxlib released on or after ``limit``."""
    best = [(d, _vkey(v), v) for v, d in _releases() if d >= limit]
    return min(best)[2] if best else None


def _months(delta: dt.timedelta) -> str:
    days = abs(delta.days)
    return f"{days} days" if days < 62 else f"{days / 30.44:.0f} months"


# -- the running environment ---------------------------------------------------------------------


@dataclass(frozen=True)
class Environment:
    """What the verdict needs to know about where the model would run.

    Every field may be ``None`` (unknown), in which case the checks that need it are skipped.
    """

    jax_version: str | None = None
    jaxlib_version: str | None = None
    platform: str | None = None
    available_platforms: tuple[str, ...] = ()
    device_count: int | None = None
    calling_convention_range: tuple[int, int] | None = None
    max_schema: int | None = None
    enforces_window: bool | None = None
    reads_expired: bool | None = None
    custom_call_targets: frozenset[str] | None = None
    stablehlo_version: str | None = None

    @classmethod
    def current(cls) -> Environment:
        """Snapshot of the running jax: versions, backend, devices, registered custom calls.

        Initializes the default backend (needed anyway to run the model); compiles nothing.
        """
        import jax
        from jax import export as jax_export

        from jaxexp_mlflow.internals.jax_private import stablehlo_version
        from jaxexp_mlflow.runtime import platforms as names
        from jaxexp_mlflow.store.section import package_version

        available = names.available_platforms()
        platform = available[0]  # as jax.export names it: cuda, not jax.default_backend()'s gpu
        devices = jax.devices()
        return cls(
            jax_version=jax.__version__,
            jaxlib_version=package_version("jaxlib"),
            platform=platform,
            available_platforms=tuple(available),
            device_count=len(devices),
            calling_convention_range=(
                int(jax_export.minimum_supported_calling_convention_version),
                int(jax_export.maximum_supported_calling_convention_version),
            ),
            max_schema=_running_schema(),
            enforces_window=hasattr(jax.config, EXPIRED_FLAG),
            reads_expired=bool(getattr(jax.config, EXPIRED_FLAG, False)),
            # every platform a model may run on here: a cpu-only export on a CUDA host calls
            # the LAPACK kernels registered for the host, not CUDA's
            custom_call_targets=_union(registered_custom_call_targets(p) for p in available),
            stablehlo_version=stablehlo_version(),
        )

    def replace(self, **changes: Any) -> Environment:
        """A copy with ``changes`` applied (used to judge against another environment).

        Platform names are taken as ``jax.export`` names them (``gpu`` becomes ``cuda``)."""
        from jaxexp_mlflow.runtime.platforms import canonical

        if changes.get("platform"):
            changes["platform"] = canonical(changes["platform"])
        if changes.get("available_platforms"):
            changes["available_platforms"] = [canonical(p) for p in changes["available_platforms"]]
        if "custom_call_targets" in changes and changes["custom_call_targets"] is not None:
            changes["custom_call_targets"] = frozenset(changes["custom_call_targets"])
        for key in ("available_platforms",):
            if key in changes and changes[key] is not None:
                changes[key] = tuple(changes[key])
        if "calling_convention_range" in changes and changes["calling_convention_range"]:
            changes["calling_convention_range"] = tuple(changes["calling_convention_range"])
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (custom-call targets as a count: the list is long)."""
        d = dataclasses.asdict(self)
        d["available_platforms"] = list(self.available_platforms)
        if self.calling_convention_range is not None:
            d["calling_convention_range"] = list(self.calling_convention_range)
        targets = self.custom_call_targets
        d["custom_call_targets"] = None if targets is None else len(targets)
        d["jaxlib_build_date"] = _iso(release_date(self.jaxlib_version))
        return d


def _union(sets: Any) -> frozenset[str] | None:
    """The union of the registries read (None when none could be read)."""
    read = [s for s in sets if s is not None]
    return frozenset().union(*read) if read else None


def _running_schema() -> int | None:
    from jaxexp_mlflow.internals.jax_private import serialization_schema

    return serialization_schema()


def registered_custom_call_targets(platform: str) -> frozenset[str] | None:
    """Custom-call targets the running jaxlib registers for ``platform`` (no compilation).

    Reads jaxlib's own registry (``xla_client.custom_call_targets``) after backend start-up,
    which is when jaxlib registers its kernels (LAPACK on CPU, cuSOLVER on GPU, ...). Returns
    ``None`` if this jaxlib offers no way to list them.
    """
    from jaxexp_mlflow.internals.jax_private import custom_call_lister

    lister = custom_call_lister()
    if lister is None:
        return None
    names: set[str] = set()
    xla_names = {"cpu": ("cpu", "Host"), "cuda": ("CUDA", "cuda"), "rocm": ("ROCM", "rocm")}
    for name in xla_names.get(platform, (platform,)):
        try:
            names.update(lister(name))
        except Exception:  # unknown platform name for this registry
            continue
    return frozenset(names)


def target_platform(target: str) -> str | None:
    """The platform a custom-call target belongs to, from its name; None if it is generic."""
    for platform, prefixes in _PLATFORM_PREFIXES:
        if target.startswith(prefixes):
            return platform
    return None


def _is_builtin(target: str) -> bool:
    return target in BUILTIN_TARGETS or target.startswith(_BUILTIN_PREFIXES)


# -- the exporter's build date -------------------------------------------------------------------


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


def _iso(d: dt.date | None) -> str | None:
    return d.isoformat() if d else None


# -- the verdict ---------------------------------------------------------------------------------


def _coerce_env(env: Environment | Mapping[str, Any] | None) -> Environment:
    if env is None:
        return Environment.current()
    if isinstance(env, Environment):
        return env
    return Environment.current().replace(**dict(env))


def _targets(meta: Mapping[str, Any], description: Any) -> Sequence[str] | None:
    targets = meta.get("custom_call_targets")
    if targets is None and description is not None:
        targets = description.custom_call_targets
    return None if targets is None else list(targets)


def assess(
    meta: Mapping[str, Any],
    *,
    description: Any = None,
    env: Environment | Mapping[str, Any] | None = None,
    allow_other_platform: bool = False,
) -> Verdict:
    """Judge whether the model described by ``meta`` (MLmodel ``jaxexp`` section) runs here.

    ``description`` is the blob's ``BlobDescription`` (codec reader) when at hand: it fills in
    what ``meta`` lacks (schema generation, custom-call targets of bare blobs). ``env`` is the
    environment to judge against: ``None`` for the running one, an :class:`Environment`, or a
    mapping of fields to override in the running one (e.g. ``{"jaxlib_version": "0.12.0"}``).
    ``allow_other_platform`` turns a platform mismatch into a warning (the load option of the
    same name disables JAX's platform check).
    """
    env = _coerce_env(env)
    reasons: list[Reason] = []

    def add(code: str, severity: str, message: str, action: str) -> None:
        reasons.append(Reason(code, severity, message, action))

    platforms = list(meta.get("platforms") or getattr(description, "platforms", ()) or [])
    nr_devices = int(meta.get("nr_devices") or getattr(description, "nr_devices", 1) or 1)
    exporter_jax = meta.get("jax_version")

    # platform
    runnable = [p for p in platforms if p in (env.available_platforms or (env.platform,))]
    if platforms and env.platform and not runnable:
        msg = (
            f"The model was exported for platforms {platforms}, but this machine runs JAX on "
            f"{env.platform!r}."
        )
        if allow_other_platform:
            add(
                "platform",
                WARN,
                msg + " Running anyway (allow_other_platform=True disables JAX's platform check);"
                " results may differ or fail.",
                "Re-export for this platform to make it supported (save_model(..., "
                f"platforms=({', '.join(repr(p) for p in [*platforms, env.platform])}))).",
            )
        else:
            add(
                "platform",
                INCOMPATIBLE,
                msg,
                f"Run it on a {'/'.join(platforms)} machine, re-export it including "
                f"{env.platform!r} (save_model(..., platforms=[..., {env.platform!r}])), or pass "
                "allow_other_platform=True to try anyway.",
            )
    run_platform = runnable[0] if runnable else env.platform

    # devices
    if env.device_count is not None and nr_devices > env.device_count:
        if run_platform == "cpu":
            how = (
                f"set XLA_FLAGS=--xla_force_host_platform_device_count={nr_devices} before the "
                "process starts JAX"
            )
        else:
            how = f"run it on a machine or slice with {nr_devices} {run_platform} devices"
        add(
            "devices",
            INCOMPATIBLE,
            f"The model was exported for {nr_devices} devices, but only {env.device_count} "
            f"{run_platform} device(s) are visible.",
            f"Expose {nr_devices} devices: {how}.",
        )

    # calling convention
    cc = meta.get("calling_convention_version")
    if cc is None and description is not None:
        cc = description.calling_convention_version
    if cc is not None and env.calling_convention_range is not None:
        lo, hi = env.calling_convention_range
        cc = int(cc)
        if cc < lo:
            enforced = calling_convention_enforced(env.jax_version)
            effects = list(getattr(description, "ordered_effects", ()) or ())
            if enforced is False and not (effects and cc < 9):
                add(
                    "calling_convention",
                    WARN,
                    f"The blob uses calling convention {cc}; jax {env.jax_version} states it "
                    f"reads {lo}..{hi}, but it does not check this when reading and still runs "
                    "older conventions (as JAX's archived modules show). A later jax may stop.",
                    "Refresh it now while this jax runs it (jaxexp_mlflow.refresh / `jaxexp "
                    f"refresh`): the refreshed blob uses calling convention {hi}.",
                )
            else:
                why = (
                    f"its ordered effects {effects} are passed differently before convention 9"
                    if effects and cc < 9
                    else f"it dropped support for {cc}"
                )
                add(
                    "calling_convention",
                    INCOMPATIBLE,
                    f"The blob uses calling convention {cc}; jax {env.jax_version} reads "
                    f"{lo}..{hi} only ({why}).",
                    "Load it with an older jax that still reads it"
                    + (f" (the exporter's jax {exporter_jax})" if exporter_jax else "")
                    + " and refresh it there (jaxexp_mlflow.refresh / `jaxexp refresh`).",
                )
        elif cc > hi:
            add(
                "calling_convention",
                INCOMPATIBLE,
                f"The blob uses calling convention {cc}, newer than jax {env.jax_version} reads "
                f"({lo}..{hi}).",
                "Upgrade jax and jaxlib"
                + (f" to {exporter_jax} or newer" if exporter_jax else " to a newer release")
                + ".",
            )

    # serialization schema (a newer writer than this reader)
    schema = getattr(description, "schema_generation", None)
    writer = exporter_jax or getattr(description, "jax_version", None)
    if schema and env.max_schema and schema > env.max_schema:
        upgrade = (
            "Upgrade jax and jaxlib"
            + (f" to {writer} or newer" if writer else " to the newest release")
            + "."
        )
        breaking = [g for g in BREAKING_SCHEMAS if env.max_schema < g <= schema]
        if breaking:
            add(
                "schema",
                INCOMPATIBLE,
                f"The blob was written with serialization schema {schema}; jax {env.jax_version} "
                f"knows schemas up to {env.max_schema}, and schema {breaking[-1]} moved fields "
                "it reads, so it would misread the blob.",
                upgrade,
            )
        else:
            add(
                "schema",
                WARN,
                f"The blob was written with serialization schema {schema}; jax {env.jax_version} "
                f"knows schemas up to {env.max_schema}. The fields added since only add "
                "information, which this jax ignores; what it reads means the same.",
                upgrade + " (`jaxexp verify` checks that it reproduces here).",
            )

    stablehlo_ops.check(description, env.stablehlo_version, exporter_jax, add)

    # build-date window
    exporter = _window(meta, description, env, add)

    # custom calls: registered at all, then with the signature the module calls them with
    _custom_calls(_targets(meta, description), run_platform, env, meta, exporter, add)
    _kernel_abi(meta, description, run_platform, env, exporter, add)

    status = max((r.severity for r in reasons), key=_RANK.__getitem__, default=OK)
    return Verdict(status, tuple(reasons), env.to_dict(), exporter)


def _window(meta: Mapping[str, Any], description: Any, env: Environment, add: Any) -> dict:
    version, earliest, latest, evidence = exporter_dates(meta, description)
    exporter = {
        "jax_version": meta.get("jax_version"),
        "jaxlib_version": version,
        "build_date_earliest": _iso(earliest),
        "build_date_latest": _iso(latest),
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
        enforcing = _vkey(env.jax_version) >= ENFORCING_JAX
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


def _is_polymorphic(description: Any) -> bool:
    """Whether the blob's avals have a symbolic dimension (``float32[b,4]``)."""
    avals = (
        *(getattr(description, "in_avals", None) or ()),
        *(getattr(description, "out_avals", None) or ()),
    )
    return any(re.search(r"\[[^\]]*[A-Za-z_]", str(a)) for a in avals)


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


def _custom_calls(
    targets: Sequence[str] | None,
    platform: str | None,
    env: Environment,
    meta: Mapping[str, Any],
    exporter: dict,
    add: Any,
) -> None:
    if not targets or env.custom_call_targets is None or platform is None:
        return
    registered = env.custom_call_targets
    missing = []
    for t in targets:
        if _is_builtin(t) or t in registered:
            continue
        owner = target_platform(t)
        if (
            owner is not None
            and owner != platform
            and not (
                owner == "gpu"
                and platform
                in {
                    "cuda",
                    "rocm",
                }
            )
        ):
            continue  # the lowering for another platform: not compiled here
        missing.append(t)
    if not missing:
        return
    exporter_lib = meta.get("jaxlib_version") or exporter.get("jaxlib_version")
    kernels = [t for t in missing if target_platform(t)]
    if kernels:
        where = (
            f"the exporter's jaxlib {exporter_lib}"
            if exporter_lib
            else "a jaxlib of the exporter's era"
            + (
                f" (built on or before {exporter['build_date_latest']})"
                if exporter.get("build_date_latest")
                else ""
            )
        )
        action = (
            f"Run it with {where}, which has these kernels; to move to this jaxlib, export the "
            "function again from its Python source (a refresh keeps the old kernel calls)."
        )
    else:
        action = (
            "Register them before loading (jax.ffi.register_ffi_target, e.g. by importing the "
            "library that provides them), or pass allow_incompatible=True to try anyway."
        )
    add(
        "custom_calls",
        INCOMPATIBLE,
        f"The module calls custom-call targets {missing} that jaxlib {env.jaxlib_version} does "
        f"not register on {platform}; calling it would fail with NOT_FOUND.",
        action,
    )


def _calls(meta: Mapping[str, Any], description: Any) -> list[tuple[str, int, int]] | None:
    calls = getattr(description, "custom_calls", None)
    if calls is None:
        calls = meta.get("custom_calls")
    return None if calls is None else [(str(t), int(o), int(r)) for t, o, r in calls]


def _kernel_abi(
    meta: Mapping[str, Any],
    description: Any,
    platform: str | None,
    env: Environment,
    exporter: dict,
    add: Any,
) -> None:
    """Registered kernels called with a signature the running jax no longer runs.

    With the module's own calls (operand/result counts read from the bytecode) the signature is
    compared directly (a mismatch is ``incompatible``); without them, a module whose exporter
    predates every signature this jax runs only warns (JAX's dates are those of its tests).
    """
    if env.jax_version is None or platform is None:
        return
    registered = env.custom_call_targets
    calls = _calls(meta, description)
    if calls is None:
        latest = exporter.get("build_date_latest")
        targets = _targets(meta, description) or []
        calls = [(t, -1, -1) for t in targets]
    else:
        latest = None
    seen: set[str] = set()
    # Under a symbolic dimension JAX's FFI lowering appends one shape operand per result when a
    # result shape is dynamic (recorded in the op's ``indices_of_shape_operands``), so a
    # shape-polymorphic module may call a kernel with ``operands + results`` operands.
    polymorphic = _is_polymorphic(description)
    for target, n_ops, n_res in sorted(calls):
        if _is_builtin(target) or (registered is not None and target not in registered):
            continue  # builtins are variadic; unregistered targets are reported by custom_calls
        owner = target_platform(target)
        if (
            owner is not None
            and owner != platform
            and not (owner == "gpu" and platform in {"cuda", "rocm"})
        ):
            continue
        sigs = kernel_signatures(target, env.jax_version)
        running = [s for s in (sigs or []) if s["runs"]]
        if not running or target in seen:
            continue
        if n_ops >= 0:
            counts = {(n_ops, n_res)} | ({(n_ops - n_res, n_res)} if polymorphic else set())
            if any((s["operands"], s["results"]) in counts for s in running):
                continue
            old = [s for s in sigs if (s["operands"], s["results"]) == (n_ops, n_res)]
            called = f"with {n_ops} operand(s) and {n_res} result(s)"
        else:
            first = min(dt.date.fromisoformat(s["written"]) for s in running if s["written"])
            if latest is None or dt.date.fromisoformat(latest) >= first:
                continue
            old = [s for s in sigs if not s["runs"]]
            called = f"as a jaxlib built on or before {latest} wrote it"
        seen.add(target)
        if n_ops < 0:  # dated, not counted: JAX's dates are when its tests were rewritten
            add(
                "kernel_abi",
                WARN,
                f"The module's calls could not be read, and it calls kernel {target}, whose "
                f"signature in jax {env.jax_version} JAX's archive dates after the exporter "
                f"(built on or before {latest}); it may fail at execution with "
                "INVALID_ARGUMENT (wrong number of arguments).",
                "Run `jaxexp verify` to find out; if it fails, export the function again from "
                "its Python source.",
            )
            continue
        now = ", ".join(
            f"{s['operands']} operand(s)/{s['results']} result(s) (written {s['written']}, "
            f"since jax {s['jax_from']})"
            for s in running
        )
        history = ""
        last_ok = None
        if old:
            last_ok = max((s["jax_until"] for s in old), key=_vkey)
            history = (
                f"; that signature was written {old[0]['written']} and last run by jax {last_ok}"
            )
        add(
            "kernel_abi",
            INCOMPATIBLE,
            f"The module calls kernel {target} {called}{history}; the kernel in jax "
            f"{env.jax_version} takes {now}: calling it would fail at execution "
            "(INVALID_ARGUMENT: wrong number of arguments).",
            (
                f"Run it with jax/jaxlib {last_ok}, which still runs this signature; "
                if last_ok
                else "Run it with a jaxlib of the exporter's era; "
            )
            + "to move to this jaxlib, export the function again from its Python source "
            "(a refresh keeps the old kernel call).",
        )


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
