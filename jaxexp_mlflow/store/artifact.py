"""The jaxexp model directory: what ``save_model`` writes next to MLmodel and how it is read back.

Layout (all paths relative to the model directory; no pickle anywhere)::

    exported.bin             Exported.serialize(vjp_order) bytes, unchanged
    params/                  Orbax checkpoint of the params (absent when the model has none)
    reference/inputs.npz     the input example, flat leaves in_0, in_1, ... (inputs only)
    reference/outputs.npz    the outputs computed from it at save time, out_0, out_1, ...

The MLmodel ``jaxexp`` section (see ``store.section``) records avals, trees, versions, checksum
and the dtypes of the reference leaves. Importing this module imports no JAX (the IREE backend
and pyfunc's model identity read the blob and the params directory through it); the functions
that handle JAX values import it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.codec import arrays, blob, files
from jaxexp_mlflow.errors import ArtifactError, ParamsMismatchError

EXPORTED_FILE = "exported.bin"
PARAMS_DIR = "params"
REFERENCE_INPUTS = "reference/inputs.npz"
REFERENCE_OUTPUTS = "reference/outputs.npz"


def args_tree(exported: Any) -> tuple[Any, Any]:
    """The treedefs of the positional args tuple and of the kwargs dict of an export."""
    args, kwargs = exported.in_tree.children()
    return args, kwargs


def params_treedef(exported: Any) -> Any:
    """Treedef of the first positional argument (where the params go)."""
    args, _ = args_tree(exported)
    children = args.children()
    if not children:
        raise ParamsMismatchError(
            f"params were given, but the exported function {exported.fun_name!r} takes no "
            f"positional arguments (in_tree {exported.in_tree}). Export fn(params, *inputs), or "
            "pass params=None."
        )
    return children[0]


#: ``params_layout`` of a checkpoint holding the flat ``{name: array}`` dict (PRNG keys as
#: key data); models without it hold the export's own params tree (older models, copied
#: checkpoints).
NAMED_LAYOUT = "named"


def param_names(meta: dict[str, Any] | None, n: int) -> list[str] | None:
    """The recorded params names (export leaf order), checked; None for older models."""
    from jaxexp_mlflow.params.names import safe_name

    names = (meta or {}).get("param_names")
    if names is None:
        return None
    if (
        not isinstance(names, list)
        or len(names) != n
        or len(set(names)) != n
        or not all(safe_name(x) for x in names)
    ):
        raise ArtifactError(
            f"MLmodel's param_names do not fit the export: expected {n} distinct relative "
            f"names, found {str(names)[:200]}. The MLmodel file was altered; download the "
            "model again."
        )
    return names


def params_target(exported: Any, in_shardings: tuple = (), meta: dict | None = None) -> Any:
    """ShapeDtypeStructs (with the placement's shardings) the checkpoint must restore into.

    For a model in the named layout (``meta['params_layout']``) a dict ``{name: struct}``
    (typed PRNG keys as their key data), else the export's params tree.
    """
    import jax

    from jaxexp_mlflow.params.names import dtype_impl_name, key_data_spec

    treedef = params_treedef(exported)
    n = treedef.num_leaves
    shardings = list(in_shardings[:n]) or [None] * n
    avals = exported.in_avals[:n]
    if (meta or {}).get("params_layout") == NAMED_LAYOUT:
        names = param_names(meta, n) or []
        impls = meta.get("param_keys") or {}
        out = {}
        for name, a, s in zip(names, avals, shardings, strict=True):
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                out[name] = key_data_spec(
                    tuple(a.shape), impls.get(name) or dtype_impl_name(a.dtype)
                )
            else:
                out[name] = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        return out
    leaves = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(avals, shardings, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


def check_params(exported: Any, params: Any) -> int:
    """Verify ``params`` fit the export's first argument; return its number of leaves."""
    import jax

    from jaxexp_mlflow.store.section import aval_str

    expected = params_treedef(exported)
    leaves, found = jax.tree.flatten(params)
    if found != expected:
        raise ParamsMismatchError(
            f"params do not have the structure of the exported function's first argument: "
            f"expected {expected}, found {found}. Pass the params the function was exported with "
            "(the export's first argument), or params=None for a function without params."
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for path, leaf, aval in zip(paths, leaves, exported.in_avals, strict=False):
        got = jax.ShapeDtypeStruct(
            np.shape(leaf), getattr(leaf, "dtype", None) or jax.numpy.result_type(leaf)
        )
        if tuple(got.shape) != tuple(aval.shape) or got.dtype != aval.dtype:
            narrowed = (
                tuple(got.shape) == tuple(aval.shape)
                and jax.dtypes.canonicalize_dtype(got.dtype) == aval.dtype
            )
            hint = (
                f" jax computes {got.dtype} as {aval.dtype} while jax_enable_x64 is off: pass "
                f"these params as {aval.dtype} (.astype(np.{aval.dtype})), what the function "
                "computes with, or turn jax_enable_x64 on before exporting."
                if narrowed
                else ""
            )
            raise ParamsMismatchError(
                f"params{path}: expected {aval_str(aval)}, found "
                f"{got.dtype}{list(got.shape)}. Pass params of the exported shapes and dtypes, "
                f"or export the function again for these params.{hint}"
            )
    return len(leaves)


def _nbytes(tree: Any) -> int:
    import jax

    def leaf(x: Any) -> int:
        for get in (lambda: x.nbytes, lambda: np.asarray(x).nbytes):
            try:
                return int(get())
            except Exception:  # noqa: BLE001 - typed PRNG keys and other opaque leaves
                continue
        return 0

    return sum(leaf(x) for x in jax.tree.leaves(tree))


def model_bytes(data: bytes, params: Any, input_example: Any) -> int:
    """About how many bytes a model needs on disk (blob, params, reference in and out)."""
    if isinstance(params, str | os.PathLike):  # an existing checkpoint: its size on disk
        n_params = sum(
            f.stat().st_size for f in Path(params).rglob("*") if f.is_file() and not f.is_symlink()
        )
    else:
        n_params = _nbytes(params)
    return len(data) + n_params + 2 * _nbytes(input_example) + (1 << 16)


def check_free_space(path: str | os.PathLike, needed: int) -> None:
    """Raise ``ArtifactError`` before writing anything when ``needed`` bytes do not fit."""
    if files.free_bytes(path) < needed:
        raise files.disk_full(path, needed)


def write_blob(path: str | os.PathLike, data: bytes) -> None:
    """Write ``exported.bin``; a full disk is an ``ArtifactError`` saying how much was needed."""
    try:
        Path(path, EXPORTED_FILE).write_bytes(data)
    except OSError as err:
        if files.is_disk_full(err):
            raise files.disk_full(path, len(data), err) from None
        raise


def write_reference(
    path: str | os.PathLike, inputs: tuple, outputs: Any, platform: str | None = None
) -> dict[str, Any]:
    """Store the input example and its outputs; return the dtype lists for MLmodel, and the
    platform (``cpu``, ``cuda``...) that computed the outputs when known."""
    import jax

    ref = Path(path, "reference")
    ref.mkdir(parents=True, exist_ok=True)
    in_dtypes = arrays.save_arrays(Path(path, REFERENCE_INPUTS), jax.tree.leaves(inputs), "in")
    out_dtypes = arrays.save_arrays(Path(path, REFERENCE_OUTPUTS), jax.tree.leaves(outputs), "out")
    digests = {
        side: hashlib.sha256(Path(path, rel).read_bytes()).hexdigest()
        for side, rel in (("inputs", REFERENCE_INPUTS), ("outputs", REFERENCE_OUTPUTS))
    }
    ref: dict[str, Any] = {
        "input_dtypes": in_dtypes,
        "output_dtypes": out_dtypes,
        "sha256": digests,  # damage to the files reads as damage, not as a failed reproduction
    }
    if platform:
        ref["platform"] = str(platform)
    return ref


def read_reference(path: str | os.PathLike, meta: dict[str, Any]) -> tuple[list, list] | None:
    """The stored reference (flat input leaves, flat output leaves), or None if there is none.

    The npz files are read confined to the model directory, and their members' declared sizes
    are checked against the bytes on disk before anything is decompressed (``arrays``).
    """
    ref = meta.get("reference")
    if not ref:
        return None
    loaded = []
    digests = ref.get("sha256") or {}
    for rel, key, prefix, side in (
        (REFERENCE_INPUTS, "input_dtypes", "in", "inputs"),
        (REFERENCE_OUTPUTS, "output_dtypes", "out", "outputs"),
    ):
        file = files.resolve_inside(path, rel, what=f"reference file {rel}")
        try:
            loaded.append(
                arrays.load_arrays(file, ref[key], prefix, what=rel, sha256=digests.get(side))
            )
        except ArtifactError:
            raise
        except arrays.DAMAGED as err:
            raise ArtifactError(
                f"The model's reference arrays ({rel}) are missing or damaged "
                f"({type(err).__name__}). Download the model again."
            ) from err
    return loaded[0], loaded[1]


def params_dir(path: str | os.PathLike, meta: dict[str, Any]) -> Path | None:
    """The model's params checkpoint directory (confined to the model), or None without params."""
    if not meta.get("params"):
        return None
    ckpt = files.resolve_inside(path, meta["params"], what="params checkpoint")
    if not ckpt.is_dir():
        raise ArtifactError(
            f"The model's params checkpoint ({meta['params']!s:.100}) is missing: expected a "
            "directory. Download the complete model directory (exported.bin, params/, MLmodel) "
            "again."
        )
    return ckpt


def blob_name(meta: dict[str, Any]) -> str:
    """The blob's path inside the model directory, as MLmodel records it."""
    name = meta.get("exported_file", EXPORTED_FILE)
    return EXPORTED_FILE if name is None else name


def read_blob(path: str | os.PathLike, meta: dict[str, Any]) -> bytes:
    """Read ``exported.bin`` (confined, regular file, bounded), verified against its sha256.

    ``exported_sha256`` is required: a model without it is refused, never read unchecked.
    """
    name = blob_name(meta)
    data = files.read_bytes(
        path, name, what=f"serialized function ({name!s:.100})", max_bytes=files.MAX_BLOB_BYTES
    )
    return check_blob(data, meta)


def check_blob(data: bytes, meta: dict[str, Any]) -> bytes:
    """``data``, the blob as read, once it matches MLmodel's ``exported_sha256`` (required);
    ``ArtifactError`` otherwise (what :func:`read_blob` raises)."""
    name = blob_name(meta)
    expected = meta.get("exported_sha256")
    if not expected:
        raise ArtifactError(
            f"The model's MLmodel has no exported_sha256: expected the checksum of {name!s:.100}, "
            "found none, so the blob cannot be trusted. Download the model again, or re-log it."
        )
    blob.verify_checksum(data, expected, source=str(name))
    return data
