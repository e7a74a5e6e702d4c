"""``jaxexp predict``: run a model on inputs from a file; outputs to a file or a summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from jaxexp_mlflow.cli._common import (
    Command,
    Failure,
    common_options,
    emit_json,
    run_options,
    setup_logging,
    step,
    table,
)
from jaxexp_mlflow.cli.loading import route_line, route_option
from jaxexp_mlflow.cli.uri import resolve


def _stats(arr) -> tuple[str, str, str]:  # noqa: ANN001
    import numpy as np

    a = np.asarray(arr)
    if a.size == 0:
        return "-", "-", "-"
    if a.dtype.kind not in "biuf":
        a = a.astype(np.float32)
    return f"{a.min():.4g}", f"{a.max():.4g}", f"{a.astype(np.float64).mean():.4g}"


@click.command(
    cls=Command,
    epilog="""\b
Examples:
  jaxexp predict runs:/0f3c.../model --input batch.npz --output preds.npz
  jaxexp predict models:/classifier@best --input x.npy
  jaxexp predict models:/classifier/3 --input x.json --json
\b
Input files hold the inputs after the params, by the same contract as pyfunc and serving
(docs/serving/pyfunc-rest.md): .npz keyed by the signature's input names (or in_0, in_1, ... by
position); .npy for a single input; .json as an object keyed by names, a list, or the model's own
input_example.json / serving_input_example.json. Casts are lossless only (exit 2 otherwise).
""",
)
@click.argument("uri")
@click.option(
    "--input",
    "input_file",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Inputs: .npz, .npy or .json.",
)
@click.option(
    "--output",
    "output_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the outputs (flat leaves out_0, ...) to .npz, .npy or .json.",
)
@route_option
@run_options
@common_options
def predict(
    uri: str,
    input_file: Path,
    output_file: Path | None,
    route: str | None,
    devices: int | None,
    allow_incompatible: bool,
    allow_other_platform: bool,
    backend: str,
    as_json: bool,
    debug: bool,
) -> None:
    """Run a model (or a bare blob without params) on inputs read from a file.

    Without --output, prints a summary of each output (shape, dtype, min, max, mean); with
    --json, the values too. For a model this JAX refuses, the error names the routes that
    work; --route takes one (auto: the first), and the output says which ran.
    """
    setup_logging(debug)
    from jaxexp_mlflow.cli.arrays_io import (
        input_leaves,
        input_specs,
        read_payload,
        to_json_value,
        write_outputs,
    )

    payload = read_payload(input_file)
    if output_file is not None:
        from jaxexp_mlflow.cli.arrays_io import check_output_path

        check_output_path(output_file)  # fail before the expensive part
    target = resolve(uri)
    from jaxexp_mlflow.cli.loading import pick_route

    chosen = pick_route(target, route, allow_other_platform=allow_other_platform)
    name = chosen.name if chosen is not None else None
    if name == "iree":
        backend = "iree"

    flavor = target.flavor if target.kind != "blob" else None
    model = None
    if name in ("recorded-env", "virtual-devices"):
        from jaxexp_mlflow.cli.loading import blob_bytes, exported_for_specs, run_recorded_env

        specs = input_specs(exported_for_specs(blob_bytes(target)), False, flavor)
        leaves = run_recorded_env(target, chosen, input_leaves(payload, specs))
    else:
        leaves, model = _run_here(
            target, payload, name, backend, allow_incompatible, allow_other_platform, devices
        )
    from jaxexp_mlflow.cli.inspect import output_labels

    paths = output_labels(target, len(leaves))  # the same labels as verify's
    if output_file is not None:
        write_outputs(output_file, leaves)
    if as_json:
        emit_json(
            {
                "ok": True,
                "uri": uri,
                "route": chosen.to_dict() if chosen is not None else {"name": "direct"},
                **({"remeshed": model.remeshed} if getattr(model, "remeshed", None) else {}),
                "output_file": None if output_file is None else str(output_file),
                "outputs": [
                    {
                        "index": i,
                        "path": p,
                        "shape": list(a.shape),
                        "dtype": str(a.dtype),
                        **({} if output_file is not None else {"values": to_json_value(a)}),
                    }
                    for i, (p, a) in enumerate(zip(paths, leaves, strict=True))
                ],
            }
        )
        return
    rows = [
        [p, "x".join(map(str, a.shape)) or "scalar", a.dtype, *_stats(a)]
        for p, a in zip(paths, leaves, strict=True)
    ]
    if chosen is not None:
        click.echo(route_line(chosen, model))
    click.echo(table(["output", "shape", "dtype", "min", "max", "mean"], rows))
    if output_file is not None:
        click.echo(f"\nWrote {len(leaves)} output(s) to {output_file}")


def _run_here(
    target,  # noqa: ANN001
    payload,  # noqa: ANN001
    route: str | None,
    backend: str,
    allow_incompatible: bool,
    allow_other_platform: bool,
    devices: int | None = None,
) -> tuple[list, Any]:
    """(outputs, model): the model loaded in this process (by ``route``, if given; ``devices``
    for the remesh route) and run on ``payload``."""
    import numpy as np

    from jaxexp_mlflow.cli.arrays_io import call_args, input_leaves, input_specs
    from jaxexp_mlflow.cli.loading import load_judged

    model = load_judged(
        target,
        allow_incompatible=allow_incompatible,
        allow_other_platform=allow_other_platform,
        backend=backend,
        route=route if route not in (None, "iree") else None,
        **({"devices": devices} if route == "remesh" and devices is not None else {}),
    )
    flavor = target.flavor if target.kind != "blob" else None
    try:
        if backend == "iree":
            from jaxexp_mlflow.cli.arrays_io import iree_input_specs

            leaves_in = input_leaves(payload, iree_input_specs(model, flavor))
            with step("Running"):
                return model.call_flat(leaves_in), model
        import jax

        has_params = bool(model._n_param_leaves)
        specs = input_specs(model.exported, has_params, flavor)
        args, kwargs = call_args(model.exported, has_params, input_leaves(payload, specs))
        with step("Running (compile + run)"):
            out = model(*args, **kwargs)
            return [np.asarray(x) for x in jax.tree.leaves(out)], model
    except Exception as err:
        if "JaxExpError" in {c.__name__ for c in type(err).__mro__}:
            raise
        raise Failure(
            f"the model failed to run here ({type(err).__name__}: {err}); see `jaxexp check "
            f"{target.uri}`"
        ) from err
