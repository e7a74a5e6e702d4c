"""Run inside a model's restored environment (``jaxexp verify --env-manager``); not imported.

Usage: ``python _env_runner.py MODEL_DIR OUT_DIR [LOADER_DIR]``, or ``python _env_runner.py
--blob MODE BLOB OUT_DIR`` (``MODE`` ``run`` or ``reexport``; see :func:`blob_main`). Loads the
model with the
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
        from jaxexp_mlflow.runtime.platforms import running_platform

        result["backend"] = running_platform()
        import jaxexp_mlflow
        from jaxexp_mlflow.runtime import cache
        from jaxexp_mlflow.runtime.loader import load_directory
        from jaxexp_mlflow.store import artifact
        from jaxexp_mlflow.store.section import read_section

        result["jaxexp_mlflow"] = getattr(jaxexp_mlflow, "__version__", None)
        result["jaxexp_mlflow_path"] = getattr(jaxexp_mlflow, "__file__", None)
        start = time.perf_counter()
        cache.configure()  # as load_model does for a local directory
        model = load_directory(model_dir, read_section(model_dir), allow_incompatible=True)
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


def _placement(exported, jax, np):  # noqa: ANN001, ANN202 - jax and numpy passed in
    """(in shardings, out shardings) of ``exported`` on this process's devices: a 1-axis mesh
    of ``nr_devices`` for HLO shardings (what the old blobs carry); None for 1 device."""
    n = int(exported.nr_devices)
    if n == 1:
        return (None,) * len(exported.in_avals), None
    mesh = _mesh(exported, jax, np)
    return tuple(exported.in_shardings_jax(mesh)), tuple(exported.out_shardings_jax(mesh))


def _mesh(exported, jax, np):  # noqa: ANN001, ANN202 - jax and numpy passed in
    """A mesh of ``nr_devices`` devices shaped as the export's own (its named shardings, else
    its module's Shardy mesh), else one axis ``jaxexp``."""
    n = int(exported.nr_devices)
    devs = jax.devices()
    if len(devs) < n:
        raise RuntimeError(f"exported for {n} devices, {len(devs)} visible")
    from jax.sharding import Mesh

    shape, names = (n,), ("jaxexp",)
    named = (
        *(getattr(exported, "_in_named_shardings", None) or ()),
        *(getattr(exported, "_out_named_shardings", None) or ()),
    )
    for s in named:  # the exported mesh's shape
        mesh = getattr(s, "mesh", None)
        if mesh is not None and getattr(mesh, "axis_sizes", None):
            shape, names = tuple(mesh.axis_sizes), tuple(mesh.axis_names)
            break
    else:  # no sharding at all (HLO ones keep the one axis): the module's own Shardy mesh
        import re

        hlo = (*exported.in_shardings_hlo, *exported.out_shardings_hlo)
        if any(h is not None for h in hlo):
            return Mesh(np.array(devs[:n]), names)

        found = re.search(r"sdy\.mesh @\w+ = <\[([^\]]*)\]", exported.mlir_module())
        axes = re.findall(r'"([^"]+)"=(\d+)', found.group(1)) if found else []
        if axes and int(np.prod([int(k) for _, k in axes])) == n:
            shape, names = tuple(int(k) for _, k in axes), tuple(a for a, _ in axes)
    return Mesh(np.array(devs[:n]).reshape(shape), names)


