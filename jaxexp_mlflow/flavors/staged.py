"""``log_model``'s save when the staging directory is only uploaded (docs/remote.md)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.models import Model
from mlflow.models.model import MLMODEL_FILE_NAME


class StagedFlavor:
    """This flavor as ``Model.log`` sees it when the staging directory is only uploaded.

    The params are written without the final fsync pass (the directory is deleted after the
    upload). Everything goes up on one pool as soon as it exists (``upload.EarlyUpload``):
    the ``code/`` copy as soon as it is made, ``params/`` as soon as Orbax has written it
    (while the read-back runs), then the top-level files; with ``JAXEXP_EARLY_UPLOAD=0``,
    ``params/`` and ``code/`` go up in parallel after ``save_model`` (``upload.stage_upload``).
    ``Model.log`` then uploads what is left, ``MLmodel`` last. See docs/remote.md.
    """

    #: Left to ``Model.log``: MLmodel (rewritten there) last; the serving example it reads.
    LEFT_TO_MLFLOW = (MLMODEL_FILE_NAME, "serving_input_example.json")

    def __init__(self, save: Callable[..., None], name: str) -> None:
        """Args:
        save: the flavor's ``save_model`` (called with ``durable=False``).
        name: the flavor module's name, as ``Model.log`` records it.
        """
        self._save = save
        self.__name__ = name

    def save_model(self, *, path: str, mlflow_model: Model, **kwargs: Any) -> None:
        """Save into ``path`` and upload it as it is written (see the class docstring)."""
        from jaxexp_mlflow.store import artifact
        from jaxexp_mlflow.store.upload import EarlyUpload, stage_upload

        if not mlflow_model.artifact_path:
            self._save(path=path, mlflow_model=mlflow_model, durable=False, **kwargs)
            return
        early = EarlyUpload(mlflow_model.artifact_path, artifact.PARAMS_DIR)
        params_dir = Path(path, artifact.PARAMS_DIR)
        try:
            self._save(
                path=path,
                mlflow_model=mlflow_model,
                durable=False,
                _dir_ready=early.send_tree,
                **kwargs,
            )
            tops = [
                p
                for p in Path(path).iterdir()
                if p.is_file() and p.name not in StagedFlavor.LEFT_TO_MLFLOW
            ]
            early.send_files(tops)
            # the rest of params/ and code/ go up while the arrays still do, on the same pool
            subdirs = [artifact.PARAMS_DIR, "code"]
            for sub in subdirs:
                if Path(path, sub).is_dir():
                    early.send_tree(Path(path, sub), sub)
            skip = {sub: early.skipped(sub) for sub in subdirs}  # stage_upload: what is left
            if stage_upload(path, mlflow_model.artifact_path, subdirs, skip=skip):
                early.finish(params_dir)
                # up: out of the way, so that Model.log uploads only what is left
                sent = [Path(path, sub) for sub in subdirs if Path(path, sub).exists()]
                sent += [p for p in tops if p.name in early.submitted]
                for p in early.trash(sent):  # could not be moved aside: deleted now
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink()
        except BaseException:
            early.close()
            early.discard()  # no MLmodel will follow: take back what went up
            raise
        early.close()
