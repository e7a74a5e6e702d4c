"""Reference arrays (input example, reference outputs) as ``.npz`` files without pickle.

Leaves are stored flat, in the order of the exported ``in_tree``/``out_tree``, as ``<prefix>_<i>``
(the convention of the shared corpus). Dtypes numpy cannot store natively (bfloat16 and the other
ml_dtypes types) are written as their raw bits (unsigned ints of the same width) and listed with
their real dtype in ``dtypes`` so ``load_arrays`` can view them back.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxexp_mlflow import settings

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


#: Largest reference npz read, and the largest expansion of its compressed members.
MAX_REFERENCE_BYTES = settings.JAXEXP_MAX_REFERENCE_BYTES.get()
MAX_EXPANSION = 64
_MAX_MEMBERS = 100_000


def _checked_members(z: zipfile.ZipFile, on_disk: int, what: str) -> dict[str, zipfile.ZipInfo]:
    """The npz members, after checking their declared sizes against the bytes on disk."""
    from jaxexp_mlflow.codec.files import fail

    infos = z.infolist()
    declared = sum(i.file_size for i in infos)
    limit = min(MAX_REFERENCE_BYTES, MAX_EXPANSION * max(on_disk, 1))
    if (
        len(infos) > _MAX_MEMBERS
        or declared > limit
        or any(
            i.compress_type == zipfile.ZIP_STORED and i.file_size != i.compress_size for i in infos
        )
    ):
        raise fail(
            f"The model's {what} declares {declared} bytes in {len(infos)} members for "
            f"{on_disk} bytes on disk: expected at most {limit} (a zip bomb or a damaged file). "
            "Download the model again."
        )
    return {i.filename: i for i in infos}


def _read_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, what: str) -> np.ndarray:
    """Read one ``.npy`` member whose header must declare exactly the bytes the member holds."""
    from numpy.lib import format as npy

    from jaxexp_mlflow.codec.files import fail

    with z.open(info) as fp:
        version = npy.read_magic(fp)
        header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, fortran, dtype = header(fp, max_header_size=10_000)
        count = int(np.prod(shape, dtype=object))  # Python ints: no overflow
        if dtype.hasobject or count * dtype.itemsize != info.file_size - fp.tell():
            raise fail(
                f"The model's {what}: member {info.filename[:100]!r} declares {dtype}"
                f"{list(shape)[:8]} but holds {info.file_size - fp.tell()} bytes of data. The "
                "file is damaged; download the model again."
            )
        arr = np.empty(count, dtype=dtype)
        view, got = memoryview(arr.reshape(-1).view(np.uint8)), 0
        while got < len(view):
            n = fp.readinto(view[got:])
            if not n:
                raise EOFError(f"{info.filename[:100]!r} ends early")
            got += n
    return arr.reshape(shape, order="F" if fortran else "C")


#: What reading a missing, cut or garbled reference file raises (zipfile's own errors
#: included: a cut ``.npz`` is a ``BadZipFile``, a garbled member a ``zlib.error``)
DAMAGED = (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile, zlib.error)


def file_sha256(fd: int, size: int) -> str:
    """Hex sha256 of the first ``size`` bytes of the open file ``fd`` (read in blocks)."""
    h = hashlib.sha256()
    pos = 0
    while pos < size:
        block = os.pread(fd, min(1 << 20, size - pos), pos)
        if not block:
            break
        h.update(block)
        pos += len(block)
    return h.hexdigest()


def load_arrays(
    path: str | os.PathLike,
    dtypes: Sequence[str],
    prefix: str,
    *,
    what: str = "reference file",
    sha256: str | None = None,
) -> list[np.ndarray]:
    """Read the leaves written by ``save_arrays``, restoring their real dtypes.

    The file must be a regular file (opened without following links); with ``sha256`` (what
    the MLmodel records) its bytes must hash to it, so damage reads as
    damage, not as a model that no longer reproduces; the members' declared sizes are
    checked against the file's size and their headers against their sizes before anything is
    decompressed or allocated. No pickle.
    """
    from jaxexp_mlflow.codec.files import fail, open_regular

    fd, size = open_regular(path, what=what, max_bytes=MAX_REFERENCE_BYTES)
    if sha256 is not None:
        found = file_sha256(fd, size)
        if found != sha256:
            os.close(fd)
            raise fail(
                f"The model's {what} does not match its recorded checksum: expected sha256 "
                f"{sha256}, found {found} ({size} bytes). The file is damaged; download the "
                "model again."
            )
    with os.fdopen(fd, "rb") as f, zipfile.ZipFile(f) as z:
        members = _checked_members(z, size, what)
        out = []
        for i, name in enumerate(dtypes):
            info = members.get(f"{prefix}_{i}.npy")
            if info is None:
                raise KeyError(f"{prefix}_{i}")
            arr = _read_member(z, info, what)
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

    digests = ref.get("sha256") or {}
    try:
        return (
            load_arrays(inputs, ref["input_dtypes"], "in", sha256=digests.get("inputs")),
            load_arrays(outputs, ref["output_dtypes"], "out", sha256=digests.get("outputs")),
        )
    except DAMAGED as err:
        raise ArtifactError(
            f"The model's reference arrays under {where} are missing or damaged "
            f"({type(err).__name__}: {err}). "
            "Download the model again."
        ) from err
