"""``jaxexp check``: can this model run here? The compatibility verdict with reasons."""

from __future__ import annotations

import textwrap
from typing import Any

import click

from jaxexp_mlflow.cli._common import (
    Command,
    Failure,
    InputProblem,
    common_options,
    emit_json,
    setup_logging,
    step,
)
from jaxexp_mlflow.cli.uri import Target, resolve


def blob_meta(desc: Any) -> dict[str, Any]:
    """A flavor-section-like dict for a bare blob (the exporter's jax version is unknown)."""
    return {
        "jax_version": None,
        "jaxlib_version": None,
        "fun_name": desc.fun_name,
        "platforms": list(desc.platforms),
        "nr_devices": desc.nr_devices,
        "vjp_order": desc.vjp_order,
        "calling_convention_version": desc.calling_convention_version,
        "serialization_version": desc.serialization_version,
        "in_avals": list(desc.in_avals),
        "out_avals": list(desc.out_avals),
        "in_shardings": list(desc.in_shardings),
        "out_shardings": list(desc.out_shardings),
        "custom_call_targets": (
            None if desc.custom_call_targets is None else list(desc.custom_call_targets)
        ),
        "exported_sha256": desc.sha256,
    }


def assess_target(
    target: Target, *, allow_other_platform: bool = False
) -> tuple[Any, dict[str, Any]]:
    """Run ``runtime.compat.assess`` on the target; return (verdict, its JSON-able form)."""
    from jaxexp_mlflow.cli.inspect import describe
    from jaxexp_mlflow.runtime import compat

    report = describe(target)  # validates the blob
    if report["checksum"]["ok"] is False:
        raise InputProblem(
            f"{target.blob_path} does not match the sha256 recorded in MLmodel; the file was "
            "altered or truncated: download the model again or restore it from a backup"
        )
    desc = target.description  # parsed by describe(target)
    meta = target.flavor or blob_meta(desc)
    with step("Assessing compatibility"):
        verdict = compat.assess(meta, description=desc, allow_other_platform=allow_other_platform)
    as_dict = verdict_dict(verdict)
    return verdict, as_dict


def forced_load_failure(
    target: Target, err: BaseException, *, allow_other_platform: bool = False
) -> Failure | None:
    """After ``--allow-incompatible``: a load that failed on a model judged incompatible is the
    "no" its verdict predicted (exit 1, with the verdict's reasons and what to do), not an input
    error. None when the verdict does not explain the failure (the error stands as it is)."""
    if {c.__name__ for c in type(err).__mro__} & {"IncompatibleError", "Failure"}:
        return None  # already a "no"
    try:
        verdict, _ = assess_target(target, allow_other_platform=allow_other_platform)
    except Exception:  # noqa: BLE001 - the original error is the one to report
        return None
    if verdict.status != "incompatible":
        return None
    reasons = " ".join(
        f"- {r}" for r in verdict.reasons if getattr(r, "severity", None) == "incompatible"
    )
    message = " ".join((getattr(err, "message", None) or str(err)).split())
    return Failure(
        f"the model failed to load here, as its compatibility verdict (incompatible) said it "
        f"would despite --allow-incompatible: {message} What the verdict found and what to do: "
        f"{reasons}"
    )


#: Files that are Python a process could import or run (sources, bytecode, extensions, .pth).
PYTHON_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".so", ".pth")
_MAX_LISTED = 50
_MAX_WALKED = 100_000


def model_python(target: Target) -> dict[str, Any] | None:
    """The Python a model directory carries: ``{"count", "files" (the first 50, relative),
    "code" (the code directory MLmodel declares, or None)}``; None for a bare blob.

    jaxexp never imports any of it (docs/security.md); MLflow's pyfunc loader puts a declared
    ``code`` directory on ``sys.path``. Only what is local is listed: for a remote model that
    is MLmodel and the blob, and ``code`` says what MLmodel declares."""
    import os

    if target.kind != "model":
        return None
    flavors = target.mlmodel.get("flavors") or {}
    declared = [f.get("code") for f in flavors.values() if isinstance(f, dict) and f.get("code")]
    found: list[str] = []
    walked = 0
    root = str(target.path)
    for here, dirs, names in os.walk(root, followlinks=False):
        dirs.sort()
        for name in sorted(names):
            walked += 1
            if name.endswith(PYTHON_SUFFIXES):
                found.append(os.path.relpath(os.path.join(here, name), root))
        walked += len(dirs)
        if walked > _MAX_WALKED:
            break
    return {
        "count": len(found),
        "files": found[:_MAX_LISTED],
        "code": str(declared[0]) if declared else None,
    }


