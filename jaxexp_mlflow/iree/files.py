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

from jaxexp_mlflow.codec import files
from jaxexp_mlflow.errors import ArtifactError

EXPORTED_FILE = "exported.bin"  # as artifact.EXPORTED_FILE (that module imports jax)
REFERENCE_INPUTS = "reference/inputs.npz"
REFERENCE_OUTPUTS = "reference/outputs.npz"


def inside(model_dir: str | os.PathLike, relative: object, what: str = "file") -> Path:
    """``model_dir/relative``, refused (``ArtifactError``) if it resolves outside ``model_dir``.

    The same confinement as the JAX path (``codec.files.resolve_inside``): no absolute path, no
    ``..``, no symbolic link leading out.
    """
    return files.resolve_inside(model_dir, relative, what=what)


def read_verified(model_dir: str | os.PathLike, relative: str, sha256: str | None) -> bytes:
    """The bytes of ``model_dir/relative`` (confined, regular file, bounded), checked against
    ``sha256``, which is required: an unchecked file is never read."""
    what = "file recorded in MLmodel"
    if not sha256:
        raise ArtifactError(
            f"The model's MLmodel records no sha256 for {relative!s:.100}: expected one, found "
            "none, so the file cannot be trusted. Download the model again, or re-log it."
        )
    data = files.read_bytes(model_dir, relative, what=what, max_bytes=files.MAX_BLOB_BYTES)
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise ArtifactError(
            f"The model's {what} does not match its recorded checksum: expected sha256 "
            f"{sha256}, found {found}. The file was altered or truncated; download the model "
            "again."
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
    *,
    model_files: Any = None,
) -> list[Any]:
    """Read the params checkpoint's arrays ``(directory name, shape, dtype)`` as numpy arrays.

    The checkpoint's manifest is checked first (no missing or truncated file); each leaf is read
    by the JAX-free reader ``codec.zarr`` (uncompressed zarr: every leaf checked and allocated,
    then all read at once, ``zarr.read_all``).
    ``model_files`` (``store.model_files.ModelFiles``): the directory as the load has read it
    (its MLmodel is not read again for the manifest's binding check).
    """
    from jaxexp_mlflow.codec import zarr
    from jaxexp_mlflow.codec.arrays import resolve_dtype
    from jaxexp_mlflow.errors import IncompatibleError
    from jaxexp_mlflow.params.restore import verify_manifest

    ckpt = inside(model_dir, meta["params"], "params checkpoint")
    if not ckpt.is_dir():
        raise ArtifactError(
            f"The model's params checkpoint {ckpt} is missing. Download the complete model "
            "directory (exported.bin, params/, MLmodel) again."
        )
    mlmodel = None if model_files is None else model_files.mlmodel_beside(ckpt)
    manifest = verify_manifest(ckpt, mlmodel=mlmodel)  # file set, sizes, CRC-32C of metadata
    out = []
    for name, shape, dtype in leaves:
        array_dir = inside(ckpt, name, f"params array {name!s:.100}")
        try:  # checked and allocated here; read below, all at once
            rel = array_dir.relative_to(ckpt.resolve()).as_posix()
            out.append(zarr.prepare_array(ckpt, rel, shape, resolve_dtype(dtype), manifest))
        except zarr.NotPlain as why:
            compression = (meta.get("params_format") or {}).get("compression")
            raise IncompatibleError(
                f"params[{name!r}] at {array_dir} is not stored as the IREE backend reads "
                f"without JAX (uncompressed zarr of {dtype}{list(shape)}); found {why} "
                f"(compression: {compression}). Save the model with compression=None, or load "
                "it with the JAX backend."
            ) from None
        except OSError as err:
            raise ArtifactError(
                f"Cannot read params[{name!r}] from {ckpt}: expected a readable array file, "
                f"found {type(err).__name__}: {err}. Download the model again."
            ) from err
    try:  # every chunk file's CRC-32C checked as it is read, the files spread over threads
        return zarr.read_all(out)
    except OSError as err:
        raise ArtifactError(
            f"Cannot read the params from {ckpt}: expected readable array files, found "
            f"{type(err).__name__}: {err}. Download the model again."
        ) from err


def read_reference(model_dir: str | os.PathLike, meta: dict[str, Any]) -> tuple[list, list] | None:
    """The stored reference (flat input leaves after the params, flat outputs), or None."""
    from jaxexp_mlflow.codec.arrays import load_reference

    ref = meta.get("reference")
    if not ref:
        return None
    return load_reference(
        inside(model_dir, REFERENCE_INPUTS, "reference inputs"),
        inside(model_dir, REFERENCE_OUTPUTS, "reference outputs"),
        ref,
        str(Path(model_dir, "reference")),
    )
