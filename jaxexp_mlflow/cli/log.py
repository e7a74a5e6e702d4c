"""``jaxexp log``: log an existing blob (and Orbax checkpoint) as a jaxexp model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from jaxexp_mlflow.cli._common import (
    Command,
    InputProblem,
    common_options,
    emit_json,
    setup_logging,
    step,
)


def model_info_dict(info: Any) -> dict[str, Any]:
    """The parts of an MLflow ``ModelInfo`` a user needs to find the model again."""
    name = getattr(info, "name", None) or info.artifact_path
    return {
        "model_uri": info.model_uri,
        "model_id": getattr(info, "model_id", None),
        "run_id": info.run_id,
        "name": name,
        "artifact_location": info.artifact_path,
        "runs_uri": f"runs:/{info.run_id}/{name}" if info.run_id else None,
        "registered_model_version": getattr(info, "registered_model_version", None),
    }


def print_model_info(d: dict[str, Any], registered: str | None) -> None:
    """Where the model went, as lines a user can paste into the next command."""
    click.echo(f"Run          {d['run_id']}")
    if d["runs_uri"]:
        click.echo(f"Model URI    {d['runs_uri']}")
    if d["model_id"]:
        click.echo(f"Logged model {d['model_id']}  (models:/{d['model_id']})")
    if registered and d["registered_model_version"] is not None:
        click.echo(f"Registered   models:/{registered}/{d['registered_model_version']}")


@click.command(
    cls=Command,
    epilog="""\b
Examples:
  jaxexp log exported.bin --input-example inputs.npz --experiment archive
  jaxexp log exported.bin --params ckpt/1200/default --run-id 0f3c... --register classifier
""",
)
@click.argument("blob", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--params",
    "params_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="Orbax checkpoint of the params (the export's first argument), or a "
    "CheckpointManager step with one item.",
)
@click.option(
    "--input-example",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Inputs after the params (.npz/.npy/.json): stored with their outputs as the reference "
    "result `jaxexp verify` reproduces.",
)
@click.option("--experiment", help="Experiment name (created if missing).")
@click.option("--run-id", help="Log into this existing run instead of a new one.")
@click.option("--name", default="model", show_default=True, help="Model name in the run.")
@click.option("--register", "register", help="Also register it under this model name.")
@click.option(
    "--route",
    type=click.Choice(("auto", "direct", "expired-flag", "bridge", "recorded-env", "remesh")),
    default=None,
    help="For a blob this JAX refuses: the route that loads it here, recorded in MLmodel "
    "(default: direct, else expired-flag where it applies; bridge and recorded-env build a "
    "cached venv and are taken when asked; remesh: a blob for more devices than are here, "
    "stored as it is and run re-meshed; auto: the first that works). The output names it.",
)
@common_options
def log(
    blob: Path,
    params_dir: Path | None,
    input_example: Path | None,
    experiment: str | None,
    run_id: str | None,
    name: str,
    register: str | None,
    route: str | None,
    as_json: bool,
    debug: bool,
) -> None:
    """Log a serialized jax.export blob (and an Orbax checkpoint) as a jaxexp model.

    For artifacts produced outside Python training code. The blob is stored unchanged; the
    checkpoint is copied (hardlinked when possible) without loading it. A blob this JAX refuses
    (e.g. one of jax <= 0.7 under jax >= 0.11.1) is read back through a route, named here and
    recorded in MLmodel (see --route). Prints the run, the route, the model URIs and the
    registered version.
    """
    setup_logging(debug)
    if experiment and run_id:
        raise click.UsageError("give --experiment or --run-id, not both")
    data = blob.read_bytes()
    _check_route(data, blob, route, runs=input_example is not None, has_params=bool(params_dir))
    example = None
    if input_example is not None:
        from jaxexp_mlflow.cli.arrays_io import call_args, input_leaves, input_specs, read_payload
        from jaxexp_mlflow.errors import InputError

        payload = read_payload(input_example)
        with step("Reading the blob"):
            exported = _structure(data, blob, route)
        n_params = 0
        if params_dir is not None:
            args_tree, _ = exported.in_tree.children()
            children = args_tree.children()
            n_params = children[0].num_leaves if children else 0
        specs = input_specs(exported, bool(n_params), None)
        try:
            leaves = input_leaves(payload, specs)
        except InputError as err:
            if params_dir is not None or len(exported.in_tree.children()[0].children()) < 2:
                raise
            raise InputProblem(
                f"{err.message} If the blob's first argument is its params, pass them with "
                "--params ORBAX_DIR (the example then holds the other inputs only)."
            ) from err
        args, kwargs = call_args(exported, bool(n_params), leaves)
        if kwargs:
            raise InputProblem(
                "the blob's function takes keyword arguments; log_model's input example holds "
                "positional inputs only: log it from Python with a wrapper"
            )
        example = tuple(args)  # a tuple is the list of positional inputs
    import mlflow

    import jaxexp_mlflow.flavors.jaxexp as flavor

    if experiment:
        mlflow.set_experiment(experiment)
    with step("Logging the model"), mlflow.start_run(run_id=run_id) as run:
        info = flavor.log_model(
            data,
            name=name,
            params=None if params_dir is None else str(params_dir),
            input_example=example,
            registered_model_name=register,
            route=route,
        )
    d = model_info_dict(info)
    d["run_id"] = d["run_id"] or run.info.run_id
    taken = ((getattr(info, "flavors", None) or {}).get("jaxexp") or {}).get("route")
    if as_json:
        emit_json({"ok": True, **d, "route": taken or {"name": "direct"}})
    else:
        click.echo(
            _route_text(taken)
            if taken
            else "Route        direct: this jax reads the blob as it is (no route recorded)."
        )
        print_model_info(d, register)


def _check_route(
    data: bytes, blob: Path, route: str | None, *, runs: bool, has_params: bool
) -> None:
    """Refuse, before any run is started, a blob that no route the save would take loads here
    (``flavors.save_route.choose``: the refusal names the routes and how to ask)."""
    from jaxexp_mlflow.codec.blob import describe
    from jaxexp_mlflow.flavors import save_route

    save_route.choose(
        describe(data, source=str(blob)), route=route, runs=runs, has_params=has_params
    )


def _structure(data: bytes, blob: Path, route: str | None) -> Any:
    """An ``Exported`` of the blob for its input structure: read here (with JAX's flag where
    needed), else through the bridge when asked (the save then reuses that re-export)."""
    from jaxexp_mlflow.codec.blob import describe
    from jaxexp_mlflow.errors import IncompatibleError
    from jaxexp_mlflow.flavors import save_route

    try:
        return save_route.readable(data)
    except IncompatibleError:
        if route not in ("bridge", "auto"):
            raise
        desc = describe(data, source=str(blob))
        return save_route.readable(save_route.bridged(data, int(desc.nr_devices)))


def _route_text(taken: dict[str, Any]) -> str:
    """``Route        expired-flag (jax 0.12.0.1), closes 2026-10-04; recorded in MLmodel``."""
    who = f" (jax {taken['jax_version']})" if taken.get("jax_version") else ""
    closes = f", closes {taken['closes_on']}" if taken.get("closes_on") else ""
    name = taken.get("name")
    later = (
        "`jaxexp verify`/`predict` take it; `jaxexp refresh` makes a current copy."
        if name in ("expired-flag", "bridge")
        else f"`jaxexp verify`/`predict` take it with --route {name}."
    )
    return (
        f"Route        {name}{who}{closes}: this jax refuses the blob as it is; it was read "
        f"back through this route (recorded in MLmodel, jaxexp.route). {later}"
    )
