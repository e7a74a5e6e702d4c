"""Every file the IREE backend reads from a model directory, behind a few narrow functions.

The blob (checksum verified against MLmodel), the prepared module (checksum verified), the
params checkpoint (manifest verified, then one leaf at a time) and the reference arrays. Paths
recorded in MLmodel must stay inside the model directory. Nothing here imports JAX.

These are the only doors of the IREE path into a model directory, so they are the place to
route it through stricter, confined readers (one function each).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from jaxexp_mlflow.errors import ArtifactError

EXPORTED_FILE = "exported.bin"  # as artifact.EXPORTED_FILE (that module imports jax)
REFERENCE_INPUTS = "reference/inputs.npz"
REFERENCE_OUTPUTS = "reference/outputs.npz"
MAX_FILE_BYTES = 2 * 1024**3


def inside(model_dir: str | os.PathLike, relative: str) -> Path:
    """``model_dir/relative``, refused (``ArtifactError``) if it resolves outside ``model_dir``."""
    root = Path(model_dir).resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise ArtifactError(
            f"MLmodel names {relative!r}, which lies outside the model directory {root}: "
            "expected a path inside it. The MLmodel file was altered; download the model again."
        )
    return path


def read_verified(model_dir: str | os.PathLike, relative: str, sha256: str | None) -> bytes:
    """The bytes of ``model_dir/relative``, checked against ``sha256`` when one is recorded."""
    path = inside(model_dir, relative)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ArtifactError(
                f"{path} has {size} bytes: expected at most {MAX_FILE_BYTES}. The file is not a "
                "model artifact; download the model again."
            )
        data = path.read_bytes()
    except OSError as err:
        raise ArtifactError(
            f"{path} cannot be read ({err}): expected the file MLmodel lists. Download the "
            "complete model directory again."
        ) from err
    if sha256 is not None:
        found = hashlib.sha256(data).hexdigest()
        if found != sha256:
            raise ArtifactError(
                f"{path} does not match its recorded checksum: expected sha256 {sha256}, found "
                f"{found}. The file was altered or truncated; download the model again."
            )
    return data


def read_blob(model_dir: str | os.PathLike, meta: dict[str, Any]) -> bytes:
    """``exported.bin``, verified against MLmodel's ``exported_sha256``."""
    return read_verified(
        model_dir, meta.get("exported_file") or EXPORTED_FILE, meta.get("exported_sha256")
    )


def read_prepared(model_dir: str | os.PathLike, prepared: dict[str, Any]) -> bytes:
    """The module stored by the save-time preparation, verified against its recorded sha256."""
    return read_verified(model_dir, prepared["module"], prepared["module_sha256"])


def read_params(
    model_dir: str | os.PathLike,
    meta: dict[str, Any],
    leaves: list[tuple[str, tuple[int, ...], str]],
) -> list[Any]:
    """Read the params checkpoint's arrays ``(directory name, shape, dtype)`` as numpy arrays.

    The checkpoint's manifest is checked first (no missing or truncated file); each leaf is read
    by the JAX-free reader of ``codec.params`` (uncompressed zarr3, one ``preadv`` per chunk).
    """
    from types import SimpleNamespace

    from jaxexp_mlflow.codec import params as codec_params
    from jaxexp_mlflow.codec.arrays import resolve_dtype
    from jaxexp_mlflow.errors import IncompatibleError

    ckpt = inside(model_dir, meta["params"])
    if not ckpt.is_dir():
        raise ArtifactError(
            f"The model's params checkpoint {ckpt} is missing. Download the complete model "
            "directory (exported.bin, params/, MLmodel) again."
        )
    codec_params.verify_manifest(ckpt)
    out = []
    for name, shape, dtype in leaves:
        array_dir = inside(ckpt, name)
        sds = SimpleNamespace(shape=shape, dtype=resolve_dtype(dtype))
        try:
            out.append(codec_params._fast_read_leaf(array_dir, sds))
        except codec_params._NoFastPath as why:
            compression = (meta.get("params_format") or {}).get("compression")
            raise IncompatibleError(
                f"params[{name!r}] at {array_dir} is not stored as the IREE backend reads "
                f"without JAX (uncompressed zarr3 of {dtype}{list(shape)}); found {why} "
                f"(compression: {compression}). Save the model with compression=None, or load "
                "it with the JAX backend."
            ) from None
        except OSError as err:
            raise ArtifactError(
                f"Cannot read params[{name!r}] from {ckpt}: expected a readable array file, "
                f"found {type(err).__name__}: {err}. Download the model again."
            ) from err
    return out


def read_reference(model_dir: str | os.PathLike, meta: dict[str, Any]) -> tuple[list, list] | None:
    """The stored reference (flat input leaves after the params, flat outputs), or None."""
    from jaxexp_mlflow.codec.arrays import load_reference

    ref = meta.get("reference")
    if not ref:
        return None
    return load_reference(
        inside(model_dir, REFERENCE_INPUTS),
        inside(model_dir, REFERENCE_OUTPUTS),
        ref,
        str(Path(model_dir, "reference")),
    )
