"""The verdict itself: :func:`assess` runs one judge per check, in the order of the codes
in ``compat``'s docstring, each adding its reasons, and builds the :class:`Verdict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxexp_mlflow.codec.schema import BREAKING_SCHEMAS
from jaxexp_mlflow.runtime import stablehlo_ops
from jaxexp_mlflow.runtime.compat.calls import judge_custom_calls, judge_kernel_abi, module_targets
from jaxexp_mlflow.runtime.compat.environment import Environment, coerce_environment
from jaxexp_mlflow.runtime.compat.releases import calling_convention_enforced
from jaxexp_mlflow.runtime.compat.verdict import (
    INCOMPATIBLE,
    OK,
    SEVERITY_RANK,
    WARN,
    Reason,
    Verdict,
)
from jaxexp_mlflow.runtime.compat.window import judge_window


def _judge_platform(
    platforms: list[str], env: Environment, allow_other_platform: bool, add: Any
) -> str | None:
    """``platform``: the running platform is not among the exported ones; returns the platform
    the model would run on."""
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
    return run_platform


def _judge_devices(nr_devices: int, run_platform: str | None, env: Environment, add: Any) -> None:
    """``devices``: fewer devices visible than the export's ``nr_devices``."""
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


def _judge_calling_convention(
    meta: Mapping[str, Any], description: Any, env: Environment, exporter_jax: str | None, add: Any
) -> None:
    """``calling_convention``: the blob's calling convention is outside what the running jax
    reads."""
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


def _judge_schema(description: Any, env: Environment, exporter_jax: str | None, add: Any) -> None:
    """``schema``: the blob was written with a newer serialization schema than this jax
    reads."""
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
    env = coerce_environment(env)
    reasons: list[Reason] = []

    def add(code: str, severity: str, message: str, action: str) -> None:
        reasons.append(Reason(code, severity, message, action))

    platforms = list(meta.get("platforms") or getattr(description, "platforms", ()) or [])
    nr_devices = int(meta.get("nr_devices") or getattr(description, "nr_devices", 1) or 1)
    exporter_jax = meta.get("jax_version")

    run_platform = _judge_platform(platforms, env, allow_other_platform, add)
    _judge_devices(nr_devices, run_platform, env, add)
    _judge_calling_convention(meta, description, env, exporter_jax, add)
    _judge_schema(description, env, exporter_jax, add)

    stablehlo_ops.check(description, env.stablehlo_version, exporter_jax, add)

    # build-date window
    exporter = judge_window(meta, description, env, add)

    # custom calls: registered at all, then with the signature the module calls them with
    judge_custom_calls(module_targets(meta, description), run_platform, env, meta, exporter, add)
    judge_kernel_abi(meta, description, run_platform, env, exporter, add)

    status = max((r.severity for r in reasons), key=SEVERITY_RANK.__getitem__, default=OK)
    return Verdict(status, tuple(reasons), env.to_dict(), exporter)
