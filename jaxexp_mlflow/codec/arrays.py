"""Reference arrays (input example, reference outputs) as ``.npz`` files without pickle.

Leaves are stored flat, in the order of the exported ``in_tree``/``out_tree``, as ``<prefix>_<i>``
(the convention of the shared corpus). Dtypes numpy cannot store natively (bfloat16 and the other
ml_dtypes types) are written as their raw bits (unsigned ints of the same width) and listed with
their real dtype in ``dtypes`` so ``load_arrays`` can view them back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

_NATIVE_KINDS = "biufcU"


def _bits_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"uint{dtype.itemsize * 8}")


def dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype (``float32``, ``bfloat16``...), as jax prints it."""
    return np.dtype(dtype).name


def resolve_dtype(name: str) -> np.dtype:
    """The numpy dtype for a name, including the ml_dtypes ones (``bfloat16``, ``float8_*``)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def save_arrays(path: str | os.PathLike, leaves: Sequence[Any], prefix: str) -> list[str]:
    """Write ``leaves`` to ``path`` (npz); return their dtype names in order."""
    stored, dtypes = {}, []
    for i, leaf in enumerate(leaves):
        arr = np.asarray(leaf)
        dtypes.append(dtype_name(arr.dtype))
        if arr.dtype.kind not in _NATIVE_KINDS:  # ml_dtypes: keep the raw bits
            arr = arr.view(_bits_dtype(arr.dtype))
        stored[f"{prefix}_{i}"] = arr
    with open(path, "wb") as f:
        np.savez(f, **stored)
    return dtypes


def load_arrays(path: str | os.PathLike, dtypes: Sequence[str], prefix: str) -> list[np.ndarray]:
    """Read the leaves written by ``save_arrays``, restoring their real dtypes."""
    with np.load(path, allow_pickle=False) as data:
        out = []
        for i, name in enumerate(dtypes):
            arr = data[f"{prefix}_{i}"]
            want = resolve_dtype(name)
            out.append(arr.view(want) if arr.dtype != want else arr)
        return out


def load_reference(
    inputs: str | os.PathLike, outputs: str | os.PathLike, ref: dict[str, Any], where: str
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The reference input and output leaves MLmodel's ``reference`` entry describes.

    Raises ``ArtifactError`` naming ``where`` when the files are missing or damaged.
    """
    from jaxexp_mlflow.errors import ArtifactError

    try:
        return (
            load_arrays(inputs, ref["input_dtypes"], "in"),
            load_arrays(outputs, ref["output_dtypes"], "out"),
        )
    except (OSError, KeyError, ValueError) as err:
        raise ArtifactError(
            f"The model's reference arrays under {where} are missing or damaged ({err}). "
            "Download the model again."
        ) from err
