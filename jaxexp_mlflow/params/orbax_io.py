"""Every call into Orbax, through its public API: the handler, save, metadata, restore.

The checkpoint is what ``ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)`` writes:
one directory per array (zarr2: ``.zarray`` and flat chunk files ``0.0``, no directory holding
a single file, which MLflow's HTTP artifact listing mishandles), compression off unless asked.
``ocp.StandardCheckpointer().restore(path)`` and ``ocp.PyTreeCheckpointer().restore(path)``
read it without this package. Orbax is imported inside the functions (~0.26 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxexp_mlflow.errors import ArtifactError

#: One directory per array, read by ``codec.zarr`` (docs/params.md, "Settings chosen").
USE_OCDBT = False
#: zarr2: the chunk files sit beside ``.zarray`` (``w/0.0``); zarr3 nests them (``w/c/0/0``).
USE_ZARR3 = False


def checkpoint_handler(*, use_compression: bool = False, copy_host_arrays: bool = True) -> Any:
    """The Orbax ``PyTreeCheckpointHandler`` with this package's settings (for
    CheckpointManagers too).

    ``copy_host_arrays=False`` lets Orbax write numpy leaves from their own buffers instead of
    deep-copying them first (its guard against a caller changing them during an *asynchronous*
    save): only for synchronous saves, where the caller waits for the write to finish.
    """
    import orbax.checkpoint as ocp

    kwargs: dict[str, Any] = {}
    if not copy_host_arrays:
        kwargs["type_handler_registry"] = _no_copy_registry()
    return ocp.PyTreeCheckpointHandler(
        use_ocdbt=USE_OCDBT, use_zarr3=USE_ZARR3, use_compression=use_compression, **kwargs
    )


def _no_copy_registry() -> Any:
    """Orbax's standard type handlers, except numpy arrays written without a deep copy.

    Orbax's default ``NumpyHandler`` copies every numpy leaf before writing it (a second copy of
    the params in memory, and half the save throughput). The registry is this
    package's own (``create_type_handler_registry``): Orbax's global registry, which the user's
    own checkpoints use, is left alone.
    """
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    th = ocp.type_handlers
    standard = (int, float, bytes, np.number, jax.Array, str, type(ocp.PLACEHOLDER))
    pairs = [(t, th.get_type_handler(t)) for t in standard if th.has_type_handler(t)]
    try:
        numpy_handler = th.NumpyHandler(deepcopy_host_arrays=False)
    except TypeError:  # an Orbax without the option: keep its default (copying) handler
        numpy_handler = th.get_type_handler(np.ndarray)
    return th.create_type_handler_registry(*pairs, (np.ndarray, numpy_handler))


class _DropOcdbtMergeWarning(logging.Filter):
    """Drop Orbax's "Skipping merge of OCDBT checkpoints" warning, and nothing else.

    Orbax finalizes every PyTree save by merging per-process OCDBT files, even when OCDBT is off
    as here, and warns that there was nothing to merge.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in str(record.msg)


