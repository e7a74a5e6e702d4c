"""Load a jaxexp model directory (or a bare blob) onto the IREE runtime, without importing JAX.

Order, as in ``runtime.loader``: read and verify the blob, describe it with the jax-free reader,
reach the IREE verdict (refuse what cannot run, with the reason), then read the params, compile
(or find in the cache) and bind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jaxexp_mlflow.codec import blob, mlir_bytecode, reader
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.iree import compiler, files, trees
from jaxexp_mlflow.iree import verdict as iree_verdict
from jaxexp_mlflow.iree.model import IreeModel


def platform_index(platforms: tuple[str, ...] | list[str]) -> int | None:
    """The platform argument of a multi-platform module (position of ``cpu``; else the first)."""
    if len(platforms) < 2:
        return None
    return list(platforms).index("cpu") if "cpu" in platforms else 0


def param_leaf_names(description: Any, prepared: dict[str, Any] | None) -> list[str]:
    """Orbax directory names of the params leaves, in the module's order.

    Recorded at save time (``prepared["param_leaves"]``); derived from the blob's in_tree for
    models saved before, when the params are dicts, lists and tuples only.
    """
    if prepared and prepared.get("param_leaves") is not None:
        return list(prepared["param_leaves"])
    args = description.in_tree.children[0]
    names = trees.leaf_names(args.children[0]) if args.children else None
    if names is None:
        raise ArtifactError(
            "The params pytree holds custom nodes (e.g. Flax FrozenDict) whose key paths only "
            "JAX knows, and this model records no param leaf names. Run `jaxexp refresh` once "
            "where JAX is installed (it records them), or use the JAX backend."
        )
    return names


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
    prepared = meta.get("iree") or None
    original = reader.read_module(data)
    verdict = iree_verdict.assess(
        description,
        dialects=mlir_bytecode.module_dialects(original),
        prepared=prepared,
        allow_other_platform=allow_other_platform,
    )
    iree_verdict.enforce(verdict, allow_incompatible=allow_incompatible)
    module = read_module(prepared) if prepared and prepared.get("module") else original
    params: list[Any] = []
    if meta.get("params") and read_params is not None:
        names = param_leaf_names(description, prepared)
        avals = description.in_avals[: len(names)]
        from jaxexp_mlflow.iree.shapes import Aval

        parsed = [Aval.parse(a) for a in avals]
        params = read_params([(n, a.dims, a.dtype) for n, a in zip(names, parsed, strict=True)])
    vmfb = compiler.compiled(module, cache=iree_cache)
    model = IreeModel(
        vmfb,
        description,
        meta,
        params,
        platform_index=platform_index(description.platforms),
        constraints=tuple((prepared or {}).get("shape_constraints") or ()),
        driver=iree_driver,
    )
    model.verdict = verdict
    return model


def load_directory(
    path: str | os.PathLike,
    meta: dict[str, Any],
    *,
    allow_incompatible: bool = False,
    allow_other_platform: bool = False,
    iree_cache: Any = None,
    iree_driver: str | None = None,
    **_ignored: Any,
) -> IreeModel:
    """Load the model directory ``path`` (MLmodel ``jaxexp`` section ``meta``) onto IREE."""
    data = files.read_blob(path, meta)
    source = str(Path(path, meta.get("exported_file") or files.EXPORTED_FILE))
    return build(
        data,
        meta,
        source=source,
        read_module=lambda prepared: files.read_prepared(path, prepared),
        read_params=lambda leaves: files.read_params(path, meta, leaves),
        allow_incompatible=allow_incompatible,
        allow_other_platform=allow_other_platform,
        iree_cache=iree_cache,
        iree_driver=iree_driver,
    )
