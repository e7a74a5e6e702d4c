"""``jaxexp verify --env-manager``: the reference re-run in the model's recorded environment,
next to the stored reference and the current environment (the drift between the three)."""

from __future__ import annotations

import logging
from typing import Any

import click

from jaxexp_mlflow.cli._common import (
    TRUST_REQUIREMENTS,
    Failure,
    emit_json,
    fmt_err,
    safe_text,
    step,
    table,
)
from jaxexp_mlflow.cli.inspect import output_labels


def _here(target: Any, inputs: list, **load_options: Any) -> tuple[list | None, str | None]:
    """The model's outputs on the reference input in this environment, or why it cannot run."""
    from jaxexp_mlflow.cli.loading import load
    from jaxexp_mlflow.runtime.probes import call_flat

    try:
        model = load(target, **load_options)
        with step("Running the reference input here (compile + run)"):
            return call_flat(model, inputs), None
    except Exception as err:  # noqa: BLE001 - reported in the drift table
        return None, " ".join(str(getattr(err, "message", None) or err).split())[:500]


def _pair(got: list | None, want: list | None, rtol: Any, atol: Any) -> list | None:
    from jaxexp_mlflow.archive.reproduce import compare_outputs

    if got is None or want is None:
        return None
    return compare_outputs(got, want, rtol=rtol, atol=atol)


def _cell(checks: list | None, i: int, error: str | None) -> str:
    if checks is None:
        return "did not run" if error else "-"
    c = checks[i]
    return f"{fmt_err(c.max_abs_err)} {'ok' if c.passed else 'DIFF'}"


def verify_in_recorded_env(
    uri: str,
    target: Any,
    env_manager: str,
    *,
    rtol: float | None,
    atol: float | None,
    as_json: bool,
    trust_requirements: bool | None = None,
    **load_options: Any,
) -> None:
    """Run the reference in the recorded environment and here; print the drift side by side.

    What the environment installs is printed (stderr) before anything is installed; unless
    ``trust_requirements`` (default: ``--trust-requirements``, see ``cli/_common.py``), anything
    beyond plain requirements from the index is refused first (``UntrustedRequirementsError``,
    exit 2). Exits 1 unless both the recorded environment and this one reproduce the stored
    outputs.
    """
    from jaxexp_mlflow.archive.recorded_env import check_requirements, run_recorded
    from jaxexp_mlflow.cli.environment import environment, environment_line
    from jaxexp_mlflow.store import artifact

    if not logging.getLogger().isEnabledFor(logging.INFO):  # MLflow's env chatter: --debug
        for name in ("mlflow.utils.virtualenv", "mlflow.utils.environment"):
            logging.getLogger(name).setLevel(logging.WARNING)
    flavor = target.flavor
    ref = artifact.read_reference(target.path, flavor)
    if ref is None:
        raise Failure(f"{uri} carries no reference input/outputs: nothing to reproduce")
    inputs, stored = ref
    if trust_requirements is None:
        ctx = click.get_current_context(silent=True)
        trust_requirements = bool(ctx and ctx.meta.get(TRUST_REQUIREMENTS))
    plan = check_requirements(target.path, env_manager, trust=trust_requirements)
    click.echo(safe_text(plan.describe(), multiline=True), err=True)
    with step(f"Restoring the recorded environment ({env_manager}) and running the reference"):
        recorded = run_recorded(target.path, env_manager, trust_requirements=trust_requirements)
    here_out, here_err = _here(target, inputs, **load_options)
    env = environment()
    rec_vs_stored = _pair(recorded.outputs, stored, rtol, atol)
    here_vs_stored = _pair(here_out, stored, rtol, atol)
    here_vs_rec = _pair(here_out, recorded.outputs, rtol, atol)
    paths = output_labels(target, len(stored))
    ok_rec = rec_vs_stored is not None and all(c.passed for c in rec_vs_stored)
    ok_here = here_vs_stored is not None and all(c.passed for c in here_vs_stored)
    if as_json:

        def dicts(checks: list | None) -> list | None:
            return None if checks is None else [c.to_dict() for c in checks]

        emit_json(
            {
                "ok": ok_rec and ok_here,
                "uri": uri,
                "saved_with": {k: flavor.get(k) for k in ("jax_version", "jaxlib_version")},
                "recorded_environment": {
                    "env_manager": recorded.env_manager,
                    "requirements": recorded.requirements,
                    # what the model's own requirements add (installed only when trusted)
                    "model_adds": plan.facts.added if plan.facts else [],
                    "model_adds_installed": bool(trust_requirements),
                    "python": recorded.python,
                    "jax_version": recorded.jax_version,
                    "jaxlib_version": recorded.jaxlib_version,
                    "error": recorded.error,
                    "reproduces": ok_rec,
                    # which jaxexp-mlflow loaded it there (never a copy in the model's code/)
                    "loader": recorded.details.get("loader"),
                    "loader_path": recorded.details.get("jaxexp_mlflow_path"),
                },
                "environment": {**env, "error": here_err, "reproduces": ok_here},
                "outputs": paths,
                "recorded_vs_stored": dicts(rec_vs_stored),
                "here_vs_stored": dicts(here_vs_stored),
                "here_vs_recorded": dicts(here_vs_rec),
            }
        )
    else:
        saved = flavor.get("jax_version")
        click.echo(f"Model     {uri}")
        click.echo(
            f"Saved by  jax {saved}" if saved else "Saved by  (unknown jax: logged as bytes)"
        )
        click.echo(f"Recorded  {recorded.describe()}")
        click.echo(f"Running   {environment_line(env)}")
        click.echo("")
        rows = [
            [
                p,
                "x".join(map(str, stored[i].shape)) or "scalar",
                str(stored[i].dtype),
                _cell(rec_vs_stored, i, recorded.error),
                _cell(here_vs_stored, i, here_err),
                _cell(here_vs_rec, i, here_err or recorded.error),
            ]
            for i, p in enumerate(paths)
        ]
        heads = ["output", "shape", "dtype", "recorded env vs stored", "here vs stored"]
        click.echo(table([*heads, "here vs recorded env"], rows))
        click.echo("")
        if recorded.error:
            click.echo(f"Recorded environment: the model failed: {recorded.error}")
        if here_err:
            click.echo(f"This environment: the model cannot run here: {here_err}")
        click.echo(
            "Reproduced in the recorded environment and here."
            if ok_rec and ok_here
            else f"Recorded environment: {'reproduces' if ok_rec else 'does NOT reproduce'}; "
            f"here: {'reproduces' if ok_here else 'does NOT reproduce'}."
        )
    if not (ok_rec and ok_here):
        click.get_current_context().exit(1)
