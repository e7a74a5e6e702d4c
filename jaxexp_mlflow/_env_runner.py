"""Run inside a model's restored environment (``jaxexp verify --env-manager``); not imported.

Usage: ``python _env_runner.py MODEL_DIR OUT_DIR [LOADER_DIR]``. Loads the model with the
jaxexp-mlflow installed in the environment (its requirements name it) and the jax/jaxlib they
pinned, runs the stored reference input, and writes ``OUT_DIR/result.json`` (versions, output
dtypes, or the error) and ``OUT_DIR/outputs.npz`` (outputs; dtypes numpy lacks, such as
bfloat16, as raw bits). Uses only what any jaxexp-mlflow version has.

Nothing is imported from the model directory, not even the copy of jaxexp-mlflow an
``include_package=True`` model carries in ``code/``. ``LOADER_DIR`` (a directory holding only a
link to the parent's jaxexp_mlflow package) is appended to ``sys.path``: it is used only where
the environment has no jaxexp-mlflow of its own (not on the index at hand; older models whose
requirements do not name it).
"""

import json
import platform
import sys
import time
import traceback


def _add_loader(loader_dir: str | None) -> None:
    """The parent's jaxexp-mlflow, last on ``sys.path``; this script's own directory (the
    package directory, whose modules would otherwise be importable as top-level names) out."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    if loader_dir:
        sys.path.append(loader_dir)


def main(model_dir: str, out_dir: str, loader_dir: str | None = None) -> int:
    result = {"python": platform.python_version()}
    try:
        _add_loader(loader_dir)
        import jax
        import numpy as np

        result["jax_version"] = jax.__version__
        try:
            import jaxlib

            result["jaxlib_version"] = jaxlib.__version__
        except Exception:  # noqa: BLE001 - informative only
            result["jaxlib_version"] = None
        result["backend"] = jax.default_backend()
        import jaxexp_mlflow
        from jaxexp_mlflow import artifact
        from jaxexp_mlflow.flavors import jaxexp as flavor

        result["jaxexp_mlflow"] = getattr(jaxexp_mlflow, "__version__", None)
        result["jaxexp_mlflow_path"] = getattr(jaxexp_mlflow, "__file__", None)
        start = time.perf_counter()
        model = flavor.load_model(model_dir, allow_incompatible=True)
        ref = artifact.read_reference(model_dir, model.metadata)
        if ref is None:
            raise RuntimeError("the model carries no reference input")
        inputs, _ = ref
        filled = [None] * model._n_param_leaves + list(inputs)
        args, kwargs = jax.tree.unflatten(model.exported.in_tree, filled)
        if model.has_params:
            args = args[1:]
        outs = [np.asarray(x) for x in jax.tree.leaves(model(*args, **kwargs))]
        result["seconds"] = round(time.perf_counter() - start, 3)
        result["output_dtypes"] = [str(o.dtype) for o in outs]
        raw = {}
        for i, o in enumerate(outs):
            if o.dtype.kind == "V" or o.dtype.name not in np.sctypeDict:
                o = o.view(f"u{o.dtype.itemsize}")
            raw[f"out_{i}"] = o
        np.savez(f"{out_dir}/outputs.npz", **raw)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(f"{out_dir}/result.json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