def _spanning(in_sh, exported, jax, np):  # noqa: ANN001, ANN202 - jax and numpy passed in
    """``in_sh`` for a run: an unspecified input sharding replicated on the export's mesh, so
    that the call spans the devices the blob was exported for."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _mesh(exported, jax, np)
    whole = NamedSharding(mesh, PartitionSpec())
    return tuple(whole if s is None else s for s in in_sh)


def _init_kernels(jax, np) -> None:  # noqa: ANN001 - jax and numpy passed in
    """Old jaxlibs (<= 0.6) fill their LAPACK/BLAS kernel table from scipy only when JAX
    lowers a linear-algebra op; a deserialized module lowers none, and calling a kernel before
    that crashes the process. Lowering (not running) a triangular solve, an LU and an eigh
    fills it; on newer jaxlibs it costs a few milliseconds."""
    try:
        a = np.eye(2, dtype=np.float32)
        for fn in (
            lambda x: jax.scipy.linalg.solve_triangular(x, x),
            jax.numpy.linalg.solve,
            jax.numpy.linalg.eigh,
        ):
            jax.jit(fn).lower(a, a) if fn is jax.numpy.linalg.solve else jax.jit(fn).lower(a)
    except Exception:  # noqa: BLE001 - a jax without these: nothing to fill
        pass


def _vjp_depth(exported, limit: int = 8) -> int:  # noqa: ANN001
    depth, e = 0, exported
    while depth < limit and e.has_vjp():
        e, depth = e.vjp(), depth + 1
    return depth


def blob_main(mode: str, blob: str, out_dir: str) -> int:
    """A bare blob in a jax-only environment (the ``bridge`` and ``recorded-env`` routes).

    ``run``: the blob called on ``OUT_DIR/inputs.npz`` (flat leaves ``in_0``...; dtypes numpy
    lacks as raw bits, real dtypes in ``OUT_DIR/inputs.json``), outputs to ``outputs.npz``.
    ``reexport``: the blob deserialized, wrapped in ``jax.jit`` of ``Exported.call`` (HLO
    shardings placed as NamedShardings on a 1-axis mesh), exported again with the same
    platforms, symbolic shapes, disabled checks and VJP depth, written to ``exported.bin``.
    Imports only jax and numpy; ``result.json`` holds versions and the error, if any.
    """
    result = {"python": platform.python_version(), "mode": mode}
    try:
        _add_loader(None)
        import jax
        import numpy as np
        from jax import export

        result["jax_version"] = jax.__version__
        result["jaxlib_version"] = getattr(__import__("jaxlib"), "__version__", None)
        _init_kernels(jax, np)
        with open(blob, "rb") as f:
            exported = export.deserialize(bytearray(f.read()))
        in_sh, out_sh = _placement(exported, jax, np)
        start = time.perf_counter()
        if mode == "reexport":
            specs = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(exported.in_avals, in_sh, strict=True)
            ]
            args, kwargs = jax.tree.unflatten(exported.in_tree, specs)

            def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
                return exported.call(*a, **k)

            wrapper.__name__ = wrapper.__qualname__ = str(exported.fun_name)
            if out_sh is not None:
                jitted = jax.jit(
                    wrapper, out_shardings=jax.tree.unflatten(exported.out_tree, out_sh)
                )
            else:
                jitted = jax.jit(wrapper)
            new = export.export(
                jitted,
                platforms=tuple(exported.platforms),
                disabled_checks=list(exported.disabled_safety_checks),
            )(*args, **kwargs)
            depth = _vjp_depth(exported)
            result["vjp_order"] = depth
            with open(f"{out_dir}/exported.bin", "wb") as f:
                f.write(new.serialize(vjp_order=depth))
        elif mode == "run":
            with open(f"{out_dir}/inputs.json") as f:
                dtypes = json.load(f)
            with np.load(f"{out_dir}/inputs.npz", allow_pickle=False) as data:
                raw = [data[f"in_{i}"] for i in range(len(dtypes))]
            leaves = [
                r if str(r.dtype) == d else r.view(jax.numpy.dtype(d))
                for r, d in zip(raw, dtypes, strict=True)
            ]
            in_sh = _spanning(in_sh, exported, jax, np) if int(exported.nr_devices) > 1 else in_sh
            leaves = [
                x if s is None else jax.device_put(x, s) for x, s in zip(leaves, in_sh, strict=True)
            ]
            args, kwargs = jax.tree.unflatten(exported.in_tree, leaves)
            outs = [np.asarray(x) for x in jax.tree.leaves(jax.jit(exported.call)(*args, **kwargs))]
            result["output_dtypes"] = [str(o.dtype) for o in outs]
            np.savez(
                f"{out_dir}/outputs.npz",
                **{
                    f"out_{i}": o.view(f"u{o.dtype.itemsize}")
                    if o.dtype.kind == "V" or o.dtype.name not in np.sctypeDict
                    else o
                    for i, o in enumerate(outs)
                },
            )
        else:
            raise ValueError(f"mode must be run or reexport, got {mode!r}")
        result["seconds"] = round(time.perf_counter() - start, 3)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result["error"] = f"{type(err).__name__}: {err}"[:4000]
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(f"{out_dir}/result.json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--blob"]:
        sys.exit(blob_main(*sys.argv[2:5]))
    sys.exit(main(*sys.argv[1:4]))
