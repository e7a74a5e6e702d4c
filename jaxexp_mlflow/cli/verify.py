"""``jaxexp verify``: reproduce an archived result on this machine and compare, per output."""

from __future__ import annotations

from typing import Any

import click

from jaxexp_mlflow.cli._common import (
    Command,
    Failure,
    InputProblem,
    common_options,
    emit_json,
    fmt_err,
    run_options,
    setup_logging,
    step,
    table,
    tolerance_options,
)
from jaxexp_mlflow.cli.environment import environment, environment_line
from jaxexp_mlflow.cli.inspect import output_labels
from jaxexp_mlflow.cli.loading import load_judged, route_line, route_option
from jaxexp_mlflow.cli.uri import resolve


@click.command(
    cls=Command,
    epilog="""\b
Examples:
  jaxexp verify runs:/0f3c.../model
  jaxexp verify models:/classifier@best --rtol 1e-4 --atol 1e-6 --json
  jaxexp verify runs:/0f3c.../model --env-manager uv   # also in the logged environment
  jaxexp verify runs:/0f3c.../model --route auto       # a model this JAX refuses
""",
)
@click.argument("uri")
@tolerance_options("the comparison with the stored reference")
@click.option(
    "--env-manager",
    type=click.Choice(["uv", "virtualenv"]),
    default=None,
    help="Also re-run the reference in the environment the model was logged with (built from "
    "the versions MLmodel records, from your package index) and show the drift side by side.",
)
@route_option
@run_options
@common_options
def verify(
    uri: str,
    rtol: float | None,
    atol: float | None,
    env_manager: str | None,
    route: str | None,
    devices: int | None,
    allow_incompatible: bool,
    allow_other_platform: bool,
    backend: str,
    as_json: bool,
    debug: bool,
) -> None:
    """Reproduce an archived result: run the stored reference input, compare with its outputs.

    Loads the model on this machine, runs the input example stored at logging time and compares
    each output with the output recorded then (shape, dtype, max abs and rel error). Exits 1 on a
    mismatch or when the model cannot run here. Default tolerances depend on the dtype (16-bit
    2e-2, 32-bit rtol 1e-5/atol 1e-6, 64-bit 1e-12/1e-14, integers and bools exact). For a
    model this JAX refuses, the error names the routes that work; --route takes one (auto: the
    first), and the output says which ran.
    """
    setup_logging(debug)
    target = resolve(uri)
    if target.kind == "blob":
        raise InputProblem(
            f"{uri} is a bare blob: it carries no reference input/outputs to reproduce. Log it "
            "with an input example (`jaxexp log BLOB --input-example FILE`) and verify that"
        )
    from jaxexp_mlflow.cli._common import TRUST_REQUIREMENTS

    if click.get_current_context().meta.get(TRUST_REQUIREMENTS) and not env_manager:
        raise click.UsageError(
            "--trust-requirements applies to the environment --env-manager restores: pass "
            "--env-manager uv|virtualenv with it, or leave it out"
        )
    if env_manager and route:
        raise InputProblem(
            "--env-manager and --route are two ways to pick the JAX that runs the model: pass one"
        )
    if env_manager:
        from jaxexp_mlflow.cli.verify_env import verify_in_recorded_env

        return verify_in_recorded_env(
            uri,
            target,
            env_manager,
            rtol=rtol,
            atol=atol,
            as_json=as_json,
            allow_incompatible=allow_incompatible,
            allow_other_platform=allow_other_platform,
        )
    from jaxexp_mlflow.archive.reproduce import verify_directory
    from jaxexp_mlflow.cli.loading import pick_route

    chosen = pick_route(target, route, allow_other_platform=allow_other_platform)
    name = chosen.name if chosen is not None else None
    if name == "iree":
        backend = "iree"
    model = checks = None
    if name in ("recorded-env", "virtual-devices"):
        checks, env = _verify_recorded_env(target, chosen, rtol=rtol, atol=atol)
    else:
        model = load_judged(
            target,
            allow_incompatible=allow_incompatible,
            allow_other_platform=allow_other_platform,
            isolate=True,  # a blob that crashes JAX's deserializer is refused, not fatal
            backend=backend,
            route=name if name not in (None, "iree") else None,
            **({"devices": devices} if name == "remesh" and devices is not None else {}),
        )
        env = environment(backend)
    try:
        if model is not None:
            with step("Running the reference input (compile + run)"):
                checks = verify_directory(model, target.path, rtol=rtol, atol=atol)
    except Exception as err:
        if {c.__name__ for c in type(err).__mro__} & {"JaxExpError"}:
            raise
        raise Failure(
            f"the model failed to run here ({type(err).__name__}: {err}); see `jaxexp check "
            f"{uri}` and consider `jaxexp refresh`"
        ) from err
    paths = output_labels(target, len(checks))
    passed = all(c.passed for c in checks)
    flavor = target.flavor
    synthetic = flavor.get("reference_synthetic")
    reference = "input example and outputs stored at logging time"
    if synthetic:
        dims = ", ".join(f"{k}={v}" for k, v in synthetic["dims"].items()) or "static shapes"
        reference = f"synthetic probe ({dims}; seed {synthetic['seed']}), stored at save time"
    from jaxexp_mlflow.archive.reproduce import reference_platform, running_platform_of

    ref_platform = reference_platform(flavor)
    if model is not None and ref_platform != running_platform_of(model):
        reference += (
            f", computed on {ref_platform}; this run is on {running_platform_of(model)}: "
            "cross-platform tolerances (docs/hardware.md)"
        )
    if as_json:
        emit_json(
            {
                "ok": passed,
                "uri": uri,
                "route": chosen.to_dict() if chosen is not None else {"name": "direct"},
                **({"remeshed": model.remeshed} if getattr(model, "remeshed", None) else {}),
                "reference": {
                    "synthetic": bool(synthetic),
                    "platform": ref_platform,
                    **(synthetic or {}),
                },
                "saved_with": {
                    "jax_version": flavor.get("jax_version"),
                    "jaxlib_version": flavor.get("jaxlib_version"),
                    "platforms": flavor.get("platforms"),
                },
                "environment": env,
                "outputs": [{**c.to_dict(), "path": p} for c, p in zip(checks, paths, strict=True)],
            }
        )
    else:
        saved = flavor.get("jax_version")
        click.echo(f"Model     {uri}")
        click.echo(
            f"Saved by  jax {saved}" if saved else "Saved by  (unknown jax: logged as bytes)"
        )
        click.echo(f"Running   {environment_line(env)}")
        if chosen is not None:
            click.echo(route_line(chosen, model))
        click.echo(f"Reference {reference}")
        click.echo("")
        rows = [
            [
                p,
                "x".join(map(str, c.shape)) or "scalar",
                c.dtype,
                fmt_err(c.max_abs_err),
                fmt_err(c.max_rel_err),
                f"{c.rtol:g}/{c.atol:g}",
                "pass" if c.passed else "FAIL",
            ]
            for c, p in zip(checks, paths, strict=True)
        ]
        click.echo(
            table(
                ["output", "shape", "dtype", "max abs err", "max rel err", "rtol/atol", "result"],
                rows,
            )
        )
        click.echo("")
        n_fail = sum(not c.passed for c in checks)
        click.echo(
            f"Reproduced: all {len(checks)} output(s) match."
            if passed
            else f"MISMATCH: {n_fail} of {len(checks)} output(s) differ beyond tolerance."
        )
    if not passed:
        ctx = click.get_current_context()
        ctx.exit(1)


def _verify_recorded_env(
    target: Any, chosen: Any, *, rtol: float | None, atol: float | None
) -> tuple[list, dict[str, Any]]:
    """(checks, environment) of the stored reference run by ``chosen.jax_version`` in a cached
    venv (the recorded-env route; models without params, as ``jaxexp predict``'s)."""
    from jaxexp_mlflow.archive.reproduce import compare_outputs
    from jaxexp_mlflow.cli.loading import run_recorded_env
    from jaxexp_mlflow.store import artifact

    ref = artifact.read_reference(target.path, target.flavor)
    if ref is None:
        raise Failure(
            f"The model at {target.uri} carries no reference input/outputs, so there is nothing "
            "to reproduce"
        )
    inputs, outputs = ref
    outs = run_recorded_env(target, chosen, list(inputs))
    env = {
        "jax_version": chosen.jax_version,
        "jaxlib_version": chosen.jax_version,
        "backend": "cpu",
        "device_kind": "cpu (simulated, child process)"
        if chosen.name == "virtual-devices"
        else "cpu (cached venv)",
        "device_count": int(target.flavor.get("nr_devices") or 1),
    }
    return compare_outputs(outs, outputs, rtol=rtol, atol=atol), env
