"""One read of a model directory: MLmodel and the blob, each read, checked and parsed once.

Every load (``mlflow.jaxexp.load_model``, the pyfunc loader, ``jaxexp`` commands) starts with
:func:`read_model_files` and hands the :class:`ModelFiles` it returns down the path: the
loader (``runtime.loader``), the params check that the checkpoint belongs to this MLmodel
(``params.manifest``) and pyfunc's model identity take what it holds instead of opening the
files again. MLmodel is read and validated when the object is made (bounded YAML, the
``jaxexp`` section and ``python_function.config`` checked by ``store.section``); the blob is
read, checked against ``exported_sha256`` and parsed by the jax-free reader on first use, so a
load that never needs it (the IREE backend reads its own, an error in MLmodel stops first)
does not read it, and one that does reads it once. No JAX and no MLflow import.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from jaxexp_mlflow.codec import blob as blob_codec
from jaxexp_mlflow.codec import files
from jaxexp_mlflow.codec.mlmodel import load_yaml, parse_mlmodel, read_mlmodel_bytes
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.store import artifact
from jaxexp_mlflow.store.section import FLAVOR_NAME, check_against_blob, flavor_section

__all__ = ["ModelFiles", "read_model_files"]


@dataclass(frozen=True, eq=False)
class ModelFiles:
    """A model directory as one load reads it.

    ``mlmodel`` is the parsed MLmodel (None where the caller had only the section: the params
    binding check then reads MLmodel itself), ``flavor`` its validated ``jaxexp`` section as
    written, ``mlmodel_sha256`` the digest of MLmodel's bytes. :attr:`blob` and
    :attr:`description` are read and parsed once, on first use.
    """

    path: Path
    flavor: dict[str, Any]
    mlmodel: dict[str, Any] | None = None
    mlmodel_sha256: str | None = None

    @property
    def blob_name(self) -> str:
        """The blob's path inside the model directory, as MLmodel records it."""
        return artifact.blob_name(self.flavor)

    @property
    def blob_source(self) -> str:
        """How errors name the blob: its path."""
        return str(Path(self.path, self.blob_name))

    @cached_property
    def blob(self) -> bytes:
        """The blob's bytes, read confined and bounded, checked against ``exported_sha256``."""
        data = self.__dict__.pop("_unchecked", None)
        if data is None:
            return artifact.read_blob(self.path, self.flavor)
        return artifact.check_blob(data, self.flavor)

    @cached_property
    def description(self) -> Any:
        """The jax-free reader's ``BlobDescription`` of :attr:`blob` (``ArtifactError`` if it
        is malformed)."""
        data = self.blob
        parsed = self.__dict__.pop("_parsed", None)
        if parsed is None:
            parsed = blob_codec.describe(data, source=self.blob_source)
        check_against_blob(self.flavor, parsed, self.blob_source)  # MLmodel's facts are the blob's
        return parsed

    def mlmodel_beside(self, ckpt: str | os.PathLike) -> dict[str, Any] | None:
        """The parsed MLmodel where it is the one beside the params checkpoint ``ckpt`` (the
        MLmodel the checkpoint manifest's binding is judged against), else None (then read
        there: ``params.manifest.check_binding``)."""
        if self.mlmodel is None or Path(ckpt).parent.resolve() != self.path.resolve():
            return None
        return self.mlmodel

    def blob_if_read(self) -> bytes | None:
        """The blob's checked bytes where this load has read them already, else None (for a
        reader with rules of its own, such as the IREE backend's)."""
        return self.__dict__.get("blob")

    def with_blob(self, data: bytes | None, description: Any = None) -> ModelFiles:
        """This object, given the blob's bytes (and their parse) that the caller has already
        read: checked against ``exported_sha256`` when :attr:`blob` is first used, not read
        again. Bytes over ``files.MAX_BLOB_BYTES`` are left out (:attr:`blob` then reads and
        refuses them, as a load always did), and so are bytes other than those it holds."""
        if data is None or len(data) > files.MAX_BLOB_BYTES:
            return self
        if "blob" not in self.__dict__:
            self.__dict__["_unchecked"] = data
        elif self.__dict__["blob"] is not data:
            return self
        if description is not None and "description" not in self.__dict__:
            self.__dict__["_parsed"] = description
        return self


def read_model_files(
    model_dir: str | os.PathLike,
    *,
    flavor_name: str = FLAVOR_NAME,
    mapping: bool = True,
    raw: bytes | None = None,
) -> ModelFiles:
    """Read and validate the MLmodel of ``model_dir`` once: a confined, bounded read, its
    ``flavors.<flavor_name>`` section and ``python_function.config`` checked
    (``store.section.flavor_section``); ``ArtifactError`` naming what is wrong otherwise.

    ``mapping=False``: an MLmodel that is valid YAML but no mapping is read as an empty one, so
    the error is the missing flavor's (what the pyfunc loader has always said). ``raw``: the
    bytes of that MLmodel where this process has just read them (``store.download``'s check
    of its own private download), parsed instead of read again.
    """
    if raw is None:
        raw = read_mlmodel_bytes(model_dir)
    try:
        mlmodel = parse_mlmodel(raw)
    except ArtifactError:
        if mapping or isinstance(load_yaml(raw), dict):  # load_yaml: its own error, if any
            raise
        mlmodel = {}
    section = flavor_section(mlmodel, flavor_name)
    return ModelFiles(
        Path(model_dir),
        section,
        mlmodel=mlmodel,
        mlmodel_sha256=hashlib.sha256(raw).hexdigest(),
    )
