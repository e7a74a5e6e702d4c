"""``jaxexp refresh``: re-export a model with the running JAX and log it as a new model."""

from __future__ import annotations

import click

from jaxexp_mlflow.cli._common import (
    Command,
    InputProblem,
    common_options,
    emit_json,
    setup_logging,
    step,
    tolerance_options,
)
from jaxexp_mlflow.cli.log import model_info_dict, print_model_info


@click.command(
    cls=Command,
    epilog="""\b
Examples:
  jaxexp refresh runs:/0f3c.../model
  jaxexp refresh models:/classifier@best --register classifier
""",
)
@click.argument("uri")
@click.option("--register", help="Register the refreshed model under this name.")
@click.option("--name", default="model", show_default=True, help="Model name in the run.")
@click.option("--experiment", help="Log into a new run of this experiment (created if missing).")
@click.option("--run-id", help="Log into this existing run (default: a new run).")
@click.option(
    "--allow-other-platform",
    is_flag=True,
    help="Re-export on this backend even if the model was not exported for it.",
)
@tolerance_options("the before/after check")
@click.option(
    "--route",
    type=click.Choice(("direct", "expired-flag", "bridge", "remesh")),
    default=None,
    help="How this jax reads the source (default: the route it was logged through where it "
    "still is needed, else direct). expired-flag: JAX's flag around the deserialization only "
    "(a blob of jax <= 0.7 under jax >= 0.11.1); bridge: jax 0.10.2 (a cached venv) reads the "
    "blob and re-exports it first (old-style HLO shardings); remesh: a model for more devices "
    "than are here, re-exported for --devices; checked against the stored reference.",
)
@click.option(
    "--devices",
    type=click.IntRange(min=1),
    default=None,
    help="--route remesh: the device count of the new model (default: the devices visible).",
)
@common_options
def refresh(
    uri: str,
    register: str | None,
    name: str,
    experiment: str | None,
    run_id: str | None,
    allow_other_platform: bool,
    rtol: float | None,
    atol: float | None,
    route: str | None,
    devices: int | None,
    as_json: bool,
    debug: bool,
) -> None:
    """Re-export a model with the running JAX and log the result as a new model.

    The new export is checked against the old one on the stored reference input (within
    --rtol/--atol) before it is logged; the original model is left untouched. Prints the new
    model's URIs and, with --register, its registered version. A model of jax <= 0.7 that
    jax >= 0.11.1 refuses as expired is read with --route expired-flag (or
    JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS=1 set); one it cannot read at all (old-style HLO
    shardings) with --route bridge. A model logged through a route takes it by default.
    """
    setup_logging(debug)
    _check_uri(uri)
    from jaxexp_mlflow.flavors.refresh import refresh as do_refresh

    if experiment and run_id:
        raise click.UsageError("give --experiment or --run-id, not both")
    if experiment:
        import mlflow

        mlflow.set_experiment(experiment)
    options: dict = {"allow_other_platform": True} if allow_other_platform else {}
    if devices is not None:
        if route != "remesh":
            raise click.UsageError("--devices goes with --route remesh")
        options["devices"] = devices
    with step(f"Refreshing {uri}"):
        info = do_refresh(
            uri,
            name=name,
            registered_model_name=register,
            run_id=run_id,
            rtol=rtol,
            atol=atol,
            route=route,
            **options,
        )
    d = model_info_dict(info)
    if as_json:
        emit_json({"ok": True, "source_uri": uri, **d})
    else:
        click.echo(f"Refreshed    {uri}")
        print_model_info(d, register)


def _check_uri(uri: str) -> None:
    """Refuse what no refresh can take, in the words the other commands use: a path that does
    not exist and is no model URI, or a bare blob (no params, no reference to prove against)."""
    from pathlib import Path

    from jaxexp_mlflow.cli.uri import _SCHEME

    path = Path(uri[len("file://") :] if uri.startswith("file://") else uri).expanduser()
    if path.is_file():
        raise InputProblem(
            f"{uri}: expected a model (a directory with an MLmodel, or a model URI), found a "
            "file; a bare blob has no params or reference to refresh against: log it first "
            "with `jaxexp log`"
        )
    if not path.exists() and not _SCHEME.match(uri):
        raise InputProblem(
            f"{uri}: no such file or directory, and not a model URI (expected runs:/<run_id>/"
            "<name>, models:/<name>/<version>, models:/<name>@<alias>, models:/<model_id> or a "
            "model directory)"
        )
