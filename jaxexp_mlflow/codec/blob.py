"""The serialized ``jax.export`` blob: write it, and hand it to JAX only once it is proven sound.

``jax.export.deserialize`` trusts its input (a corrupted flatbuffer can crash the process), so
``verify_checksum`` checks the recorded sha256 and ``deserialize_checked`` parses the blob with
the jax-free reader first, and turns any failure into an ``ArtifactError`` that says what to do.
"""

from __future__ import annotations

import hashlib
from typing import Any

from jaxexp_mlflow.errors import ArtifactError


def sha256(data: bytes | bytearray | memoryview) -> str:
    """Hex sha256 of the blob, as recorded in MLmodel (``exported_sha256``)."""
    return hashlib.sha256(data).hexdigest()


def verify_checksum(data: bytes | bytearray | memoryview, expected: str, *, source: str) -> None:
    """Raise ``ArtifactError`` unless ``data`` hashes to the recorded ``expected`` sha256."""
    found = sha256(data)
    if found != expected:
        raise ArtifactError(
            f"{source} does not match its recorded checksum: expected sha256 {expected}, found "
            f"{found} ({len(data)} bytes). The file was altered or truncated; download the "
            "model again or restore it from a backup."
        )


def describe(data: bytes | bytearray | memoryview, *, source: str = "blob") -> Any:
    """Parse the blob with the jax-free reader; raise ``ArtifactError`` if it is malformed."""
    from jaxexp_mlflow.codec.reader import BlobFormatError, read_blob

    try:
        return read_blob(data)
    except BlobFormatError as err:
        raise ArtifactError(
            f"{source} is not a valid jax.export serialization: {err}. Expected the bytes of "
            "Exported.serialize(); re-export the function or restore the artifact from a backup."
        ) from err


def deserialize_checked(
    data: bytes | bytearray | memoryview,
    *,
    source: str = "blob",
    node_types: list[str] | None = None,
    description: Any = None,
) -> Any:
    """Parse-check then deserialize a blob into a ``jax.export.Exported``.

    ``description`` is the reader's result when the caller has already parsed the blob (it is
    not parsed twice). ``node_types`` are the custom pytree node names recorded at save time;
    they are registered before JAX sees the blob.
    """
    if description is None:
        describe(data, source=source)

    import jax
    import jax.export

    from jaxexp_mlflow.codec.pytrees import register_for_load

    register_for_load(node_types or [])
    try:
        return jax.export.deserialize(bytearray(data))
    except Exception as err:  # jax raises assorted types for blobs it cannot read
        raise ArtifactError(
            f"jax {jax.__version__} could not deserialize {source}: {err}. Check the "
            "compatibility verdict (`jaxexp check`) and install a jax that can read it."
        ) from err