def python_line(found: dict[str, Any]) -> str:
    """One line for ``check``: no Python, or how many files and which."""
    if not found["count"] and not found["code"]:
        return "carries no Python (jaxexp-mlflow is its loader)"
    if not found["count"]:
        return (
            f"declares a code directory {found['code']!r} (not downloaded here); jaxexp never "
            "imports from it, mlflow.pyfunc.load_model puts it on sys.path"
        )
    shown = ", ".join(found["files"][:5])
    more = f" (+{found['count'] - 5} more)" if found["count"] > 5 else ""
    return (
        f"carries {found['count']} Python files: {shown}{more}. jaxexp never imports them; "
        "mlflow.pyfunc.load_model (and mlflow models serve) put the model's code/ on sys.path "
        "and can run them: load it that way only if you trust its source"
    )


def device_routes(target: Target, verdict: Any) -> list[Any]:
    """The routes (``runtime.routes.plan``) of a model exported for more devices than are
    visible here (``remesh``, ``virtual-devices``); [] otherwise."""
    codes = {getattr(r, "code", None) for r in verdict.reasons if r.severity == "incompatible"}
    if codes != {"devices"}:
        return []
    from jaxexp_mlflow.runtime import routes

    desc = target.description
    meta = target.flavor or blob_meta(desc)
    device_routes = (routes.REMESH, routes.VIRTUAL_DEVICES)
    return [r for r in routes.plan(verdict, meta, desc, uri=target.uri) if r.name in device_routes]


def verdict_dict(verdict: Any) -> dict[str, Any]:
    """``Verdict.to_dict()``, or the same shape built from status and reasons."""
    if hasattr(verdict, "to_dict"):
        d = dict(verdict.to_dict())
    else:
        d = {"status": verdict.status, "reasons": [reason_dict(r) for r in verdict.reasons]}
    d.setdefault("status", verdict.status)
    return d


def reason_dict(reason: Any) -> dict[str, Any]:
    """One reason as ``{"code": ..., "message": ...}``."""
    if hasattr(reason, "to_dict"):
        return dict(reason.to_dict())
    return {"code": getattr(reason, "code", None), "message": str(reason)}


@click.command(
    cls=Command,
    epilog="""\b
Examples:
  jaxexp check runs:/0f3c.../model
  jaxexp check models:/classifier@best --json
  jaxexp check exported.bin
""",
)
@click.argument("uri")
@click.option(
    "--allow-other-platform",
    is_flag=True,
    help="Judge as if loading with allow_other_platform=True (platform mismatch only warns).",
)
@common_options
def check(uri: str, allow_other_platform: bool, as_json: bool, debug: bool) -> None:
    """The compatibility verdict of a model for this machine and environment.

    Compares what the model needs (platforms, device count, calling convention, custom calls,
    serialization schema) with the running JAX, jaxlib and devices. Prints "ok", "warn" or
    "incompatible" with one reason and what to do per finding. Exits 0 for ok and warn, 1 for
    incompatible. Only MLmodel and the blob are downloaded. JAX deserializes the blob in an
    isolated child process (memory cap, timeout, nothing imported from the current directory):
    a blob that crashes it exits 2. Also lists any Python the model directory carries (none by
    default; jaxexp never imports it).
    """
    setup_logging(debug)
    target = resolve(uri, parts=())
    verdict, payload = assess_target(target, allow_other_platform=allow_other_platform)
    if verdict.status != "incompatible":  # can JAX read it? in a capped child: a crash is a "no"
        from jaxexp_mlflow.codec import files
        from jaxexp_mlflow.runtime.isolate import probe, probe_file

        node_types = target.flavor.get("pytree_node_types")
        with step("Deserializing in an isolated process"):
            if len(target.blob_data) > files.MAX_BLOB_BYTES:  # refused as probe_file refuses it
                probe_file(target.blob_path, node_types=node_types)
            probe(target.blob_data, source=target.blob_path.name, node_types=node_types)
    from jaxexp_mlflow.cli.environment import environment, environment_line

    env = environment()
    carried = model_python(target)
    routes = device_routes(target, verdict)
    if as_json:
        extra = {} if carried is None else {"model_python": carried}
        if routes:
            extra["routes"] = [r.to_dict() for r in routes]
        emit_json({"uri": uri, "environment": env, **payload, **extra})
    else:
        click.echo(f"Model        {uri}")
        click.echo(f"Environment  {environment_line(env)}")
        if carried is not None:
            click.echo(
                textwrap.fill(
                    python_line(carried),
                    100,
                    initial_indent="Python       ",
                    subsequent_indent="             ",
                )
            )
        click.echo(f"Verdict      {verdict.status}")
        for reason in verdict.reasons:
            click.echo(
                textwrap.fill(str(reason), 100, initial_indent="  - ", subsequent_indent="    ")
            )
        if not verdict.reasons:
            click.echo("  (no findings: the model should load and run here)")
        if verdict.status == "incompatible" and routes:
            click.echo("Routes       that run it here, taken only when asked (--route NAME):")
            for r in routes:
                click.echo(
                    textwrap.fill(str(r), 100, initial_indent="  - ", subsequent_indent="    ")
                )
    if verdict.status == "incompatible":
        click.get_current_context().exit(1)