@contextlib.contextmanager
def quiet_ocdbt_merge() -> Iterator[None]:
    """Silence that one warning on absl's logger while this package saves a non-OCDBT
    checkpoint (a filter on the logger, removed on exit; every other message still shows)."""
    logger = logging.getLogger("absl")
    flt = _DropOcdbtMergeWarning()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def save(params: Any, path: Path, *, use_compression: bool) -> None:
    """Write ``params`` as a PyTree checkpoint at ``path`` (synchronously: numpy leaves are
    written from their own buffers, no copy)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.Checkpointer(
        checkpoint_handler(use_compression=use_compression, copy_host_arrays=False)
    )
    try:
        with quiet_ocdbt_merge():
            checkpointer.save(path.absolute(), args=ocp.args.PyTreeSave(params))
    finally:
        checkpointer.close()


def metadata_tree(path: Path) -> Any:
    """The item's tree of ``jax.ShapeDtypeStruct`` from Orbax's metadata (no array data)."""
    import jax
    import numpy as np
    from orbax.checkpoint import metadata as ocp_meta

    # the handler's own metadata (the item's _METADATA), not a Checkpointer's: that one also
    # reads the checkpoint-level _CHECKPOINT_METADATA, which a CheckpointManager step keeps
    # beside its items, not inside them, and warns for every item it cannot find it in
    handler = checkpoint_handler()
    try:
        meta = handler.metadata(path.absolute())
    except Exception as e:  # orbax raises many types for a damaged checkpoint
        raise ArtifactError(
            f"Cannot read the Orbax checkpoint metadata at {path}: expected a readable PyTree "
            f"checkpoint, found {type(e).__name__}: {e}. Re-log the model with its params."
        ) from e
    finally:
        handler.close()
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if tree is None:
        raise ArtifactError(
            f"Cannot read the Orbax checkpoint metadata at {path}: expected a PyTree metadata "
            "tree in '_METADATA', found none. The artifact is damaged; re-log the model with "
            "its params."
        )
    kinds = (ocp_meta.ArrayMetadata, ocp_meta.ScalarMetadata)

    def to_sds(x: Any) -> Any:
        if isinstance(x, kinds):
            return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype))
        return x

    return jax.tree.map(to_sds, tree, is_leaf=lambda x: isinstance(x, kinds))


def restore(path: Path, todo: Any, default_sharding: Any) -> Any:
    """Orbax's restore of the leaves of ``todo`` (``ShapeDtypeStruct``, maybe with a
    sharding; ``ocp.PLACEHOLDER`` for leaves read elsewhere) straight into their shardings and
    dtypes: each device reads only its shard."""
    import jax
    import orbax.checkpoint as ocp

    def restore_arg(sds: Any) -> Any:
        if sds is ocp.PLACEHOLDER:
            return ocp.PLACEHOLDER
        return ocp.ArrayRestoreArgs(
            restore_type=jax.Array,
            sharding=getattr(sds, "sharding", None) or default_sharding,
            global_shape=tuple(sds.shape),
            dtype=sds.dtype,
        )

    restore_args = jax.tree.map(restore_arg, todo)
    checkpointer = ocp.Checkpointer(checkpoint_handler())
    try:
        return checkpointer.restore(
            path.absolute(), args=ocp.args.PyTreeRestore(item=todo, restore_args=restore_args)
        )
    except Exception as e:  # tensorstore/orbax raise ValueError/OSError/... on damaged data
        raise ArtifactError(
            f"Cannot read the params checkpoint at {path}: expected intact Orbax array data, "
            f"found {type(e).__name__}: {e}. The artifact is damaged or incomplete; re-log the "
            "model with its params."
        ) from e
    finally:
        checkpointer.close()


def version() -> str:
    """The installed orbax-checkpoint version."""
    import orbax.checkpoint as ocp

    return ocp.__version__


def compression_of(path: Path, meta: dict, name: str | None) -> str:
    """Best effort: the compression of the array ``name`` of the item (from its TensorStore
    spec, no array data); ``"none"`` for an item without arrays, ``"unknown"`` when unsure."""
    import json

    if name is None:
        return "none"
    try:
        import tensorstore as ts

        zarr3 = bool(meta.get("use_zarr3", False))
        if meta.get("use_ocdbt", True):
            kv = {"driver": "ocdbt", "base": f"file://{path.resolve()}/", "path": name}
        else:
            kv = {"driver": "file", "path": os.fspath(path / name)}
        store = ts.open({"driver": "zarr3" if zarr3 else "zarr", "kvstore": kv}, read=True).result()
        spec = store.spec().to_json()["metadata"]
        text = json.dumps(spec.get("codecs", spec.get("compressor")))
        for algo in ("zstd", "blosc", "gzip", "zlib", "bz2", "lz4"):
            if algo in text:
                return algo
        return "none"
    except Exception:  # noqa: BLE001 - description only, never fatal
        return "unknown"
