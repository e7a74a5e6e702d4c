"""Turn what the user typed (model URI, local model directory, bare blob) into local files.

Local paths are used in place (never copied). Anything with a scheme (``runs:/``, ``models:/``,
``s3://``...) is downloaded with MLflow into a temporary directory that lives as long as the
command. ``parts=("MLmodel", "exported.bin")`` fetches only those files of a remote model, so
``jaxexp inspect`` of a model with gigabytes of params downloads a few kilobytes.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import click

from jaxexp_mlflow.cli._common import InputProblem, step
from jaxexp_mlflow.codec.mlmodel import read_mlmodel

MLMODEL = "MLmodel"
DEFAULT_BLOB = "exported.bin"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass
class Target:
    """A resolved model or blob: ``kind`` is ``"model"`` (``path`` = model dir) or ``"blob"``."""

    uri: str
    kind: str
    path: Path
    remote: str | None = None  # the artifact URI it was downloaded from
    mlmodel: dict[str, Any] = field(default_factory=dict)

    @property
    def flavor(self) -> dict[str, Any]:
        """The MLmodel ``jaxexp`` section (empty for a bare blob)."""
        return (self.mlmodel.get("flavors") or {}).get("jaxexp") or {}

    @property
    def blob_path(self) -> Path:
        """The serialized ``jax.export`` blob of this target."""
        if self.kind == "blob":
            return self.path
        from jaxexp_mlflow.codec.files import resolve_inside

        name = self.flavor.get("exported_file", DEFAULT_BLOB)
        return resolve_inside(self.path, name, what="serialized function (exported_file)")

    @cached_property
    def blob_data(self) -> bytes:
        """The blob's bytes, read once for the whole command: a regular file (no link, FIFO or
        device followed), at most ``codec.reader.MAX_BLOB_FILE_BYTES``, not yet checked against
        MLmodel (``inspect`` reports a mismatch; loads check it: :attr:`model_files`).
        ``FileNotFoundError`` if it is missing."""
        from jaxexp_mlflow.codec import files, reader

        loaded = self.__dict__.get("model_files")
        if loaded is not None and "blob" in loaded.__dict__:  # a load has read it already
            return loaded.blob
        path = self.blob_path
        if not os.path.lexists(path):
            raise FileNotFoundError(os.fspath(path))
        return files.read_file(
            path, what="serialized function", max_bytes=reader.MAX_BLOB_FILE_BYTES
        )

    @cached_property
    def description(self) -> Any:
        """The jax-free reader's description of :attr:`blob_data`, parsed once
        (``codec.reader.BlobFormatError`` if it is malformed)."""
        from jaxexp_mlflow.codec import reader

        loaded = self.__dict__.get("model_files")
        if loaded is not None and "description" in loaded.__dict__:
            return loaded.description
        desc = reader.read_blob(self.blob_data)
        self.check_section(desc)
        return desc

    def check_section(self, desc: Any) -> None:
        """A model directory's MLmodel facts against its blob's (``store.section``); nothing for
        a bare blob."""
        if self.kind != "blob" and self.flavor:
            from jaxexp_mlflow.store.section import check_against_blob

            check_against_blob(self.flavor, desc, str(self.blob_path))

    @cached_property
    def model_files(self) -> Any:
        """The model directory as the loaders take it (``store.model_files.ModelFiles``): the
        MLmodel read by :func:`resolve`, the blob and its parse where this command has read
        them already (checked against ``exported_sha256`` on first use), else read then."""
        from jaxexp_mlflow.store.model_files import ModelFiles

        model_files = ModelFiles(self.path, self.flavor, mlmodel=self.mlmodel)
        if "blob_data" in self.__dict__:
            model_files.with_blob(self.blob_data, self.__dict__.get("description"))
        return model_files


def _require_jaxexp(target: Target) -> Target:
    if target.kind != "model":
        return target
    flavors = target.mlmodel.get("flavors")
    if not isinstance(flavors, dict) or "jaxexp" not in flavors:
        names = sorted(str(k) for k in flavors) if isinstance(flavors, dict) else []
        raise InputProblem(
            f"{target.uri} is an MLflow model without the jaxexp flavor (flavors: {names}); "
            "expected a model logged with mlflow.jaxexp.log_model or `jaxexp log`"
        )
    from jaxexp_mlflow.store.section import validate_flavor

    validate_flavor(flavors["jaxexp"])
    return target


def _local(uri: str, path: Path) -> Target:
    if path.is_file():
        if path.name == MLMODEL:
            return _local(uri, path.parent)
        return Target(uri, "blob", path)
    if (path / MLMODEL).is_file():
        return _require_jaxexp(Target(uri, "model", path, mlmodel=read_mlmodel(path)))
    if (path / DEFAULT_BLOB).is_file():  # a directory holding just a blob (e.g. the corpus)
        return Target(uri, "blob", path / DEFAULT_BLOB)
    raise InputProblem(
        f"{uri} is a directory without an MLmodel file or {DEFAULT_BLOB}; expected a jaxexp "
        "model directory or a serialized jax.export blob"
    )


def _underlying(uri: str) -> str:
    """``models:/...`` resolved to the artifact location it names (other URIs unchanged)."""
    if not uri.startswith("models:"):
        return uri
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

    return ModelsArtifactRepository.get_underlying_uri(uri)


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _limit(name: str) -> int:
    """The most bytes a single remote file may have: MLmodel's limit for MLmodel, the blob's
    for anything else (a blob, an artifact named directly)."""
    from jaxexp_mlflow.codec import files

    return files.MAX_MLMODEL_BYTES if name == MLMODEL else files.MAX_BLOB_BYTES


def _fetch(repo: Any, info: Any, into: Path) -> Path:
    """Download the listed file ``info`` to ``into/<its name>``, stopping at its listed size
    (``download.fetch_listed``: a partial file is removed)."""
    from jaxexp_mlflow.store.download import fetch_listed

    name = os.path.basename(info.path.rstrip("/"))
    dest = into / name
    fetch_listed(repo, info, dest, max_bytes=_limit(name))
    return dest


def _remote(uri: str, parts: tuple[str, ...] | None, dst: str) -> Target:
    from mlflow.exceptions import MlflowException

    from jaxexp_mlflow.store.download import list_top

    try:
        base = _underlying(uri)
        if parts is None:
            from jaxexp_mlflow.store.download import download_model

            with step(f"Downloading {uri}"):
                local = Path(download_model(base, dst)[0])  # in parallel, with progress
            target = _local(uri, local)
        else:
            repo, _root, listed = list_top(base)
            names = {k: v for k, v in listed.items() if not v.is_dir}
            if MLMODEL in names:
                local = Path(dst, "model")
                with step(f"Downloading {MLMODEL} of {uri}"):
                    _fetch(repo, names[MLMODEL], local)
                target = _require_jaxexp(Target(uri, "model", local, mlmodel=read_mlmodel(local)))
                wanted = {target.flavor.get("exported_file", DEFAULT_BLOB), *parts} - {MLMODEL}
                with step(f"Downloading {', '.join(sorted(map(str, wanted)))}"):
                    for name in sorted(wanted & set(names)):
                        _fetch(repo, names[name], local)
            elif DEFAULT_BLOB in names:
                with step(f"Downloading {DEFAULT_BLOB} of {uri}"):
                    target = Target(uri, "blob", _fetch(repo, names[DEFAULT_BLOB], Path(dst)))
            elif names or listed:
                raise InputProblem(
                    f"{uri} holds {sorted(listed)[:8]} but no {MLMODEL} or {DEFAULT_BLOB}; "
                    "expected a jaxexp model or a serialized jax.export blob (a model whose "
                    f"upload was cut off has its params but no {MLMODEL}: log it again)"
                )
            else:  # a single file: its entry in the listing of its directory
                parent, _, leaf = base.rstrip("/").rpartition("/")
                repo, _root, siblings = list_top(parent) if parent and leaf else (None, "", {})
                info = siblings.get(leaf)
                if info is None or info.is_dir:
                    raise InputProblem(
                        f"cannot fetch {uri}: the artifact store lists no such model or file"
                    )
                with step(f"Downloading {uri}"):
                    local = _fetch(repo, info, Path(dst))
                target = _local(uri, local)
    except MlflowException as err:
        raise InputProblem(f"cannot fetch {uri}: {' '.join(err.message.split())}") from err
    except Exception as err:
        if type(err).__module__.startswith(("jaxexp_mlflow", "click")):
            raise  # our own typed errors (a damaged download...) say what they are
        # an artifact store's client (botocore's NoCredentialsError, a connection error...)
        raise InputProblem(
            f"cannot fetch {uri}: {type(err).__name__}: {' '.join(str(err).split())}"
        ) from err
    target.remote = base
    return target


def resolve(uri: str, *, parts: tuple[str, ...] | None = None) -> Target:
    """Find or download the model (or blob) named by ``uri``.

    ``parts`` limits a remote download to those top-level files plus MLmodel and the blob;
    ``None`` downloads the whole model. Downloads go to a temporary directory removed when the
    current click command ends.
    """
    if uri.startswith("file:"):
        path = Path(unquote(urlparse(uri).path))
        if not path.exists():
            raise InputProblem(f"{uri}: no such file or directory")
        return _local(uri, path)
    path = Path(uri).expanduser()
    if path.exists():
        return _local(uri, path)
    if not _SCHEME.match(uri):
        raise InputProblem(
            f"{uri}: no such file or directory, and not a model URI (expected runs:/<run_id>/"
            "<name>, models:/<name>/<version>, models:/<name>@<alias>, models:/<model_id>, a "
            "model directory or a blob file)"
        )
    ctx = click.get_current_context(silent=True)
    tmp = tempfile.TemporaryDirectory(prefix="jaxexp-")
    if ctx is not None:
        ctx.with_resource(tmp)
    return _remote(uri, parts, tmp.name)
