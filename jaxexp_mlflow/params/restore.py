"""Read a params checkpoint back into jax arrays laid out as a target tree.

Before any data: the directory is checked against its manifest (``params.manifest``) and its
tree against the target (``params.tree``), from ``_METADATA`` and the arrays' zarr metadata
(``params.layout.plain_tree``) or, for other checkpoints, Orbax's metadata. Then each
uncompressed array bound for one device is read by ``codec.zarr`` (``preadv`` into an aligned
buffer that ``jax.device_put`` adopts, or a mapping; every array prepared first, then all read
at once: ``zarr.read_all``), every other leaf (sharded targets,
zstd, OCDBT) by Orbax's own restore, in one call. Nothing here consults how the checkpoint was
written or uploaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.params import layout, orbax_io
from jaxexp_mlflow.params.tree import compare, flat, raise_mismatch

#: A leaf the fast path leaves to Orbax's restore (Orbax itself, ~0.3 s to import, is imported
#: only when there is one).
_ORBAX = object()
_HOST = object()  # a leaf read by the fast path, placed with the others in one transfer

#: Host bytes the fast path reads ahead before it sends them to an accelerator in one batched
#: transfer (env ``JAXEXP_RESTORE_FLUSH_BYTES``): params bound for a GPU or TPU never sit whole
#: in host memory, only this much at a time. CPU targets adopt the host buffers (no copy), so
#: they are placed together at the end.
FLUSH_BYTES = 512 * 1024**2

#: How the last restore_params call read its leaves ({"fast": n, "orbax": m}); for benchmarks
#: and tests.
LAST_RESTORE_STATS: dict[str, int] = {}


def verify_manifest(directory: str | os.PathLike, *, mlmodel: dict[str, Any] | None = None) -> Any:
    """Check the checkpoint at ``directory`` against its manifest (``params.manifest``).

    File set, sizes, regular files inside the directory, and the CRC-32C of every file except
    the array data, which is checked as it is read. Returns the ``Manifest``; raises
    :class:`ArtifactError` when the manifest is missing or a file differs from it. ``mlmodel``:
    the parsed MLmodel of the model directory holding it, if the caller has it (not read again).
    """
    from jaxexp_mlflow.codec.zarr import is_chunk_file
    from jaxexp_mlflow.params import manifest

    return manifest.verify_checkpoint(
        directory, checksum=lambda rel: not is_chunk_file(rel), mlmodel=mlmodel
    )


def checkpoint_tree(directory: str | os.PathLike) -> Any:
    """The checkpoint's tree of ``jax.ShapeDtypeStruct`` (metadata only, no array data read).

    Containers come back as Orbax stores them: dicts and lists (tuples are stored as lists);
    empty containers and None leaves are kept. To compare with an expected tree whose containers
    differ (tuples, FrozenDict, nnx.State...), use :func:`check_checkpoint`. ``directory`` may
    also be a CheckpointManager step directory holding one item.
    """
    path = Path(directory)
    path = layout.require_item_dir(path if not path.is_dir() else layout.find_item_dir(path))
    layout.read_metadata(path)  # ArtifactError when it is not JSON
    return orbax_io.metadata_tree(path)


def check_checkpoint(directory: str | os.PathLike, target: Any) -> None:
    """Raise :class:`ParamsMismatchError` unless the checkpoint's arrays fit ``target``.

    Compares leaf paths (dict keys, sequence indices and attribute names alike, so a tuple in
    ``target`` matches the list Orbax stored), shapes and dtypes; reads metadata only. Every
    differing leaf is listed, e.g. ``params['w']: expected float32[784,10], found
    float32[784,12]``.
    """
    path = Path(directory)
    raise_mismatch(path, compare(flat(checkpoint_tree(path)), target))


def restore_params(
    directory: str | os.PathLike,
    *,
    target: Any,
    mapped: bool | dict[str, int] | None = False,
    mlmodel: dict[str, Any] | None = None,
) -> Any:
    """Read the checkpoint into jax arrays laid out as ``target``.

    ``target`` is a pytree of ``jax.ShapeDtypeStruct`` with the exact structure expected; when a
    leaf has ``.sharding`` the array is read straight into that sharding (each device reads only
    its shard), otherwise onto the first local device. A structure, shape or dtype difference
    raises :class:`ParamsMismatchError` listing every differing leaf; a missing or damaged
    checkpoint raises :class:`ArtifactError`.

    ``mapped=True`` maps each array held whole in one file read-only instead of copying it
    (checksummed all the same): no new memory is touched. Only for a directory this process
    owns and nobody else writes, such as ``load_model``'s private download directory; a mapped
    file truncated by another process would kill this one (SIGBUS). ``mapped`` may also be a
    dict ``{file path relative to directory: CRC-32C}`` of checksums this process computed
    over those very files (as its download wrote them), used instead of reading them again.
    ``mlmodel``: the parsed MLmodel of the model directory holding the checkpoint, when the
    load has it (``store.model_files``): the manifest's binding is checked against it.
    """
    import jax

    from jaxexp_mlflow.codec import zarr

    # None: copy; a dict (checksums already known, maybe none): map
    known = {} if mapped is True else (None if mapped is False else mapped)
    path = layout.require_item_dir(directory)
    manifest = verify_manifest(path, mlmodel=mlmodel)
    meta = layout.read_metadata(path, manifest.held)  # parsed as the manifest check read it
    plain = layout.plain_tree(path, meta, manifest.files, manifest.held)
    if plain is None:
        check_checkpoint(path, target)
    else:
        raise_mismatch(path, compare(plain, target))
    layout.check_leaf_names(target)
    default_sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    ocdbt = layout.uses_ocdbt(path, meta)
    stats = {"fast": 0, "orbax": 0}
    hosts: list[Any] = []  # what the fast path prepared (or read) and has not yet placed
    shardings: list[Any] = []
    placed: list[Any] = []  # the device arrays, in the order the fast path read them
    flush_at = settings.JAXEXP_RESTORE_FLUSH_BYTES.get(FLUSH_BYTES)
    pending = [0]  # host bytes read and not yet placed

    def flush() -> None:
        if hosts:
            try:  # the files of every array at once, spread over the read threads
                arrays = zarr.read_all(hosts)
            except OSError as e:
                raise ArtifactError(
                    f"Cannot read the params from {path}: expected readable array files, found "
                    f"{type(e).__name__}: {e}. Re-log the model with its params."
                ) from e
            placed.extend(jax.device_put(arrays, shardings))  # one batched transfer
            hosts.clear()
            pending[0] = 0
            shardings.clear()

    def fast(kp: Any, sds: Any) -> Any:
        sharding = getattr(sds, "sharding", None) or default_sharding
        if ocdbt or len(sharding.device_set) != 1:
            return _ORBAX
        tokens = tuple(layout.key_token(k) for k in kp)
        leaf = plain.get(tokens) if plain is not None else None
        try:
            host = zarr.prepare_array(
                path,
                layout.dir_name(tokens),
                sds.shape,
                sds.dtype,
                manifest,
                leaf.zarr if leaf else None,
                known,
                leaf.info if leaf else None,
            )
        except zarr.NotPlain:
            return _ORBAX
        except OSError as e:
            raise ArtifactError(
                f"Cannot read params{jax.tree_util.keystr(kp)} from {path}: expected a readable "
                f"array file, found {type(e).__name__}: {e}. Re-log the model with its params."
            ) from e
        stats["fast"] += 1
        hosts.append(host)
        shardings.append(sharding)
        pending[0] += host.nbytes
        if pending[0] >= flush_at and _on_accelerator(sharding):
            flush()  # straight into device memory: no full host copy of the params
        return _HOST

    restored = jax.tree_util.tree_map_with_path(fast, target)
    flush()
    arrays = iter(placed)
    restored = jax.tree.map(lambda r: next(arrays) if r is _HOST else r, restored)
    manifest.verify_files()  # what the fast path did not read, before Orbax reads it
    stats["orbax"] = sum(x is _ORBAX for x in jax.tree.leaves(restored))
    LAST_RESTORE_STATS.clear()
    LAST_RESTORE_STATS.update(stats)
    if not stats["orbax"]:  # every leaf read by the fast path: Orbax is not even imported
        return restored
    import orbax.checkpoint as ocp

    todo = jax.tree.map(lambda sds, r: sds if r is _ORBAX else ocp.PLACEHOLDER, target, restored)
    from_orbax = orbax_io.restore(path, todo, default_sharding)
    return jax.tree.map(lambda r, o: o if r is _ORBAX else r, restored, from_orbax)


def _on_accelerator(sharding: Any) -> bool:
    """Whether a sharding's devices are not the host CPU's (a transfer copies the buffer)."""
    return any(getattr(d, "platform", "cpu") != "cpu" for d in sharding.device_set)
