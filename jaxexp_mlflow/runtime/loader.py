"""Load a jaxexp model directory into a callable ``JaxExpModel`` on the hardware that is here."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from jaxexp_mlflow import artifact
from jaxexp_mlflow.codec import blob
from jaxexp_mlflow.errors import ArtifactError, IncompatibleError
from jaxexp_mlflow.runtime import compat, devices
from jaxexp_mlflow.runtime.model import JaxExpModel

_logger = logging.getLogger(__name__)


def enforce(verdict: compat.Verdict, *, allow_incompatible: bool) -> None:
    """Refuse an incompatible verdict (unless overridden) and log a warning verdict."""
    if verdict.status == "incompatible" and not allow_incompatible:
        raise IncompatibleError(
            "This model cannot run here:\n- "
            + "\n- ".join(verdict.reasons)
            + "\nPass allow_incompatible=True to try anyway."
        )
    if verdict.status != "ok":
        for reason in verdict.reasons:
            _logger.warning("jaxexp: %s", reason)


def load_directory(
    path: str | os.PathLike,
    meta: dict[str, Any],
    *,
    allow_incompatible: bool = False,
    **options: Any,
) -> JaxExpModel:
    """Verify, deserialize and bind params for the model stored at ``path``.

    ``options`` go to ``devices.plan`` (platform and device choices)."""
    enforce(compat.assess(meta), allow_incompatible=allow_incompatible)
    data = artifact.read_blob(path, meta)
    exported = blob.deserialize_checked(
        data,
        source=str(Path(path, meta.get("exported_file", artifact.EXPORTED_FILE))),
        node_types=meta.get("pytree_node_types"),
    )
    placement = devices.plan(exported, **options)
    params = None
    if meta.get("params"):
        from jaxexp_mlflow.codec.params import restore_params

        ckpt = Path(path, meta["params"])
        if not ckpt.exists():
            raise ArtifactError(
                f"The model's params checkpoint {ckpt} is missing. Download the complete model "
                "directory (exported.bin, params/, MLmodel) again."
            )
        target = artifact.params_target(placement.exported, placement.in_shardings)
        params = restore_params(ckpt, target=target)
    return JaxExpModel(placement.exported, params, meta, placement=placement)
