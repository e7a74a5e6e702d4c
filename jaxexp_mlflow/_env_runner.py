"""Run inside a model's restored environment (``jaxexp verify --env-manager``); not imported.

Usage: ``python _env_runner.py MODEL_DIR OUT_DIR``. Loads the model with the jaxexp-mlflow copy
the model carries in ``code/`` and the jax/jaxlib its requirements pinned, runs the stored
reference input, and writes ``OUT_DIR/result.json`` (versions, output dtypes, or the error) and
``OUT_DIR/outputs.npz`` (outputs; dtypes numpy lacks, such as bfloat16, as raw bits). Uses only
what any jaxexp-mlflow version has, so that older model copies work too.
"""

import json
import platform
import sys
import time
import traceback


def _add_model_code(model_dir: str) -> None:
    """Put the model's own ``code/`` (its jaxexp-mlflow copy) first on ``sys.path``, through
    MLflow's public ``Model.load``; only a relative directory inside the model is accepted."""
    import os

    from mlflow.models import Model

    conf = Model.load(os.path.join(model_dir, "MLmodel")).flavors["jaxexp"]
    code = conf.get("code")
    if not code:
        return
    root = os.path.realpath(model_dir)
    path = os.path.realpath(os.path.join(root, str(code)))
    if not isinstance(code, str) or os.path.isabs(code) or not path.startswith(root + os.sep):
        raise ValueError(f"MLmodel jaxexp.code is {code!r}: expected a directory inside the model")
    sys.path.insert(0, path)


def main(model_dir: str, out_dir: str) -> int:
    result = {"python": platform.python_version()}
    try:
        _add_model_code(model_dir)
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
    sys.exit(main(sys.argv[1], sys.argv[2]))
