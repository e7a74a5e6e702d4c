"""The load path behind ``mlflow.jaxexp.load_model``: download, read the files once, load."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from jaxexp_mlflow.errors import ArtifactError


def load(
    model_uri: str,
    dst_path: str | None,
    backend: str,
    allow_incompatible: bool,
    options: dict[str, Any],
) -> Any:
    """``load_model`` with its options checked: download the model (if remote), then load it
    on ``backend`` with ``options`` (the backend's own keywords, checked by ``load_model``)."""
    from jaxexp_mlflow.store.download import download_model

    # jaxexp is the loader: nothing in a model's code/ is ever imported here, so into a private
    # temp dir (dst_path=None) it is not even downloaded.
    skip = ("code",) if dst_path is None else ()
    download = download_model(model_uri, dst_path, skip=skip)
    local_path = download.path
    # Our own private download (mkdtemp, 0700): params may be mapped from the page cache the
    # download filled instead of copied into new memory, their checksums taken as they landed
    # (docs/remote.md, "How a model travels").
    private = download.ours and dst_path is None
    try:
        try:
            return _load_downloaded(
                local_path, download, private, backend, allow_incompatible, options
            )
        except ArtifactError as err:
            if os.path.exists(model_uri) or os.path.lexists(os.path.join(local_path, "MLmodel")):
                raise
            held = sorted(os.listdir(local_path))[:6] if os.path.isdir(local_path) else []
            raise ArtifactError(
                f"{model_uri}: expected a model with its MLmodel in the artifact store, found "
                f"{held or 'nothing'} without one. Its upload was cut off or never finished "
                "(MLflow leaves such a logged model PENDING or FAILED): log the model again."
            ) from err
    finally:  # nothing of a private download stays, loaded (params held) or refused
        if private and download.tmp:
            shutil.rmtree(download.tmp, ignore_errors=True)


def _load_downloaded(
    local_path: str,
    download: Any,
    private: bool,
    backend: str | None,
    allow_incompatible: bool,
    options: dict[str, Any],
) -> Any:
    """``load_model`` once the model is on disk at ``local_path``: its MLmodel read and
    validated once (``store.model_files``), that one object handed to the loader."""
    from jaxexp_mlflow.store.model_files import read_model_files

    # validated (``code`` relative and inside the model, or null); never put on sys.path
    files = read_model_files(local_path, raw=download.mlmodel if private else None)
    if backend == "iree":
        from jaxexp_mlflow.iree.loader import load_directory as load_iree

        return load_iree(
            local_path,
            files.flavor,
            allow_incompatible=allow_incompatible,
            model_files=files,
            **options,
        )
    from jaxexp_mlflow.runtime import cache
    from jaxexp_mlflow.runtime.loader import load_directory

    cache.configure()
    model = load_directory(
        local_path,
        files.flavor,
        allow_incompatible=allow_incompatible,
        mapped=download.crc32c if private else None,
        model_files=files,
        **options,
    )
    if private:  # the params are in memory (or mapped: unlinked files live while mapped)
        from jaxexp_mlflow.store import artifact

        ckpt = artifact.params_dir(local_path, files.flavor)
        if ckpt is not None and ckpt.resolve() != Path(local_path).resolve():
            shutil.rmtree(ckpt, ignore_errors=True)
    return model
