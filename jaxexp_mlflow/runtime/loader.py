"""Load a jaxexp model directory into a callable ``JaxExpModel`` on the hardware that is here."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from jaxexp_mlflow.codec import blob
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.runtime import devices
from jaxexp_mlflow.runtime.model import JaxExpModel
from jaxexp_mlflow.store import artifact
from jaxexp_mlflow.store.model_files import ModelFiles
from jaxexp_mlflow.store.section import validate_flavor

_logger = logging.getLogger(__name__)


def load_directory(
    path: str | os.PathLike,
    meta: dict[str, Any],
    *,
    allow_incompatible: bool = False,
    isolate: bool = False,
    bind: Any = None,
    mapped: dict[str, int] | None = None,
    route: str | None = None,
    model_files: ModelFiles | None = None,
    **options: Any,
) -> JaxExpModel:
    """Verify, judge, deserialize and bind params for the model stored at ``path``.

    Order matters: the blob's checksum and structure are verified and the compatibility verdict
    (``compat.assess``) is reached before JAX deserializes or compiles anything. ``options`` go
    to ``devices.plan`` (``allow_other_platform``, ``data_parallel``, ``devices``).
    ``isolate=True`` has JAX deserialize the blob in a capped child process first
    (``runtime.isolate``), so that a blob crashing JAX's native deserializer is refused.
    ``bind`` (save's read-back of big params, ``flavors.readback``): params as stored, bound
    instead of restored; the checkpoint is still checked whole (every file's CRC-32C, tree,
    shapes, dtypes) but not read into a second copy in memory. ``mapped`` (not None): the
    directory is private to this process (``load_model``'s download), so params may be mapped
    rather than copied (``params.restore_params``); it maps file paths relative to
    ``path`` to the CRC-32C the download computed as each file landed. ``route`` (``direct``
    or ``expired-flag``, ``runtime.routes``) is taken as asked, never chosen silently; a refusal
    names the routes that work. ``model_files`` (``store.model_files``): the directory as the
    caller has read it, with ``meta`` its validated section; what it holds (MLmodel, the blob
    and its parse) is not read, checked or parsed again.
    """
    files = model_files
    if files is None:  # the section alone: checked here, the blob read below
        files = ModelFiles(Path(path), validate_flavor(meta))
    meta = files.flavor
    data = files.blob
    source = files.blob_source
    description = files.description
    if not meta.get("params") and int(meta.get("n_param_leaves") or 0):
        raise ArtifactError(
            f"The model's MLmodel has params: {meta.get('params')!r:.40} but records "
            f"{meta['n_param_leaves']} param leaves for the exported function: expected the "
            "path of its params checkpoint. The MLmodel file was altered; download the model "
            "again."
        )
    from jaxexp_mlflow.runtime import routes

    verdict, scope = routes.judge(
        meta,
        description,
        route,
        allow_other_platform=bool(options.get("allow_other_platform", False)),
        allow_incompatible=allow_incompatible,
    )
    with scope():
        if isolate:
            from jaxexp_mlflow.runtime.isolate import probe

            probe(data, source=source, node_types=meta.get("pytree_node_types"))
        exported = blob.deserialize_checked(
            data,
            source=source,
            node_types=meta.get("pytree_node_types"),
            description=description,
        )
    if route == routes.EXPIRED_FLAG:
        exported = routes.with_scoped_vjp(exported)
    remeshed = None
    if route == routes.REMESH:
        from jaxexp_mlflow.runtime.remesh import remesh_for_load

        remeshed, options = remesh_for_load(exported, options)
        exported = remeshed.exported
    placement = devices.plan(exported, **options)
    params = None
    ckpt = artifact.params_dir(path, meta)
    if ckpt is not None:
        from jaxexp_mlflow.params import check_checkpoint, restore_params, verify_manifest

        mlmodel = files.mlmodel_beside(ckpt)  # the manifest's binding is judged against it
        target = artifact.params_target(placement.exported, placement.in_shardings, meta)
        if bind is None:
            known = None
            if mapped is not None:
                prefix = ckpt.resolve().relative_to(Path(path).resolve()).as_posix() + "/"
                known = {k[len(prefix) :]: v for k, v in mapped.items() if k.startswith(prefix)}
            params = restore_params(ckpt, target=target, mapped=known, mlmodel=mlmodel)
        else:
            verify_manifest(ckpt, mlmodel=mlmodel).verify_files()
            check_checkpoint(ckpt, target)
            params = bind
    model = JaxExpModel(placement.exported, params, meta, placement=placement)
    model.verdict = verdict
    model.route = route or routes.DIRECT
    model.remeshed = None if remeshed is None else remeshed.change
    model.custom_call_targets = description.custom_call_targets  # read from the blob itself
    return model


def bind_model(
    exported: Any,
    local: Path,
    meta: dict,
    placement: Any,
    *,
    model_files: ModelFiles | None = None,
) -> JaxExpModel:
    """A ``JaxExpModel`` of ``exported`` (the model's own blob, or a re-export of it) with the
    params of the model directory ``local`` restored into ``placement``'s shardings
    (``model_files``: the directory as the caller has read it, ``store.model_files``)."""
    params = None
    ckpt = artifact.params_dir(local, meta)
    if ckpt is not None:
        from jaxexp_mlflow.params import restore_params

        target = artifact.params_target(exported, placement.in_shardings, meta)
        mlmodel = None if model_files is None else model_files.mlmodel_beside(ckpt)
        params = restore_params(ckpt, target=target, mlmodel=mlmodel)
    return JaxExpModel(exported, params, meta, placement=placement)
