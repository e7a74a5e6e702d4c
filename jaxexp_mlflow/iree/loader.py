"""Load a jaxexp model directory (or a bare blob) onto the IREE runtime, without importing JAX.

Order, as in ``runtime.loader``: read and verify the blob, describe it with the jax-free reader,
reach the IREE verdict (refuse what cannot run, with the reason), then read the params, compile
(or find in the cache; with the batch-1 function of ``model.batch1_entry``) and bind. A model
the verdict sends to the per-batch-size route (``verdict.specialized``: a symbolic-batch gather
or flatten) is bound as a ``static.StaticIreeModel``, batch 1 compiled now.

The save-time ``iree`` section and its prepared module are tied to the blob: the section records
the sha256 of the blob it was prepared from (``blob_sha256``), checked before the prepared module
is read or compiled; the compiled function's interface is then checked against the blob's avals
(``model.check_interface``), and every result buffer at each call.

A model directory's model is run once on its stored reference before it is returned
(``selfcheck``): one that does not reproduce it within ``jaxexp verify``'s tolerances, or whose
first call fails in the IREE runtime, is refused (``IncompatibleError``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

from jaxexp_mlflow.codec import blob, mlir_bytecode, reader
from jaxexp_mlflow.errors import ArtifactError, IncompatibleError
from jaxexp_mlflow.iree import compiler, files, selfcheck, trees
from jaxexp_mlflow.iree import verdict as iree_verdict
from jaxexp_mlflow.iree.model import IreeModel, batch1_entry, sized_entry
from jaxexp_mlflow.iree.specialize import STATIC
from jaxexp_mlflow.iree.static import StaticIreeModel, rows_independent, static_wanted

_logger = logging.getLogger(__name__)


def platform_index(platforms: tuple[str, ...] | list[str]) -> int | None:
    """The platform argument of a multi-platform module (position of ``cpu``; else the first)."""
    if len(platforms) < 2:
        return None
    return list(platforms).index("cpu") if "cpu" in platforms else 0


def param_leaf_names(
    description: Any, prepared: dict[str, Any] | None, meta: dict[str, Any] | None = None
) -> list[str]:
    """Orbax directory names of the params leaves, in the module's order.

    The names the flavor recorded, never reconstructed: a checkpoint of the named layout
    (``params_layout: named``) stores the flat dict ``{name: array}`` under MLmodel's
    ``param_names`` (``layers[0].w``, ``non_trainable[0]``), each array in the directory of its
    name; other checkpoints (copied ones, older models) under the names the save-time
    preparation recorded (``param_leaves``). Only models saved before both are named from the
    blob's in_tree, when the params are dicts, lists and tuples.
    """
    meta = meta or {}
    n = None
    args = description.in_tree.children[0] if description.in_tree.children else None
    if args is not None and args.children:
        n = args.children[0].num_leaves
    recorded = meta.get("param_names")
    if meta.get("params_layout") == "named" and recorded is not None:
        if (
            not isinstance(recorded, list)
            or (n is not None and len(recorded) != n)
            or len(set(map(str, recorded))) != len(recorded)
            or not all(isinstance(x, str) and x for x in recorded)
        ):
            raise ArtifactError(
                f"MLmodel's param_names do not fit the export: expected {n} distinct names, "
                f"found {str(recorded)[:200]}. The MLmodel file was altered; download the model "
                "again."
            )
        return list(recorded)
    if prepared and prepared.get("param_leaves") is not None:
        return list(prepared["param_leaves"])
    names = trees.leaf_names(args.children[0]) if args is not None and args.children else None
    if names is None:
        raise ArtifactError(
            "The params pytree holds custom nodes (e.g. Flax FrozenDict) whose key paths only "
            "JAX knows, and this model records no param leaf names. Run `jaxexp refresh` once "
            "where JAX is installed (it records them), or use the JAX backend."
        )
    return names


#: The way out of a refused symbolic-batch model that a static export gives: the exporter then
#: writes static shapes, so nothing is left to specialize (what failed here).
STATIC_WAY_OUT = (
    "Or save the model with batch_polymorphic=False: its module then has static shapes, which "
    "IREE compiles as exported (one batch size), and it runs on the IREE backend."
)

_SHA256 = re.compile(r"[0-9a-f]{64}")


def prepared_section(meta: dict[str, Any], data: bytes) -> dict[str, Any] | None:
    """The MLmodel ``iree`` section, checked: a mapping whose ``blob_sha256`` (when recorded;
    models saved before it have none) is the sha256 of ``data``, the blob being loaded."""
    prepared = meta.get("iree") or None
    if prepared is None:
        return None
    if not isinstance(prepared, dict):
        raise ArtifactError(
            f"The model's MLmodel jaxexp.iree: expected a mapping (the save-time IREE "
            f"preparation), found {type(prepared).__name__}. The file is damaged or was altered; "
            "download the model again."
        )
    module, digest = prepared.get("module"), prepared.get("module_sha256")
    if module is not None and (
        not isinstance(module, str) or not isinstance(digest, str) or not _SHA256.fullmatch(digest)
    ):
        raise ArtifactError(
            "The model's MLmodel jaxexp.iree: expected a relative 'module' path and its "
            f"'module_sha256' (64 hex digits), found {str(module)[:100]!r} and "
            f"{str(digest)[:100]!r}. The file is damaged or was altered; download the model again."
        )
    recorded = prepared.get("blob_sha256")
    if recorded is not None:
        found = hashlib.sha256(data).hexdigest()
        if recorded != found:
            raise ArtifactError(
                f"The model's MLmodel jaxexp.iree.blob_sha256: expected {found} (the sha256 of "
                f"the blob being loaded), found {str(recorded)[:100]!r}: the IREE preparation "
                "and its prepared module belong to another blob, so they were not compiled. "
                "Download the model again, or run `jaxexp refresh` where JAX is installed to "
                "prepare it anew; the JAX backend reads the blob itself."
            )
    return prepared


def build(
    data: bytes,
    meta: dict[str, Any],
    *,
    source: str,
    read_module: Any = None,
    read_params: Any = None,
    allow_incompatible: bool = False,
    allow_other_platform: bool = False,
    iree_cache: Any = None,
    iree_driver: str | None = None,
) -> IreeModel:
    """Judge, compile and bind the blob ``data`` described by the MLmodel section ``meta``.

    ``read_module(prepared)`` returns the prepared module's bytes; ``read_params(leaves)`` the
    params arrays for ``[(name, shape, dtype)]``; both None for a bare blob.
    """
    description = blob.describe(data, source=source)
    prepared = prepared_section(meta, data)
    original = reader.read_module(data)
    verdict = iree_verdict.assess(
        description,
        dialects=mlir_bytecode.module_dialects(original),
        prepared=prepared,
        allow_other_platform=allow_other_platform,
    )
    iree_verdict.enforce(verdict, allow_incompatible=allow_incompatible)
    use_prepared = bool(prepared and prepared.get("module"))
    if use_prepared and read_module is None:
        raise ArtifactError(
            "This model's IREE preparation names a prepared module, which only a model "
            "directory holds: load the model directory, not the bare blob."
        )
    module = read_module(prepared) if use_prepared else original
    params: list[Any] = []
    if meta.get("params") and read_params is not None:
        names = param_leaf_names(description, prepared, meta)
        avals = description.in_avals[: len(names)]
        from jaxexp_mlflow.iree.shapes import Aval

        parsed = [Aval.parse(a) for a in avals]
        params = read_params([(n, a.dims, a.dtype) for n, a in zip(names, parsed, strict=True)])
    constraints = tuple((prepared or {}).get("shape_constraints") or ())
    source_name = (
        f"the prepared module {prepared['module']}"
        if use_prepared
        else "the blob's StableHLO module"
    )
    needed = iree_verdict.specialized(verdict)
    if needed or static_wanted(meta, description):
        try:
            model: IreeModel = _static_model(
                module, description, meta, params, constraints, iree_cache, iree_driver, source_name
            )
        except IncompatibleError as err:
            if needed:
                raise IncompatibleError(f"{err.message}\n{STATIC_WAY_OUT}") from None
            _logger.warning(
                "jaxexp: IREE: the model could not be compiled per batch size (%s); "
                "compiling one module for every batch size instead",
                str(err).splitlines()[0][:300],
            )
        else:
            model.verdict = verdict
            return model
    entry = batch1_entry(
        description, len(params), platform_index(description.platforms), constraints
    )
    vmfb = compiler.compiled(module, cache=iree_cache, entry=entry)
    model = IreeModel(
        vmfb,
        description,
        meta,
        params,
        platform_index=platform_index(description.platforms),
        constraints=constraints,
        driver=iree_driver,
        source=source_name,
    )
    model.verdict = verdict
    return model


def _static_model(
    module: bytes,
    description: Any,
    meta: dict[str, Any],
    params: list[Any],
    constraints: tuple[str, ...],
    iree_cache: Any,
    iree_driver: str | None,
    source: str,
) -> IreeModel:
    """The model compiled per batch size (``iree.static``), batch 1 compiled now."""
    index = platform_index(description.platforms)

    def vmfb_for(size: int) -> Any:
        entry = sized_entry(
            STATIC, description, len(params), size, index, constraints, bind_params=True
        )
        if entry is None:
            raise IncompatibleError(
                f"The model cannot be specialized to batch {size}: expected inputs with one "
                f"dimension variable whose constraints {list(constraints)} allow {size}. "
                "Load it with the JAX backend (backend='jax')."
            )
        return compiler.compiled(module, cache=iree_cache, entry=entry)

    return StaticIreeModel(
        vmfb_for,
        description,
        meta,
        params,
        rows_independent=rows_independent(meta),
        platform_index=index,
        constraints=constraints,
        driver=iree_driver,
        source=source,
        bound_params=True,
    )


def load_directory(
    path: str | os.PathLike,
    meta: dict[str, Any],
    *,
    allow_incompatible: bool = False,
    allow_other_platform: bool = False,
    iree_cache: Any = None,
    iree_driver: str | None = None,
    model_files: Any = None,
    **_ignored: Any,
) -> IreeModel:
    """Load the model directory ``path`` (MLmodel ``jaxexp`` section ``meta``) onto IREE.

    ``model_files`` (``store.model_files.ModelFiles``): the directory as the caller has read it;
    its blob, where already read and checked, is not read again."""
    data = None if model_files is None else model_files.blob_if_read()
    if data is None:
        data = files.read_blob(path, meta)
    source = str(Path(path, meta.get("exported_file") or files.EXPORTED_FILE))
    model = build(
        data,
        meta,
        source=source,
        read_module=lambda prepared: files.read_prepared(path, prepared),
        read_params=lambda leaves: files.read_params(path, meta, leaves, model_files=model_files),
        allow_incompatible=allow_incompatible,
        allow_other_platform=allow_other_platform,
        iree_cache=iree_cache,
        iree_driver=iree_driver,
    )
    selfcheck.check_reference(model, path, meta)  # no numbers handed out unchecked
    return model
